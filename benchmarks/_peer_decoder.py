"""A plain-PyTorch Llama decoder for decode.py's peer arm: the same dimensions as the built-in
model, a static (contiguous, unpaged) KV cache, one key and one value buffer per layer of shape
[batch, kv_heads, max_len, head_dim] (as transformers' StaticCache keeps it), written in place
at each row's position, SDPA over the whole cache, one token per sequence per step. It is what an engineer
writes without atom-compile and then compiles with torch.compile(mode="reduce-overhead").

decode.py gives every sequence the same length, the cache's (context + 1 positions, the new
token's at `context`), so the attention needs no mask: with one, SDPA's GQA (`enable_gqa`) has
no fused kernel and takes the math path, which repeats the keys and values per query head (at
batch 32 that was 25 ms a step, measuring SDPA's fallback rather than the peer). The buffers
are one per layer, not views of one tensor: Inductor writes a buffer in place, but functionalises
a write into a view of a larger buffer as a copy of the whole buffer, every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PeerDecoder(nn.Module):
    def __init__(self, cfg, batch: int, context: int, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.context = cfg, context
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, h, **kw) * 0.02)
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = nn.Module()
            layer.qkv = nn.Parameter(torch.randn(qkv, h, **kw) * 0.02)
            layer.o = nn.Parameter(torch.randn(h, cfg.num_heads * hd, **kw) * 0.02)
            layer.gate_up = nn.Parameter(torch.randn(2 * cfg.intermediate_size, h, **kw) * 0.02)
            layer.down = nn.Parameter(torch.randn(h, cfg.intermediate_size, **kw) * 0.02)
            layer.norm1 = nn.Parameter(torch.ones(h, **kw))
            layer.norm2 = nn.Parameter(torch.ones(h, **kw))
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(h, **kw))
        for i in range(cfg.num_layers):
            for name in ("k", "v"):
                self.register_buffer(f"{name}{i}", torch.randn(batch, cfg.num_kv_heads, context + 1, hd, **kw))
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [B, hd/2]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, hd = self.cfg, self.cfg.head_dim
        b = ids.shape[0]
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            y = F.rms_norm(x, (x.shape[-1],), layer.norm1, cfg.rms_norm_eps)
            q, k, v = F.linear(y, layer.qkv).split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], -1)
            q = self._rope(q.view(b, cfg.num_heads, hd), pos)
            k = self._rope(k.view(b, cfg.num_kv_heads, hd), pos)
            k_cache, v_cache = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            rows = torch.arange(b, device=ids.device)
            k_cache[rows, :, pos] = k
            v_cache[rows, :, pos] = v.view(b, cfg.num_kv_heads, hd)
            attn = F.scaled_dot_product_attention(q[:, :, None, :], k_cache, v_cache, enable_gqa=True)
            x = x + F.linear(attn.reshape(b, -1), layer.o)
            y = F.rms_norm(x, (x.shape[-1],), layer.norm2, cfg.rms_norm_eps)
            gate, up = F.linear(y, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_norm_eps)
        return F.linear(x, self.embed)
