"""A small built-in Llama-style decoder for the CLI, tests and benchmarks."""

from .llama import PRESETS, LlamaConfig, LlamaForCausalLM, LlamaModel, build_model, preset
from .llama_tp import TPLlamaForCausalLM, shard_llama

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "TPLlamaForCausalLM", "build_model", "preset",
           "shard_llama"]
