"""Data-parallel ranks agree on the decode bucket every step (ModelRunner.padding_for over a
gloo group, two real processes): the largest batch among them sets the bucket, and a rank in
prefill makes every rank run eagerly."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from atom_compile.ops.attention import SequenceStep


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from atom_compile.runtime.model_runner import ModelRunner
    from atom_compile.runtime.runtime_config import RuntimeConfig

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    runner = ModelRunner(object(), RuntimeConfig(capture_sizes=[1, 2, 4, 8], dp_group=dist.group.WORLD), None)
    runner.graphed_sizes = [1, 2, 4, 8]  # as if recorded (no CUDA here)
    decode = [SequenceStep([7], 5, [0])] * (1 if rank == 0 else 3)
    prefill = [SequenceStep([1, 2, 3], 0, [0])]
    answers = [runner.padding_for(decode), runner.padding_for(prefill if rank == 1 else decode),
               runner.padding_for([SequenceStep([7], 5, [0])] * (9 if rank == 0 else 1))]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(answers, f)
    dist.destroy_process_group()


def test_data_parallel_ranks_pad_to_one_bucket(tmp_path):
    out = str(tmp_path / "answers")
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'init'}", out), nprocs=2, start_method="spawn")
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    # 1 and 3 sequences -> both 4; rank 1 in prefill -> both eager; 9 > the largest -> both eager
    assert got[0] == got[1] == [[4, None], [None, None], [None, None]]
