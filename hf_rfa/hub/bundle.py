"""The remote code of an export: flat copies of a declared list of hf_rfa modules.

:data:`BUNDLED_MODULES` names every module an exported model needs (``hf_rfa.hf.convert``, ``hf_rfa.hf.cache`` and what
they import); ``tests/hub/test_export.py`` checks that it equals that import closure, and bundling
refuses a module that imports an hf_rfa module outside the list.

Each module is copied verbatim to one flat file, ``hf_rfa/feature_maps/base.py`` →
``hf_rfa_feature_maps_base.py``; only its intra-package import statements are rewritten to
``from .hf_rfa_<...> import Name`` — the one form transformers follows when it copies remote code —
keeping every other line (and the line numbers) unchanged. ``from . import submodule`` becomes
``from .hf_rfa_<sub> import __name__ as _x; from . import hf_rfa_<sub> as submodule`` (the first
half makes transformers copy the file). Rules for bundled modules (checked, ValueError otherwise):
intra-package imports are relative (``from .x import``, never ``import hf_rfa...``) and alone on
their line(s).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

PACKAGE = "hf_rfa"
#: prefix of the generated module files
FILE_PREFIX = "hf_rfa_"
#: the modules an exported model's remote class imports (``convert``, the generation ``cache``); their
#: import closure is bundled
ROOT_MODULES = ("hf_rfa.hf.convert", "hf_rfa.hf.cache")
#: every module of the remote code (= the import closure of :data:`ROOT_MODULES`; tested)
BUNDLED_MODULES = (
    "hf_rfa.compat",
    "hf_rfa.config",
    "hf_rfa.feature_maps",
    "hf_rfa.feature_maps.base",
    "hf_rfa.feature_maps.fourier",
    "hf_rfa.feature_maps.learned",
    "hf_rfa.feature_maps.none",
    "hf_rfa.feature_maps.positive",
    "hf_rfa.feature_maps.random_projections",
    "hf_rfa.feature_maps.registry",
    "hf_rfa.hf.attention",
    "hf_rfa.hf.cache",
    "hf_rfa.hf.checkpoint",
    "hf_rfa.hf.rope",
    "hf_rfa.hf.rotations",
    "hf_rfa.hf.runtime",
    "hf_rfa.hf.convert",
    "hf_rfa.ops",
    "hf_rfa.ops.attention",
    "hf_rfa.ops.autograd",
    "hf_rfa.ops.backends",
    "hf_rfa.ops.backends.causal_infer",
    "hf_rfa.ops.backends.fla",
    "hf_rfa.ops.backends.flex",
    "hf_rfa.ops.backends.gpu",
    "hf_rfa.ops.backends.kernels",
    "hf_rfa.ops.backends.native",
    "hf_rfa.ops.backends.native.build",
    "hf_rfa.ops.band.exact",
    "hf_rfa.ops.band.plan",
    "hf_rfa.ops.band.recompute",
    "hf_rfa.ops.decode",
    "hf_rfa.ops.decode.continuation",
    "hf_rfa.ops.decode.state",
    "hf_rfa.ops.feature.bidirectional",
    "hf_rfa.ops.feature.chunkwise",
    "hf_rfa.ops.feature.fused",
    "hf_rfa.ops.feature.linear",
    "hf_rfa.ops.feature.recompute",
    "hf_rfa.ops.feature.scan",
    "hf_rfa.ops.hybrid.blocks",
    "hf_rfa.ops.hybrid.function",
    "hf_rfa.ops.masks",
    "hf_rfa.ops.memory",
    "hf_rfa.ops.memory.attention",
    "hf_rfa.ops.memory.periods",
    "hf_rfa.ops.memory.scores",
    "hf_rfa.ops.memory.sequential",
    "hf_rfa.ops.memory.state",
    "hf_rfa.ops.memory.terms",
    "hf_rfa.ops.partial",
    "hf_rfa.ops.recurrent",
    "hf_rfa.ops.reference",
    "hf_rfa.ops.rotary",
    "hf_rfa.ops.spec",
    "hf_rfa.presets",  # RFAConfig.from_preset
)


def _package_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _module_path(name: str) -> Path | None:
    """File of module ``name`` inside the package (``__init__.py`` for subpackages), or None."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    rel = name.split(".")[1:]
    base = _package_root().joinpath(*rel) if rel else _package_root()
    if base.is_dir() and (base / "__init__.py").is_file():
        return base / "__init__.py"
    file = base.with_suffix(".py")
    return file if file.is_file() else None


def _is_package(name: str) -> bool:
    path = _module_path(name)
    return path is not None and path.name == "__init__.py"


def flat_name(module: str) -> str:
    """``hf_rfa.feature_maps.base`` → ``hf_rfa_feature_maps_base`` (module name of the flat file)."""
    if module == PACKAGE:
        raise ValueError("the top-level hf_rfa package is not bundled (import its submodules)")
    return FILE_PREFIX + "_".join(module.split(".")[1:])


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """Absolute name of the module an ImportFrom refers to, if it is inside the package."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    package = module if _is_package(module) else module.rsplit(".", 1)[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


@dataclass
class _Rewrite:
    first: int  # 1-based line numbers, inclusive
    last: int
    text: str
    deps: list[str]


def _aliases(node: ast.ImportFrom) -> str:
    return ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)


def _rewrites(module: str, source: str) -> list[_Rewrite]:
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
            raise ValueError(f"{module} line {node.lineno}: 'import {PACKAGE}...' cannot be bundled; use 'from . import ...'")
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve(module, node)
        if target is None:
            continue
        head, tail = lines[node.lineno - 1][: node.col_offset], lines[node.end_lineno - 1][node.end_col_offset :]
        if head.strip() or (tail.strip() and not tail.strip().startswith("#")):
            raise ValueError(f"{module} line {node.lineno}: an intra-package import must be alone on its line(s) to be bundled")
        stmts, deps = [], []
        if node.module is None or _is_package(target):  # from . import a, b / from .pkg import submodule, name
            direct = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if _module_path(sub) is not None:
                    flat = flat_name(sub)
                    stmts.append(f"from .{flat} import __name__ as _{flat}_copied")  # followed by transformers
                    stmts.append(f"from . import {flat} as {a.asname or a.name}")
                    deps.append(sub)
                else:
                    direct.append(a)
            if direct:
                if target == PACKAGE:
                    raise ValueError(f"{module} line {node.lineno}: names from the top-level hf_rfa package cannot be bundled")
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in direct)
                stmts.append(f"from .{flat_name(target)} import {names}")
                deps.append(target)
        else:
            if _module_path(target) is None:
                raise ValueError(f"{module} line {node.lineno}: cannot find module {target}")
            stmts.append(f"from .{flat_name(target)} import {_aliases(node)}")
            deps.append(target)
        # one statement per line: transformers only follows ``from .x import`` at a line start
        text = "\n".join(head + s for s in stmts) + tail
        n_extra = max(0, (node.end_lineno - node.lineno) - (len(stmts) - 1))  # keep line numbers where possible
        out.append(_Rewrite(node.lineno, node.end_lineno, text + "\n" * n_extra, deps))
    return out


def _flat_copy(module: str) -> tuple[Path, str, list[str]]:
    """``(source file, generated text, hf_rfa modules it imports)`` of one module."""
    from .. import __version__

    path = _module_path(module)
    if path is None:
        raise ValueError(f"cannot find the source of {module}")
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    deps: list[str] = []
    for rw in sorted(_rewrites(module, source), key=lambda r: -r.first):
        nl = "\n" if lines[rw.last - 1].endswith("\n") else ""
        lines[rw.first - 1 : rw.last] = [rw.text + nl]
        deps.extend(rw.deps)
    rel = path.relative_to(_package_root().parent).as_posix()
    header = f"# Generated by hf_rfa {__version__} from {rel} (only intra-package imports rewritten). Do not edit.\n"
    return path, header + "".join(lines), deps


def import_closure(roots: Sequence[str] = ROOT_MODULES) -> list[str]:
    """Sorted names of ``roots`` and every hf_rfa module they import, transitively (AST)."""
    todo, seen = list(roots), set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_flat_copy(module)[2])
    return sorted(seen)


def _generate(modules: Sequence[str]) -> dict[str, tuple[Path, str]]:
    files: dict[str, tuple[Path, str]] = {}
    declared = set(modules)
    for module in modules:
        path, text, deps = _flat_copy(module)
        outside = sorted(set(deps) - declared)
        if outside:
            raise ValueError(f"{module} imports {outside}, which are not bundled: add them to hf_rfa.hub.bundle.BUNDLED_MODULES")
        files[flat_name(module) + ".py"] = (path, text)
    return dict(sorted(files.items()))


def bundle_sources(modules: Sequence[str] = BUNDLED_MODULES) -> dict[str, str]:
    """``{file name: source}`` of the flat copies of ``modules``.

    Every line but the intra-package imports is hf_rfa's own, in the same order (after a one-line
    header), so tracebacks and diffs point at the library source.
    """
    return {name: text for name, (_path, text) in _generate(modules).items()}


def bundled_modules(modules: Sequence[str] = BUNDLED_MODULES) -> dict[str, Path]:
    """``{file name: hf_rfa source file}`` of the modules :func:`bundle_sources` generates."""
    return {name: path for name, (path, _text) in _generate(modules).items()}


__all__ = ["BUNDLED_MODULES", "FILE_PREFIX", "PACKAGE", "ROOT_MODULES", "bundle_sources", "bundled_modules", "flat_name", "import_closure"]
