"""`torch.compile(model, backend="atom", options={...})` through torch's backend entry point.

pyproject.toml registers `atom = "atom_compile.backends.dynamo_entry:atom_backend"` in the
`torch_dynamo_backends` group, so after `pip install` torch finds the backend by name. torch
calls it once per graph as `atom_backend(gm, example_inputs, options=options)`; `options` are
CompilationConfig fields (vLLM's `mode` and `backend` accepted too), validated by
`CompilationConfig.from_dict`. ATOM_COMPILE_CONFIG (a JSON object, or the path of a JSON or
YAML file holding one) gives the fields where no options do; options override it field by field
(a level or mode in the options replaces both of the environment's). Without a level the graph
compiles at level 3 (piecewise): a user who names the backend wants it to compile.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Optional

import torch.fx as fx

from .. import envs
from ..config import CompilationConfig, Config, ConfigError
from .atom_backend import AtomBackendGraphs

DEFAULT_LEVEL = 3
ENV_NAME = "ATOM_COMPILE_CONFIG"
_ALLOWED = "a JSON object of CompilationConfig fields, or the path of a .json / .yaml file holding one"


def _parse_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(ENV_NAME, path, f"{_ALLOWED} (cannot read it: {exc.strerror})") from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(ENV_NAME, path, f"{_ALLOWED} (reading YAML needs PyYAML: pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(ENV_NAME, path, f"{_ALLOWED} (not valid YAML: {str(exc).splitlines()[0]})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(ENV_NAME, path, f"{_ALLOWED} (not valid JSON: {exc.msg}, line {exc.lineno})") from None


def environment_fields(text: Optional[str]) -> dict[str, Any]:
    """The CompilationConfig fields ATOM_COMPILE_CONFIG holds ({} when unset)."""
    if not text:
        return {}
    if text.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(ENV_NAME, text, f"{_ALLOWED} (not valid JSON: {exc.msg}, column {exc.colno})") from None
    elif os.path.isfile(os.path.expanduser(text)):
        data = _parse_file(os.path.expanduser(text))
    else:
        raise ConfigError(ENV_NAME, text, f"{_ALLOWED} (neither a JSON object nor an existing file)")
    if not isinstance(data, Mapping):
        raise ConfigError(ENV_NAME, text, f"{_ALLOWED} (it holds a {type(data).__name__})")
    return dict(data)


def config_from_options(options: Optional[Mapping[str, Any]], environment: Optional[str] = None) -> Config:
    """The Config that torch.compile's `options` over ATOM_COMPILE_CONFIG's text stand for
    (ConfigError on a bad one; a bad field of the environment's names the variable)."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError("torch.compile options", options, "a dict of CompilationConfig fields")
    from_env = environment_fields(environment)
    options = dict(options or {})
    data = dict(from_env)
    if "level" in options or "mode" in options:
        data.pop("level", None)
        data.pop("mode", None)
    data.update(options)
    if "level" not in data and "mode" not in data:
        data["level"] = DEFAULT_LEVEL
    try:
        return Config(compilation_config=CompilationConfig.from_dict(data))
    except ConfigError as exc:
        if _from_environment(exc, set(from_env) - set(options)):
            allowed = str(exc).split("; allowed: ", 1)[-1]
            raise ConfigError(f"{ENV_NAME}: {exc.field_name}", exc.value, allowed) from None
        raise


def _from_environment(exc: ConfigError, env_only: set[str]) -> bool:
    """Whether the bad value came from ATOM_COMPILE_CONFIG (a field the options did not set)."""
    field = exc.field_name.rsplit(".", 1)[-1]
    return field in env_only or (isinstance(exc.value, str) and exc.value in env_only)


def atom_backend(gm: fx.GraphModule, example_inputs: list[Any],
                 options: Optional[Mapping[str, Any]] = None) -> Callable:
    """The backend torch finds as "atom": each graph gets an atom-compile backend of its own."""
    environment = envs.read()
    cfg = config_from_options(options, environment.compile_config)
    cache_dir = cfg.compilation_config.cache_dir
    if cache_dir and not environment.cache_disabled:
        environment = dataclasses.replace(environment, cache_root=envs.cache_root(cache_dir))
    return AtomBackendGraphs(cfg, environment=environment)(gm, example_inputs)
