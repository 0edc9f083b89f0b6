"""A plain-PyTorch Llama decoder for decode.py's peer arm: the same dimensions as the built-in
model, a static (contiguous, unpaged) KV cache of shape [layers, 2, batch, kv_heads, max_len,
head_dim], SDPA over the first `length` positions, one token per sequence per step. It is what an
engineer writes without atom-compile and then compiles with torch.compile(mode="reduce-overhead").
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
        self.register_buffer("kv", torch.randn(cfg.num_layers, 2, batch, cfg.num_kv_heads, context + 1, hd, **kw))
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
        mask = torch.arange(self.context + 1, device=ids.device)[None, :] <= pos[:, None]  # [B, L]
        for i, layer in enumerate(self.layers):
            y = F.rms_norm(x, (x.shape[-1],), layer.norm1, cfg.rms_norm_eps)
            q, k, v = F.linear(y, layer.qkv).split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], -1)
            q = self._rope(q.view(b, cfg.num_heads, hd), pos)
            k = self._rope(k.view(b, cfg.num_kv_heads, hd), pos)
            cache = self.kv[i]
            rows = torch.arange(b, device=ids.device)
            cache[0, rows, :, pos] = k
            cache[1, rows, :, pos] = v.view(b, cfg.num_kv_heads, hd)
            attn = F.scaled_dot_product_attention(q[:, :, None, :], cache[0, :b], cache[1, :b],
                                                  attn_mask=mask[:b, None, None, :], enable_gqa=True)
            x = x + F.linear(attn.reshape(b, -1), layer.o)
            y = F.rms_norm(x, (x.shape[-1],), layer.norm2, cfg.rms_norm_eps)
            gate, up = F.linear(y, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_norm_eps)
        return F.linear(x, self.embed)
