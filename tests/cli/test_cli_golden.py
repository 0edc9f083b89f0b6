"""The human output of every subcommand against reviewed golden files in tests/cli/golden/.

`pytest tests/cli --update-golden` (or ATOM_UPDATE_GOLDEN=1) rewrites them; review the diff.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_helpers import artifacts, cache_dir, copy_root, our_lines, run
from golden_text import assert_aligned, check, normalise

REPO = Path(__file__).parents[2]


def _transcript(args: list[str], proc: subprocess.CompletedProcess) -> str:
    shown = ["atom-compile-cache" if a == "ROOT" else a for a in args]
    text = f"$ {' '.join(shown)}\n{proc.stdout}"
    mine = our_lines(proc.stderr)
    if mine:
        text += "[stderr]\n" + "\n".join(mine) + "\n"
    return text + f"[exit {proc.returncode}]\n"


@pytest.fixture(scope="module")
def replacements(warmed, imported, env) -> list[tuple[str, str]]:
    factors = json.loads(run(env, "inspect", warmed["hash"], "--json", "--cache-root",
                             str(warmed["root"])).stdout)["factors"]["environment"]
    out = [(str(warmed["root"]), "<root>"), (str(imported["root"]), "<fresh-root>"),
           (str(imported["archive"]), "<archive>"), (str(REPO), "<repo>")]
    for key in ("torch", "triton", "device", "cpu_capability", "python", "atom_compile"):
        value = factors.get(key)
        if isinstance(value, str) and len(value) >= 3:
            out.append((value, f"<{key}>"))
    return out


def _golden(name: str, args: list[str], proc: subprocess.CompletedProcess, reps, update: bool) -> None:
    assert_aligned(proc.stdout)
    check(name, normalise(_transcript(args, proc), reps), update)


def _cli(env, name, args, reps, update, code=0):
    proc = run(env, *args)
    assert proc.returncode == code, proc.stdout + proc.stderr
    _golden(name, ["atom-compile-cache", *args], proc, reps, update)


def test_golden_inspect_verify_clear_explain(warmed, env, replacements, update_golden):
    root = ["--cache-root", str(warmed["root"])]
    _cli(env, "inspect_all", ["inspect", *root], replacements, update_golden)
    _cli(env, "inspect_one", ["inspect", warmed["hash"], *root], replacements, update_golden)
    _cli(env, "verify_ok", ["verify", *root], replacements, update_golden)
    _cli(env, "clear_dry_run", ["clear", "--all", "--dry-run", *root], replacements, update_golden)
    _cli(env, "explain_miss", ["explain", "--layers", "2", "--compile-sizes", "8", *root], replacements,
         update_golden, code=1)


def test_golden_verify_damaged(warmed, env, tmp_path, replacements, update_golden):
    root = copy_root(warmed, tmp_path)
    victim = artifacts(root, warmed["hash"])[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    (index,) = cache_dir(root, warmed["hash"]).glob("rank_*/*/index.json")
    damaged = [(str(root), "<root>"), *replacements]
    _cli(env, "verify_damaged", ["verify", "--cache-root", str(root)], damaged, update_golden, code=1)
    index.write_text("{ truncated")
    _cli(env, "verify_bad_index", ["verify", "--cache-root", str(root)], damaged, update_golden, code=1)


def test_golden_export_import_warm(warmed, imported, replacements, update_golden):
    from atom_compile.cli.warm import format_summary

    args = ["atom-compile-cache", "export", warmed["hash"], "-o", str(imported["archive"]),
            "--cache-root", str(warmed["root"])]
    _golden("export", args, imported["export"], replacements, update_golden)
    args = ["atom-compile-cache", "import", str(imported["archive"]), "--cache-root", str(imported["root"])]
    _golden("import", args, imported["import"], replacements, update_golden)
    args = ["atom-compile-cache", "warm", "--layers", "2", "--compile-sizes", "4", "--cache-root", str(imported["root"])]
    _golden("warm_after_import", args, imported["warm"], replacements, update_golden)
    cold = subprocess.CompletedProcess([], 0, "\n".join(format_summary(warmed)) + "\n", warmed["stderr"])
    args = ["atom-compile-cache", "warm", "--layers", "2", "--compile-sizes", "4", "--cache-root", str(warmed["root"])]
    _golden("warm_cold", args, cold, replacements, update_golden)
