"""Per-call dispatch cost of @support_torch_compile against plain torch.compile (CPU).

The same 50-layer model (100 parameters, a scale and a shift per layer) at level 3, split at
a test op every 10 layers, compiled by Inductor through the same backend both ways. Dispatch cost = median time per call minus the median time of calling the
backend's compiled callable directly with the same inputs, so what remains is what sits
between the user's call and the compiled code: Dynamo's guard evaluation for torch.compile,
the guard-free jump for the decorated model.

    python benchmarks/dispatch_overhead.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import atom_compile as ac
from atom_compile.backends import atom_backend

LAYERS = 50


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q + k + v)


_lib = torch.library.Library("bench", "FRAGMENT")
ac.direct_register_custom_op("attention", _attention, mutates_args=["out"], target_lib=_lib)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(4) + 0.5) for _ in range(LAYERS))
        self.shifts = nn.ParameterList(nn.Parameter(torch.rand(4) - 0.5) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            x = torch.tanh(x * self.scales[i] + self.shifts[i])
            if i % 10 == 9:
                out = torch.empty_like(x)
                torch.ops.bench.attention(x, x, x, out)
                x = out
        return x


Decorated = ac.support_torch_compile(type("Decorated", (Net,), {}))


class Recorder:
    """Wraps the backend's compiled callable to keep the inputs of the last call."""

    def __init__(self, fn):
        self.fn = fn
        self.last: tuple = ()

    def __call__(self, *args):
        self.last = args
        return self.fn(*args)


def _recording_backends() -> list[Recorder]:
    recorders: list[Recorder] = []
    original = atom_backend.AtomBackend.__call__

    def call(self, gm, example_inputs):
        rec = Recorder(original(self, gm, example_inputs))
        recorders.append(rec)
        return rec

    atom_backend.AtomBackend.__call__ = call
    return recorders


def per_call(arms: dict, x: torch.Tensor, calls: int) -> dict[str, float]:
    """Median microseconds per call of each arm, the arms interleaved in rounds of 100 calls
    so that drift in the machine's speed hits them all alike."""
    for fn in arms.values():
        for _ in range(200):
            fn(x)
    samples: dict[str, list[float]] = {name: [] for name in arms}
    batch = 100
    for _ in range(calls // batch):
        for name, fn in arms.items():
            t = time.perf_counter_ns()
            for _ in range(batch):
                fn(x)
            samples[name].append((time.perf_counter_ns() - t) / batch / 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    torch.manual_seed(0)
    recorders = _recording_backends()
    cfg = ac.Config(compilation_config=ac.CompilationConfig(level=3, splitting_ops=["bench.attention"]))
    x = torch.randn(8, 4)
    with torch.inference_mode():
        decorated = Decorated(compilation_config=cfg).requires_grad_(False)
        decorated(x)
        rec_decorated = recorders[-1]
        plain_model = Net().requires_grad_(False)
        torch._dynamo.mark_dynamic(x, 0)
        plain = torch.compile(plain_model, backend=ac.backend(cfg), fullgraph=True)
        plain(x)
        rec_plain = recorders[-1]
        params = sum(1 for _ in decorated.parameters())

        t = per_call({
            "decorated": decorated,
            "decorated_direct": lambda _: rec_decorated(*rec_decorated.last),
            "plain": plain,
            "plain_direct": lambda _: rec_plain(*rec_plain.last),
        }, x, args.calls)
    t_dec, t_dec_direct, t_plain, t_plain_direct = t["decorated"], t["decorated_direct"], t["plain"], t["plain_direct"]
    d_dec, d_plain = t_dec - t_dec_direct, t_plain - t_plain_direct
    print(f"device cpu, torch {torch.__version__}, {params} parameters, {len(rec_plain.last)} graph inputs, "
          f"median of {args.calls} calls")
    print("| arm | per call (us) | compiled callable alone (us) | dispatch (us) |")
    print("|---|---|---|---|")
    print(f"| @support_torch_compile | {t_dec:.2f} | {t_dec_direct:.2f} | {d_dec:.2f} |")
    print(f"| torch.compile(backend=atom) | {t_plain:.2f} | {t_plain_direct:.2f} | {d_plain:.2f} |")
    print(f"dispatch ratio decorated / torch.compile = {d_dec / d_plain:.2f} (goal <= 0.5)")


if __name__ == "__main__":
    main()
