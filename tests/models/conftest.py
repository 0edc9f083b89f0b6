"""One atom-compile cache per module (tmp_path_factory) and a Dynamo recompile counter."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models-cache"))
