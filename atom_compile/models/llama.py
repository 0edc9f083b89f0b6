"""A small Llama-style decoder with a paged KV cache, for the CLI, the tests and benchmarks.

RMSNorm, rotary embeddings, grouped-query attention through `aiter::unified_attention_with_output`,
a SwiGLU MLP; seeded random weights. The compiled backbone is `LlamaModel`, whose forward is
`(input_ids, positions) -> hidden_states`: attention reads its metadata from the forward
context, so the same forward runs eagerly, compiled, or replayed from CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..decorators import get_current_config, support_torch_compile
from ..errors import AtomValueError
from ..ops import attention as _attention  # noqa: F401  (registers aiter::unified_attention_with_output)
from ..ops.linear import op as small_m_linear_op
from ..runtime.graphs import token_graph


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False


PRESETS: dict[str, LlamaConfig] = {
    # CPU tests and the CLI's default: compiles in seconds.
    "tiny": LlamaConfig(),
    # Llama-3.2-1B's dimensions (random weights) for GPU benchmarks.
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position=8192, tie_word_embeddings=True,
    ),
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """A named preset, with fields overridden (e.g. num_layers=32)."""
    if name not in PRESETS:
        raise AtomValueError(f"model preset: got {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_name: str, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5
        self.layer_name = layer_name
        # Not a submodule: one table shared by all layers, held by the model.
        self.__dict__["rotary"] = rotary
        self.kv_cache: Optional[torch.Tensor] = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = torch.empty_like(q)
        if self.kv_cache is not None and _attention.kv_cache_op_available():
            # the cache, not the name: every layer traces to the same graph (layer_regions.py)
            torch.ops.atom.paged_attention_with_output(q, k, v, out, self.kv_cache, self.scale)
        else:
            torch.ops.aiter.unified_attention_with_output(q, k, v, out, self.layer_name)
        return self.o_proj(out.view(-1, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_name: str, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_name, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@token_graph
@support_torch_compile
class LlamaModel(nn.Module):
    """The compiled backbone: `(input_ids, positions) -> hidden_states`."""

    def __init__(self, cfg: LlamaConfig, prefix: str = "model"):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, f"{prefix}.layers.{i}.self_attn", self.rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; `no_compile_layers` maps layer names to attention layers."""

    def __init__(self, cfg: LlamaConfig, prefix: str = "model", compilation_config: Any = None):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, prefix, compilation_config=compilation_config)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.no_compile_layers: dict[str, Attention] = {
            layer.self_attn.layer_name: layer.self_attn for layer in self.model.layers
        }
        self._register_layers(compilation_config if compilation_config is not None else get_current_config())

    def _register_layers(self, cfg: Any) -> None:
        registry = getattr(getattr(cfg, "compilation_config", cfg), "static_forward_context", None)
        if registry is None:
            return
        for name, layer in self.no_compile_layers.items():
            if registry.get(name, layer) is not layer:
                raise AtomValueError(f"attention layer name {name!r} is already registered in this config by "
                                 "another model; give the second model another prefix")
            registry[name] = layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # eager after the graph: at decode's few rows the small-M kernel reads the 0.5 GB head
        # of a 128k vocabulary at bandwidth, where a cuBLAS GEMM does not (F.linear otherwise)
        return small_m_linear_op()(hidden, self.lm_head.weight, self.lm_head.bias)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One cache per layer, [2, num_blocks + 1, block_size, kv_heads, head_dim]; the extra
        last block takes the writes of padding rows."""
        p = self.lm_head.weight
        for layer in self.no_compile_layers.values():
            layer.kv_cache = kv_cache_tensor(2, num_blocks + 1, block_size, self.cfg.num_kv_heads, self.cfg.head_dim,
                                             dtype=p.dtype, device=p.device)


def kv_cache_tensor(*shape: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A zeroed KV cache whose block count (dim 1) a trace keeps symbolic: the cache enters the
    graph as an input of the attention op, and a cache of another size (the block count follows
    free memory) must neither change the cache key nor miss the compiled code."""
    cache = torch.zeros(*shape, dtype=dtype, device=device)
    torch._dynamo.maybe_mark_dynamic(cache, 1)
    return cache


def build_model(
    cfg: LlamaConfig | str = "tiny",
    *,
    compilation_config: Any = None,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    seed: int = 0,
    prefix: str = "model",
) -> LlamaForCausalLM:
    """A LlamaForCausalLM with seeded random weights (the same seed gives the same weights)."""
    if isinstance(cfg, str):
        cfg = preset(cfg)
    device = torch.device(device)
    # Built and initialised where it will run: a 1B-parameter model is not worth a trip through
    # the CPU. The weights depend on the seed and the device type.
    with torch.device(device):
        model = LlamaForCausalLM(cfg, prefix, compilation_config=compilation_config)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device=device)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * 0.02 * (2.0 if "embed" in name else 1.0))
    model.requires_grad_(False)
    return model.to(dtype=dtype).eval()
