"""The built-in Llama, tensor-parallel over any torch.distributed process group.

Megatron's layout: qkv and gate/up are column-parallel (each rank holds its heads and its
slice of the intermediate size), o_proj and down_proj row-parallel (a partial sum, then an
all-reduce), the embedding and the LM head vocab-parallel (each rank holds a contiguous slice
of the vocabulary). Collectives are torch's functional ones, which Dynamo traces into the
graph as `_c10d_functional` ops: they stay inside Inductor pieces unless named in
`splitting_ops`. `shard_llama(full, group)` gives the TP model with the weights of a
single-process `LlamaForCausalLM`, so the two compute the same logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..decorators import get_current_config, support_torch_compile
from ..errors import AtomValueError
from ..runtime.graphs import token_graph
from .llama import Attention, LlamaConfig, LlamaForCausalLM, RMSNorm, RotaryEmbedding, kv_cache_tensor

# newer torch names the collective `all_gather_single` (its `all_gather_tensor`, the same thing,
# warns as deprecated); torch 2.11 (the GPU machine's) has only `all_gather_tensor`
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise AtomValueError(f"tensor parallel: {what} is {n}, not divisible by the group size {world}")
    return n // world


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/W, (rank + 1) * V/W) of the table; ids outside give 0, then all-reduce."""

    def __init__(self, vocab: int, hidden: int, group: Any):
        super().__init__()
        self.group, world, rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.per_rank = _split(vocab, world, "vocab_size")
        # A tensor, not a Python int: an int would be a constant of the graph, different on each
        # rank, and the ranks' graphs (and cache keys) would differ; as a buffer they are equal.
        self.register_buffer("start", torch.tensor(rank * self.per_rank), persistent=False)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return funcol.all_reduce(rows, "sum", self.group)


class RowParallelLinear(nn.Module):
    """y = x_local @ W_local^T, summed over the ranks (the input's last dim is sharded)."""

    def __init__(self, in_local: int, out: int, group: Any):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out, in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(nn.functional.linear(x, self.weight), "sum", self.group)


class TPAttention(Attention):
    """Llama's attention with this rank's heads: column-parallel qkv, row-parallel o (the
    forward is Attention's, over the local head counts)."""

    def __init__(self, cfg: LlamaConfig, world: int, layer_name: str, rotary: RotaryEmbedding, group: Any):
        nn.Module.__init__(self)  # not Attention's: it would build the full-size projections
        self.num_heads = _split(cfg.num_heads, world, "num_heads")
        self.num_kv_heads = _split(cfg.num_kv_heads, world, "num_kv_heads")
        self.head_dim = cfg.head_dim
        local = (self.num_heads + 2 * self.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, local, bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * cfg.head_dim, cfg.hidden_size, group)
        self.scale = cfg.head_dim ** -0.5
        self.layer_name = layer_name
        self.__dict__["rotary"] = rotary
        self.kv_cache: Optional[torch.Tensor] = None


class TPMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, world: int, group: Any):
        super().__init__()
        inter = _split(cfg.intermediate_size, world, "intermediate_size")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class TPDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, world: int, layer_name: str, rotary: RotaryEmbedding, group: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TPAttention(cfg, world, layer_name, rotary, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = TPMLP(cfg, world, group)

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
class TPLlamaModel(nn.Module):
    """The compiled TP backbone: `(input_ids, positions) -> hidden_states` (replicated)."""

    def __init__(self, cfg: LlamaConfig, group: Any, prefix: str = "model"):
        super().__init__()
        world = dist.get_world_size(group)
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(
            TPDecoderLayer(cfg, world, f"{prefix}.layers.{i}.self_attn", self.rotary, group)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class TPLlamaForCausalLM(nn.Module):
    """The TP decoder and its vocab-parallel LM head (logits gathered on every rank)."""

    def __init__(self, cfg: LlamaConfig, group: Any = None, prefix: str = "model", compilation_config: Any = None):
        super().__init__()
        if not dist.is_initialized():
            raise AtomValueError("TPLlamaForCausalLM: torch.distributed is not initialised; call "
                                 "dist.init_process_group (torchrun sets its environment) first")
        self.group = group if group is not None else dist.group.WORLD
        self.cfg = cfg
        self.model = TPLlamaModel(cfg, self.group, prefix, compilation_config=compilation_config)
        self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.per_rank, bias=False)
        self.no_compile_layers = {layer.self_attn.layer_name: layer.self_attn for layer in self.model.layers}
        cc = compilation_config if compilation_config is not None else get_current_config()
        LlamaForCausalLM._register_layers(self, cc)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.lm_head.weight)
        return _all_gather(local, local.dim() - 1, self.group)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One cache per layer for this rank's KV heads (see LlamaForCausalLM.allocate_kv_cache)."""
        p = self.lm_head.weight
        for layer in self.no_compile_layers.values():
            layer.kv_cache = kv_cache_tensor(2, num_blocks + 1, block_size, layer.num_kv_heads, layer.head_dim,
                                             dtype=p.dtype, device=p.device)


def _column(weight: torch.Tensor, sizes: list[int], world: int, rank: int) -> torch.Tensor:
    """This rank's rows of each consecutive block of `sizes` rows (a fused column-parallel W)."""
    return torch.cat([part.chunk(world, dim=0)[rank] for part in weight.split(sizes, dim=0)], dim=0)


def shard_llama(full: LlamaForCausalLM, group: Any = None, compilation_config: Any = None,
                prefix: str = "model") -> TPLlamaForCausalLM:
    """The TP model of this rank of `group` (default: the world) with `full`'s weights."""
    cfg = full.cfg
    tp = TPLlamaForCausalLM(_untied(cfg), group, prefix, compilation_config)
    world, rank = dist.get_world_size(tp.group), dist.get_rank(tp.group)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    src = full.state_dict()
    dst = {}
    for name, value in tp.state_dict().items():
        w = src[name]
        if name.endswith("qkv_proj.weight"):
            w = _column(w, [q, kv, kv], world, rank)
        elif name.endswith("gate_up_proj.weight"):
            w = _column(w, [cfg.intermediate_size] * 2, world, rank)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = w.chunk(world, dim=1)[rank]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            w = w.chunk(world, dim=0)[rank]
        dst[name] = w.clone()
    tp.load_state_dict(dst, strict=True)
    p = full.lm_head.weight
    return tp.to(dtype=p.dtype, device=p.device).requires_grad_(False).eval()


def _untied(cfg: LlamaConfig) -> LlamaConfig:
    """The config for the TP model: a tied head is sharded like the embedding (its copy)."""
    return dataclasses.replace(cfg, tie_word_embeddings=False)
