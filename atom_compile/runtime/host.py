"""Host mode's hook into vLLM: the `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (engine and workers) before building models.
It imports nothing of vLLM (atom-compile works where vLLM is absent) and does what the host
needs from us: the reference attention op registered for the models we compile (unless the
attention toggle leaves attention to the host). `Config.from_vllm(vllm_config)` then gives the
model our Config in host mode: our compile and cache, the host's CUDA graphs.
"""

from __future__ import annotations

import logging

from .. import envs

logger = logging.getLogger("atom_compile")

_registered = False


def register() -> bool:
    """The plugin hook; True if it registered anything (once per process)."""
    global _registered
    if envs.vllm_plugin_disabled():
        logger.info("atom-compile: vLLM plugin disabled (ATOM_COMPILE_DISABLE_VLLM_PLUGIN)")
        return False
    if _registered:
        return True
    if envs.vllm_plugin_attention_disabled():
        logger.info("atom-compile: vLLM plugin: attention stays the host's (ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION)")
    else:
        from ..ops import attention  # noqa: F401  (registers aiter::unified_attention_with_output)
    from ..ops import linear  # noqa: F401  (atom::small_m_linear)
    _registered = True
    logger.info("atom-compile: vLLM plugin registered (host mode: build the model's Config with "
                "atom_compile.Config.from_vllm(vllm_config))")
    return True
