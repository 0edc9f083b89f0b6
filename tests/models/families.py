"""Tiny random-weight transformers decoders (no hub): one constructor per family."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 128
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)


def _config(family: str):
    t = transformers
    if family == "gpt2":
        return t.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=64)
    if family == "opt":
        return t.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0)
    if family == "gemma3":
        return t.Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=16)
    if family == "qwen3":
        return t.Qwen3Config(**_COMMON, head_dim=8)
    if family == "mixtral":
        return t.MixtralConfig(**_COMMON, num_local_experts=2, num_experts_per_tok=1)
    if family == "qwen3moe":
        return t.Qwen3MoeConfig(**_COMMON, head_dim=8, num_experts=2, num_experts_per_tok=1,
                                moe_intermediate_size=32)
    cls = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config, "mistral": t.MistralConfig, "phi3": t.Phi3Config}
    return cls[family](**_COMMON)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "opt", "gpt2", "mixtral", "qwen3moe"]


def tiny_model(family: str) -> torch.nn.Module:
    """The family's decoder: 1 layer, hidden 32, vocab 128, fp32, SDPA attention, eval, seeded."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa")
    return model.eval()


# calls that change batch size and sequence length (none of size 0 or 1)
SHAPES = [(2, 8), (3, 5), (2, 11)]


def inputs(batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 100 + seq)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)
