"""A small built-in Llama-style decoder for the CLI, tests and benchmarks."""

from .llama import PRESETS, LlamaConfig, LlamaForCausalLM, LlamaModel, build_model, preset

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "build_model", "preset"]
