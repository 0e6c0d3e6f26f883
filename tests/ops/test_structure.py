"""The layout rules of ``hf_rfa/ops``, read from the source with ``ast`` (nothing is imported):
every module ≤ 400 lines and every function ≤ 80 lines and ≤ 8 parameters, no import cycle
between its modules, and no module importing another module's private (``_``-prefixed) names.

Counting parameters: every parameter of a ``def`` (nested ones and methods included) counts —
positional-only, positional and keyword-only alike, with or without a default — and ``*args`` and
``**kwargs`` count one each; a leading ``self``, ``cls`` or ``ctx`` (a method's object, an autograd
Function's context) does not. Settings travel as one frozen object (``AttentionSpec``,
``CallPlan``, ``Band``, ``MemoryCall``, ``KernelRun``, ...) or one tuple of related tensors, not as
restated keywords. The public entry points whose keywords are the documented API are the only
exceptions, listed with their reasons in :data:`PARAM_EXCEPTIONS`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "hf_rfa" / "ops"
PACKAGE = "hf_rfa.ops"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_PARAMS = 8
#: parameters not counted when a function starts with them (the object of a method, an autograd
#: Function's context)
UNCOUNTED_FIRST = ("self", "cls", "ctx")

#: ``module:qualified name`` → why it may take more than MAX_PARAMS parameters
PARAM_EXCEPTIONS = {
    "hf_rfa.ops.attention:random_feature_attention": "the public PyTorch entry point: its keywords are "
    "the documented API (README, docs); it builds one AttentionSpec from them and calls attend",
    "hf_rfa.ops.reference:quadratic_kernel_attention": "the public twin of random_feature_attention "
    "(hf_rfa.quadratic_kernel_attention): the same keywords, so that a test or a user swaps one for the other",
    "hf_rfa.ops.attention:attend": "the public op on a spec: q, k, v, feature_map and the spec, then "
    "what only a call knows (causal, attention_mask, scale, and the feature inputs feature_q / "
    "feature_k / feature_rope)",
}


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


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters of ``node`` by the module docstring's rule."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - 1 if (a.posonlyargs or a.args) and names[0] in UNCOUNTED_FIRST else n


def _functions(name: str) -> list[tuple[str, int, int]]:
    """``(qualified name, line, parameters)`` of every function of the module (nested and methods
    as ``Outer.inner``)."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.lineno, _params(child)))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(MODULES[name].read_text()), "")
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_function_parameters(name):
    many = [f"{fn} (line {line}): {n} parameters" for fn, line, n in _functions(name) if n > MAX_PARAMS and f"{name}:{fn}" not in PARAM_EXCEPTIONS]
    assert not many, f"{name}: functions over {MAX_PARAMS} parameters (pass the spec / CallPlan / a small frozen dataclass): {many}"


def test_parameter_exceptions_are_still_needed():
    """Every listed exception names a function that exists and still takes more than MAX_PARAMS
    parameters (a stale entry is removed, not kept)."""
    found = {f"{name}:{fn}": n for name in MODULES for fn, _, n in _functions(name)}
    for key, why in PARAM_EXCEPTIONS.items():
        assert why and key in found, f"{key}: no such function"
        assert found[key] > MAX_PARAMS, f"{key}: takes {found[key]} parameters now; drop the exception"


def test_the_parameter_count_follows_its_rule():
    src = """
def f(a, /, b, *args, c, d=1, **kw): pass
class K:
    def m(self, a, b): pass
    @classmethod
    def c(cls, a): pass
    @staticmethod
    def forward(ctx, spec, *inputs): pass
    @staticmethod
    def s(a, b): pass
def outer(x):
    def inner(self_like, y): pass
"""
    got = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef):
            got[node.name] = _params(node)
    assert got == {"f": 6, "m": 2, "c": 1, "forward": 2, "s": 2, "outer": 1, "inner": 2}
