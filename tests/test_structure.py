"""The shape of the package, read from the source (AST, nothing imported):

1. the command line sits at the top of the house: no module outside ``trainmem/cli/`` imports
   ``trainmem.cli``;
2. private stays private: no module imports a ``_private`` name, or anything from a ``_private``
   module, that belongs to another (sub)package of trainmem (``from ._common import X`` inside
   ``plan/`` is fine; ``from ..render.plots import _check_path`` in ``trace/`` is not).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "trainmem"
CLI = PKG / "cli"


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "egg-info" not in str(p))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path) -> str:
    """The package a source file belongs to (a package's ``__init__`` belongs to itself)."""
    return ".".join(path.relative_to(SRC).parent.parts)


def _is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")) / "__init__.py").is_file()


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from <module> import ...`` in ``path``."""
    if not node.level:
        return node.module or ""
    base = _package_of(path).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every import in ``path``; ``name`` is None for ``import module``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            out += [(node.lineno, mod, a.name) for a in node.names]
    return out


def _private(word: str) -> bool:
    return word.startswith("_") and not (word.startswith("__") and word.endswith("__"))


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(SRC.parent)}:{line}"


def _cli_imports() -> list[str]:
    bad = []
    for path in _modules():
        if CLI in path.parents or path.name == "__main__.py":  # `python -m trainmem` is the CLI's entry point
            continue
        for line, mod, name in _imports(path):
            target = f"{mod}.{name}" if name is not None and _is_package(mod) else mod
            if (_in_cli(mod) or _in_cli(target)) and f"{_where(path, line)} imports {target}" not in bad:
                bad.append(f"{_where(path, line)} imports {target}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # import_module("trainmem.cli")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _in_cli(node.value):
                bad.append(f"{_where(path, node.lineno)} names {node.value!r}")
    return bad


def _in_cli(module: str) -> bool:
    return module == "trainmem.cli" or module.startswith("trainmem.cli.")


def _private_owner(mod: str, name: str | None) -> str | None:
    """The package that owns a private thing this import reaches, or None when all is public."""
    parts = mod.split(".")
    for i, p in enumerate(parts):
        if _private(p):
            return ".".join(parts[:i])
    if name is not None and _private(name):
        return mod if _is_package(mod) else ".".join(parts[:-1])
    return None


def _private_imports() -> list[str]:
    bad = []
    for path in _modules():
        own = _package_of(path)
        for line, mod, name in _imports(path):
            if mod != "trainmem" and not mod.startswith("trainmem."):
                continue
            owner = _private_owner(mod, name)
            if owner is not None and owner != own:
                what = mod if name is None else f"{name} from {mod}"
                bad.append(f"{_where(path, line)} imports {what} (private to {owner})")
    return bad


def test_nothing_below_the_cli_imports_it():
    bad = _cli_imports()
    assert not bad, "\n".join(["modules below the CLI import it:"] + bad)


def test_no_private_names_across_packages():
    bad = _private_imports()
    assert not bad, "\n".join(["private names imported across packages:"] + bad)


# ----- the checks themselves ------------------------------------------------------------------------
@pytest.mark.parametrize("source, module, name, owner", [
    ("trainmem/trace/x.py", "trainmem.render.plots", "_check_path", "trainmem.render"),
    ("trainmem/plan/x.py", "trainmem.plan._common", "Evaluator", "trainmem.plan"),
    ("trainmem/plan/x.py", "trainmem.spec.hardware", "_catalogue", "trainmem.spec"),
    ("trainmem/trace/x.py", "trainmem._callable", "make_callable", "trainmem"),
    ("trainmem/trace/x.py", "trainmem.trace", "_trace", "trainmem.trace"),
    ("trainmem/x.py", "trainmem", "__version__", None),
    ("trainmem/x.py", "trainmem.report", "MemoryReport", None),
])
def test_private_owner(source, module, name, owner):
    assert _private_owner(module, name) == owner


def test_relative_imports_resolve():
    path = PKG / "plan" / "fit.py"
    assert _resolve(path, ast.parse("from ._common import X").body[0]) == "trainmem.plan._common"
    assert _resolve(path, ast.parse("from ..render import plots").body[0]) == "trainmem.render"
    init = PKG / "plan" / "__init__.py"
    assert _resolve(init, ast.parse("from .fit import fit").body[0]) == "trainmem.plan.fit"
    assert _resolve(PKG / "cli" / "plan.py", ast.parse("from ..cli import x").body[0]) == "trainmem.cli"


# ----- readable units ------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 80


def test_no_function_longer_than_80_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(["functions over 80 lines:"] + long)


def test_planner_has_no_second_engine():
    # the planner evaluates layouts with estimate.engine.estimate_layouts, not a copy of its formulas
    assert not (PKG / "plan" / "vector.py").exists()
    assert "estimate_layouts" in (PKG / "plan" / "planner.py").read_text()
