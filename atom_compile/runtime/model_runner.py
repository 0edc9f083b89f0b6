"""ModelRunner: record the capture ladder, then run each step eagerly or from a recording.

    runner = ModelRunner(model, config, metadata_builder)
    runner.capture_cudagraph()
    logits, hidden = runner.step(steps)       # or: set the forward context, then run_model()

FULL replays one request graph per `(running_bs, draft_num)`; TR_HYBRID (and
FULL_AND_TR_HYBRID, recorded the same way) replays the token graph of the step's row count,
prefill included when a bucket holds its rows; FULL_DECODE_ONLY graphs decode only. Prefills
under FULL, `enforce_eager`, and batches beyond the largest bucket run eagerly. Without a
CUDA device every mode runs as NONE.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from ..config import Config, CUDAGraphMode
from ..errors import AtomTypeError, AtomValueError
from ..forward_context import get_forward_context, set_forward_context
from ..ops import jit_watch
from . import pool
from .buckets import NOT_A_BUCKET, pad_for_data_parallel, pad_to_bucket, request_bucket
from .capture_budget import budget_bytes, capture_within_budget
from .graphs import ReqGraph, TokenGraph, graph_pool_bytes, token_graph_of
from .runtime_config import RuntimeConfig

if TYPE_CHECKING:
    from ..ops.attention import SequenceStep

logger = logging.getLogger("atom_compile")
_said_no_cuda = False


def _rank0() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception as exc:  # pragma: no cover - a half-initialised process group
        logger.debug("atom-compile: cannot read the distributed rank (%s); acting as rank 0", exc)
        return True


class ModelRunner:
    """Capture and replay for one model. `model(input_ids, positions) -> hidden_states` and
    `model.compute_logits(hidden)`; `metadata_builder` makes attention metadata for capture
    batches (`build_for_capture`) and real steps (`build`) in buffers at fixed addresses.
    `config` is a Config (turned into a RuntimeConfig here) or a RuntimeConfig. Building one
    starts a warm-up: the Triton watch (ops/jit_watch.py) is off until its capture ends."""

    def __init__(self, model: Any, config: Union[Config, RuntimeConfig], metadata_builder: Any):
        global _said_no_cuda
        if isinstance(config, Config):
            config = RuntimeConfig.from_config(config)
        if not isinstance(config, RuntimeConfig):
            raise AtomTypeError(f"ModelRunner config: got {type(config).__name__}; allowed: Config or RuntimeConfig")
        self.model = model
        self.config = config
        self.builder = metadata_builder
        mode = config.cudagraph_mode
        if config.enforce_eager:
            mode = CUDAGraphMode.NONE
        if mode != CUDAGraphMode.NONE and not torch.cuda.is_available():
            if not _said_no_cuda:
                _said_no_cuda = True
                logger.info("atom-compile: no CUDA or ROCm device: cudagraph_mode %s runs as NONE", mode.name)
            mode = CUDAGraphMode.NONE
        self.mode = mode
        self.capture_sizes = list(config.capture_sizes)
        self.max_q_len = config.max_q_len
        self.req_graph = ReqGraph()
        self.graphed_sizes: list[int] = []
        # the shared graph pool's bytes after the first (largest) size's recording and after the
        # last: what the largest graph needs alone, what the whole ladder holds
        self.capture_pool_bytes: dict[int, int] = {}
        # seconds of the first size's capture, its warm-up's kernel compiles and tuning included
        self.capture_first_seconds = 0.0
        self.no_compile_layers = getattr(model, "no_compile_layers", None) or config.no_compile_layers
        # a new runner is a new warm-up (another model's first forward and capture compile its
        # own kernels, no misses of the last warm-up); its capture's end marks it warm again
        jit_watch.stop_watching()

    # --- what a step replays ---------------------------------------------------------------

    @property
    def records_token_graphs(self) -> bool:
        # FULL_AND_TR_HYBRID is recorded as TR_HYBRID (the seed's native runner).
        return self.mode.uses_tr_hybrid()

    @property
    def graphs_decode(self) -> bool:
        return self.mode != CUDAGraphMode.NONE

    @property
    def graphs_prefill(self) -> bool:
        return self.records_token_graphs

    def _token_graph(self) -> Optional[TokenGraph]:
        return token_graph_of(self.model)

    # --- capture --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_cudagraph(self) -> tuple[float, list[int]]:
        """Record every capture size, largest first. Returns (seconds, sizes ascending)."""
        if self.mode == CUDAGraphMode.NONE or not self.capture_sizes:
            return 0.0, []
        if max(self.capture_sizes) > self.config.max_num_seqs:
            raise AtomValueError(f"capture size {max(self.capture_sizes)} exceeds max_num_seqs "
                             f"({self.config.max_num_seqs})")
        modules = self.model.modules() if isinstance(self.model, torch.nn.Module) else [self.model]
        if self.records_token_graphs and not any(getattr(type(m), "_atom_token_graph", False) for m in modules):
            raise AtomTypeError(f"{type(self.model).__qualname__} has no @token_graph unit: TR_HYBRID needs "
                            "the model (or a submodule) marked @token_graph")
        # a capture is a warm-up: a second model's, after the first's ended, compiles its own
        # kernels, which are not misses of a warm-up (the watch is process-wide)
        jit_watch.stop_watching()
        start = time.perf_counter()
        sizes = sorted(self.capture_sizes, reverse=True)
        self.capture_pool_bytes = {}
        show = _rank0() and sys.stderr.isatty()
        from tqdm import tqdm

        bar = tqdm(total=len(sizes), desc="atom-compile: capturing", disable=not show, leave=False)
        sizes = self._capture_sizes(sizes, bar)
        bar.close()
        torch.cuda.synchronize()
        self.graphed_sizes = sorted(sizes)
        elapsed = time.perf_counter() - start
        pool = graph_pool_bytes()
        if sizes:
            self.capture_pool_bytes[sizes[-1]] = pool
        logger.info("atom-compile: captured %d sizes (%s) in %.2fs; the graph pool holds %.1f MiB",
                    len(sizes), self.mode.name, elapsed, pool / 2**20)
        jit_watch.mark_warmed_up()  # from here on a Triton compile is a shape the warm-up missed
        return elapsed, list(self.graphed_sizes)

    def _capture_sizes(self, sizes: list[int], bar: Any) -> list[int]:
        """Record `sizes` (descending), within cudagraph_memory_budget when set; the recorded."""
        def one(bs: int) -> None:
            start = time.perf_counter()
            first = not self.capture_pool_bytes
            self._capture_one(bs, first=first)
            if first:  # a snapshot costs ms: after the first and the last only
                self.capture_pool_bytes[bs] = graph_pool_bytes()
                self.capture_first_seconds = time.perf_counter() - start
            bar.update(1)

        budget = self.config.cudagraph_memory_budget
        if budget is None:
            for bs in sizes:
                one(bs)
            return sizes
        limit = budget_bytes(budget, torch.cuda.mem_get_info()[0])
        recorded, skipped = capture_within_budget(sizes, one, graph_pool_bytes, limit)
        if skipped:
            logger.info("atom-compile: cudagraph_memory_budget (%.1f MiB) reached at %.1f MiB: skipped "
                        "capture sizes %s (they run on the next larger graph, or eagerly)",
                        limit / 2**20, graph_pool_bytes() / 2**20, sorted(skipped))
        return recorded

    def _capture_one(self, bs: int, first: bool = False) -> None:
        q = self.max_q_len
        input_ids, positions, meta, ctx = self.builder.build_for_capture(bs, q)
        layers = self.no_compile_layers
        with set_forward_context(meta, None, ctx, no_compile_layers=layers):
            hidden = self.model(input_ids, positions)  # warm-up: compiles on the first size, loads kernels
            if first and pool.reservable():  # the largest size: its need is held for all (runtime/pool.py)
                pool.reserve(self._forward_peak_bytes(input_ids, positions))
            # the logits run after the replay, outside the recording: their kernels (a Triton
            # LM head at few rows) are compiled and tuned here, before warm-up ends, too
            self.model.compute_logits(hidden)
        torch.cuda.synchronize()
        if self.records_token_graphs:
            with set_forward_context(meta, None, ctx, no_compile_layers=layers, tr_graph="record"):
                self.model(input_ids, positions)
            ctx.is_prefill = True  # the prefill pass: reuses the recording unless per_phase
            with set_forward_context(meta, None, ctx, no_compile_layers=layers, tr_graph="record"):
                self.model(input_ids, positions)
            ctx.is_prefill = False
        else:
            with set_forward_context(meta, None, ctx, no_compile_layers=layers):
                self.req_graph.record(lambda: self.model(input_ids, positions), request_bucket(bs, q))
        torch.cuda.synchronize()

    def _forward_peak_bytes(self, input_ids: torch.Tensor, positions: torch.Tensor) -> int:
        """Bytes a forward allocates at its peak, its output included: a second warm-up run (the
        first may have compiled). Resets the allocator's peak statistics."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.model(input_ids, positions)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    # --- steps -----------------------------------------------------------------------------

    def padding_for(self, steps: Sequence["SequenceStep"]) -> tuple[Optional[int], Optional[int]]:
        """(padded sequence count, padded row count) for a step: the bucket a recording holds."""
        if not self.graphed_sizes:
            return None, None
        rows = sum(len(s.token_ids) for s in steps)
        is_decode = all(len(s.token_ids) <= self.max_q_len and s.start_pos > 0 for s in steps)
        uniform = is_decode and all(len(s.token_ids) == self.max_q_len for s in steps)
        if self.config.dp_group is not None:
            # every data-parallel rank takes part, every step: all replay one bucket, or none does
            padded = pad_for_data_parallel(len(steps) if uniform else NOT_A_BUCKET, self.graphed_sizes,
                                           self.config.dp_group)
            if padded is not None:
                return padded, None
        elif uniform:
            padded = pad_to_bucket(len(steps), self.graphed_sizes)
            if padded is not None:
                return padded, None
        if self.records_token_graphs:
            graphs = self._token_graph()
            phase = "decode" if is_decode else "prefill"
            sizes = graphs.captured_sizes(phase) if graphs is not None else []
            padded_rows = pad_to_bucket(rows, sizes)
            if padded_rows is not None:
                return None, padded_rows
        return None, None

    def prepare(self, steps: Sequence["SequenceStep"]):
        """Build the step's inputs and metadata (padded to a bucket) and set the forward context.
        Returns (input_ids, scope); use the scope as a context manager around run_model."""
        padded_seqs, padded_rows = self.padding_for(steps)
        input_ids, positions, meta, ctx = self.builder.build(steps, padded_seqs, padded_rows)
        scope = set_forward_context(meta, None, ctx, no_compile_layers=self.no_compile_layers)
        return input_ids, scope

    @torch.inference_mode()
    def step(self, steps: Sequence["SequenceStep"]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward step for `steps`; logits and hidden states of the real rows only."""
        input_ids, scope = self.prepare(steps)
        with scope:
            logits, hidden = self.run_model(input_ids)
            rows = get_forward_context().attn_metadata.num_actual_tokens
        return logits[:rows], hidden[:rows]

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The seed's dispatch: eager, request-graph replay, or token-graph replay.

        The hidden states returned by a replay are a view of the recording's output, valid until
        the next step; the logits are a fresh tensor."""
        fc = get_forward_context()
        ctx = fc.context
        positions = ctx.positions
        rows = input_ids.shape[0]
        mode = self.mode
        if mode == CUDAGraphMode.NONE or not self.graphed_sizes:
            hidden = self.model(input_ids, positions)
        elif not ctx.is_prefill and not self.records_token_graphs and ctx.batch_size <= self.graphed_sizes[-1] \
                and request_bucket(ctx.running_bs, fc.attn_metadata.max_seqlen_q) in self.req_graph:
            out = self.req_graph.replay(request_bucket(ctx.running_bs, fc.attn_metadata.max_seqlen_q))
            hidden = out[:rows]
        elif self.records_token_graphs:
            fc.tr_graph = "replay"
            try:
                hidden = self.model(input_ids, positions)
            finally:
                fc.tr_graph = None
        else:
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden), hidden

    def pool_memory(self) -> int:
        """Bytes the CUDA caching allocator holds for the shared graph pool (0 without CUDA)."""
        return graph_pool_bytes()
