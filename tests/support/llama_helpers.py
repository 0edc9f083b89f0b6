"""Running the built-in Llama in tests: a step of one prefill or a decode batch, with its
forward context, against a reference model with the same weights."""

from __future__ import annotations

from typing import Callable

import torch

import atom_compile as ac
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

BLOCK = 4


def tiny(num_layers: int = 2, **kwargs):
    return build_model(preset("tiny", num_layers=num_layers), **kwargs)


class Stepper:
    """Feeds the same steps to several models; each model gets its own KV cache."""

    def __init__(self, max_seqs: int = 8, max_tokens: int = 64, blocks_per_seq: int = 8):
        self.builder = PagedAttentionMetadataBuilder(max_seqs, max_tokens, blocks_per_seq, BLOCK)
        self.blocks_per_seq = blocks_per_seq
        self.max_seqs = max_seqs

    def allocate(self, *models) -> None:
        for m in models:
            m.allocate_kv_cache(self.max_seqs * self.blocks_per_seq, BLOCK)

    def table(self, seq: int) -> list[int]:
        return list(range(seq * self.blocks_per_seq, (seq + 1) * self.blocks_per_seq))

    def prefill(self, lengths: list[int], seed: int = 0) -> list[SequenceStep]:
        g = torch.Generator().manual_seed(seed)
        return [SequenceStep(torch.randint(1, 500, (n,), generator=g).tolist(), 0, self.table(i))
                for i, n in enumerate(lengths)]

    def decode(self, positions: list[int], tokens: list[int]) -> list[SequenceStep]:
        return [SequenceStep([t], p, self.table(i)) for i, (p, t) in enumerate(zip(positions, tokens))]

    def logits(self, model, steps, forward: Callable | None = None) -> torch.Tensor:
        ids, pos, meta, ctx = self.builder.build(steps)
        with torch.inference_mode(), ac.set_forward_context(meta, None, ctx,
                                                            no_compile_layers=model.no_compile_layers):
            hidden = (forward if forward is not None else model)(ids, pos)
            return model.compute_logits(hidden).clone()
