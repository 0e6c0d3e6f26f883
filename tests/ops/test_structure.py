"""The layout rules of ``hf_rfa/ops``, read from the source with ``ast`` (nothing is imported):
every module ≤ 400 lines and every function ≤ 80 lines, no import cycle between its modules, and no
module importing another module's private (``_``-prefixed) names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "hf_rfa" / "ops"
PACKAGE = "hf_rfa.ops"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (``__init__.py`` for packages)."""
    out = {}
    for path in sorted(OPS.rglob("*.py")):
        parts = list(path.relative_to(OPS).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(target module, imported names, line)`` of every relative or ``hf_rfa.ops`` import in the
    module (function-level imports included); a name that is itself a module of the package is
    resolved to it (``from . import kernels``)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
        else:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{base}.{node.module}" if node.module else base
        if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
            continue  # e.g. ..feature_maps (outside ops)
        names = [a.name for a in node.names]
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
        out.append((base, [n for n in names if f"{base}.{n}" not in MODULES], node.lineno))
        out.extend((s, [], node.lineno) for s in subs)
    return out


def _graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (importing ``a.b.c`` also runs ``a.b``'s ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for target, _, _ in _imports(name, path):
            parts = target.split(".")
            for i in range(3, len(parts) + 1):  # the target and the packages above it, below hf_rfa.ops
                dep = ".".join(parts[:i])
                if dep in MODULES and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_the_whole_package():
    """(The checks below read every module: the mechanisms' subpackages included.)"""
    assert f"{PACKAGE}.attention" in MODULES and f"{PACKAGE}.backends" in MODULES
    assert len(MODULES) >= 20
    assert any(len(name.split(".")) >= 4 for name in MODULES)  # modules inside subpackages


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name):
    source = MODULES[name].read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines > {MAX_MODULE_LINES}"
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES:
                long.append(f"{node.name} (line {node.lineno}): {size} lines")
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for target, names, line in _imports(name, path):
            if target == name:
                continue
            bad += [f"{name}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
    assert not bad, "private names imported across modules: " + "; ".join(bad)


def test_the_checks_catch_what_they_guard():
    """The cycle finder and the import reader on known cases (a check that cannot fail proves nothing)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    got = _imports(f"{PACKAGE}.attention", MODULES[f"{PACKAGE}.attention"])
    assert any(target == f"{PACKAGE}.masks" for target, _, _ in got)
