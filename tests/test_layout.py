"""The package's layout, checked from its source with `ast` (DESIGN.md, 'Package layout').

The rooms stand on floors and every import (at module level or inside a function, relative or
absolute) may only point down or stay on its floor: cli/ (4) -> runtime/, models/,
decorators.py (3) -> backends/, ops/ (2) -> cache/ (1) -> everything else (0). Imports under
`if TYPE_CHECKING:` never run and are exempt. Modules stay under MAX_MODULE_LINES lines;
functions over MAX_FUNCTION_LINES lines are reported, and fail in the modules listed in
FUNCTION_CHECKED.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "atom_compile"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
FLOORS = {"cli": 4, "runtime": 3, "models": 3, "decorators": 3, "backends": 2, "ops": 2, "cache": 1}
FUNCTION_CHECKED = {
    "backends/aot.py", "backends/atom_backend.py", "backends/base.py", "backends/compiled_function.py",
    "backends/manager.py", "backends/static_inputs.py", "cache/keys.py", "cache/store.py", "config.py",
    "counters.py", "custom_ops.py", "decorators.py", "envs.py", "errors.py", "forward_context.py",
    "modes.py", "runtime/buckets.py", "runtime/model_runner.py", "runtime/runtime_config.py",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor(module: str) -> int:
    """The floor of `atom_compile.<room>...`: its first component names the room."""
    parts = module.split(".")
    return FLOORS.get(parts[1], 0) if len(parts) > 1 else 0


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST):
    """Every node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports(module: str, path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module) for each import of a module of this package."""
    is_package = path.name == "__init__.py"
    text = path.read_text() if source is None else source
    out = []
    for node in _nodes(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "atom_compile"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "atom_compile":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if sub in MODULES else target))
    return sorted(out)


def test_the_checker_sees_every_kind_of_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .. import envs\n"
        "from ..backends.base import X\n"
        "import atom_compile.runtime.graphs\n"
        "def f():\n"
        "    from ..models import llama\n"
        "if TYPE_CHECKING:\n"
        "    from ..cli import main\n"
    )
    found = imports("atom_compile.cache.store", PACKAGE / "cache" / "store.py", source)
    assert found == [(2, "atom_compile.envs"), (3, "atom_compile.backends.base"),
                     (4, "atom_compile.runtime.graphs"), (6, "atom_compile.models.llama")]
    assert [floor(t) for _, t in found] == [0, 2, 3, 3]
    # relative imports from a package's __init__ resolve from the package itself
    assert imports("atom_compile.runtime", PACKAGE / "runtime" / "__init__.py", "from .graphs import g\n") == \
        [(1, "atom_compile.runtime.graphs")]


def test_every_arrow_points_down():
    wrong = []
    for module, path in MODULES.items():
        for line, target in imports(module, path):
            if floor(target) > floor(module):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (floor {floor(module)}) "
                             f"imports {target} (floor {floor(target)})")
    assert not wrong, "imports that point up a floor:\n" + "\n".join(wrong)


def test_the_cache_imports_only_floor_0():
    for module, path in MODULES.items():
        if floor(module) == 1:
            for line, target in imports(module, path):
                assert floor(target) <= 1, f"{module}:{line} imports {target}"


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def long_functions() -> dict[str, int]:
    out = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    return out


def test_no_function_is_too_long(capsys):
    found = long_functions()
    if found:
        with capsys.disabled():
            print(f"\nfunctions over {MAX_FUNCTION_LINES} lines: {found}")
    checked = {k: n for k, n in found.items() if k.split(":")[0] in FUNCTION_CHECKED}
    assert not checked, f"functions over {MAX_FUNCTION_LINES} lines: {checked}"
