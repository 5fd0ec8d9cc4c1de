"""The package's structure, read from the source alone (no module is imported, so code that only
runs on a GPU is checked too).

Today: every import of the package's own modules resolves. An AST walk of every module under
``cudnn_attn/`` (module level, inside functions, under ``if TYPE_CHECKING:``, in ``try`` blocks;
relative and absolute), of ``tests/``, ``samples/`` and the notebooks' code cells finds each
``cudnn_attn`` import and checks that the module exists and that each imported name is either a
submodule or a top-level name of that module (defined, imported or assigned there). A lazy import
inside a function that only runs on a GPU is the import this catches: nothing else runs it here.

Later (ARCHITECTURE.md §3.1): the layer table, who may import whom, walks the same imports; see
``LAYER RULE`` at the end of this file.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "cudnn_attn"


@dataclass(frozen=True)
class Import:
    """One import of the package: ``module`` (absolute, dotted), the ``names`` taken from it
    (empty for ``import a.b.c``), where it is written."""

    module: str
    names: tuple[str, ...]
    where: str


def module_name(path: Path) -> str | None:
    """The dotted name of a file under the package (``cudnn_attn/ops/__init__.py`` ->
    ``cudnn_attn.ops``); None for a file outside it (tests, samples)."""
    try:
        parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return None
    if not parts or parts[0] != PACKAGE:
        return None
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file that defines module ``name`` under ``root``, or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports(source: str, module: str | None, is_package: bool, label: str) -> list[Import]:
    """Every import of ``cudnn_attn`` in ``source``, anywhere in the tree (functions, classes,
    ``if``, ``try``). ``module`` is the dotted name of the file (None outside the package), used
    to resolve relative imports."""
    found = []
    for node in ast.walk(ast.parse(source, filename=label)):
        where = f"{label}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append(Import(alias.name, (), where))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if module is None:
                    found.append(Import(f"<relative import outside {PACKAGE}>", (), where))
                    continue
                parts = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 > len(parts) - 1:
                    found.append(Import(f"<relative import above {PACKAGE}>", (), where))
                    continue
                parts = parts[: len(parts) - (node.level - 1)]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append(Import(target, tuple(a.name for a in node.names), where))
    return found


def _targets(node: ast.AST) -> list[str]:
    """The names an assignment target binds."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for element in node.elts for n in _targets(element)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


@cache
def top_level_names(module: str, root: Path = ROOT) -> frozenset[str] | None:
    """The names module ``module`` binds at its top level (including inside top-level ``if``,
    ``try``, ``with`` and ``for`` blocks, not inside functions or classes); None for any name
    (a module ``__getattr__``)."""
    path = module_file(module, root)
    assert path is not None, module
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    blocks = [tree.body]
    while blocks:
        for node in blocks.pop():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(n for target in node.targets for n in _targets(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                names.update(_targets(node.target))
            elif isinstance(node, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        return None  # not used in the package; be permissive rather than wrong
                    names.add(alias.asname or alias.name)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                names.update(_targets(node.target))
            if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While)):
                blocks += [node.body, node.orelse]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                names.update(n for item in node.items if item.optional_vars for n in _targets(item.optional_vars))
                blocks.append(node.body)
            elif isinstance(node, ast.Try):
                blocks += [node.body, node.orelse, node.finalbody] + [h.body for h in node.handlers]
    if "__getattr__" in names:
        return None
    return frozenset(names)


def problems(found: list[Import], root: Path = ROOT) -> list[str]:
    """Each import in ``found`` that would fail: a missing module, or a missing name."""
    out = []
    for imp in found:
        parts = imp.module.split(".")
        missing = next(
            (".".join(parts[:i]) for i in range(1, len(parts) + 1) if not module_file(".".join(parts[:i]), root)), None
        )
        if missing is not None:
            out.append(f"{imp.where}: no module {missing} (import of {imp.module})")
            continue
        for name in imp.names:
            if name == "*" or module_file(f"{imp.module}.{name}", root):
                continue
            defined = top_level_names(imp.module, root)
            if defined is not None and name not in defined:
                out.append(f"{imp.where}: {imp.module} has no {name}")
    return out


def notebook_source(path: Path) -> str:
    """A notebook's code cells as one module; IPython magics and shell lines are left out."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"]
        text = "".join(source) if isinstance(source, list) else source
        lines += [line for line in text.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines) + "\n"


def sources() -> list[tuple[str, str, str | None, bool]]:
    """(label, source, module name, is a package) for every file whose imports are checked."""
    out = []
    for path in (
        sorted((ROOT / PACKAGE).rglob("*.py"))
        + sorted((ROOT / "tests").glob("*.py"))
        + sorted((ROOT / "samples").glob("*.py"))
    ):
        out.append(
            (
                str(path.relative_to(ROOT)),
                path.read_text(encoding="utf-8"),
                module_name(path),
                path.name == "__init__.py",
            )
        )
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        out.append((str(path.relative_to(ROOT)), notebook_source(path), None, False))
    return out


def test_every_package_import_resolves():
    checked = []
    for label, source, module, is_package in sources():
        checked += imports(source, module, is_package, label)
    assert len(checked) > 100, "the walk found almost no imports: it is looking in the wrong place"
    assert problems(checked) == []


def test_the_walk_sees_lazy_and_type_checking_imports():
    """The imports that only run on a GPU or for the type checker are in the walk."""
    backend_dispatch = module_file("cudnn_attn.ops")
    assert backend_dispatch is not None
    found = imports(backend_dispatch.read_text(encoding="utf-8"), "cudnn_attn.ops", True, "ops/__init__.py")
    lazy = [i for i in found if "CudnnBackend" in i.names]
    assert lazy, "the lazy import of the cuDNN backend in get_backend() was not seen"


# Each stale import the check must catch, written into a module ``cudnn_attn.graph`` (a file at the
# package root) or ``cudnn_attn.ops`` (a package), and in a test file (no package).
STALE = {
    "missing module, relative": ("from .no_such_module import x\n", "cudnn_attn.graph", False),
    "missing name, relative": ("from .ops import no_such_name\n", "cudnn_attn.graph", False),
    "missing submodule, from package": ("from . import no_such_module\n", "cudnn_attn.graph", False),
    "missing module, two levels": ("from .ops.no_such_module import Backend\n", "cudnn_attn.graph", False),
    "missing name, in __init__": ("from .base import NoSuchProtocol\n", "cudnn_attn.ops", True),
    "above the package": ("from ... import errors\n", "cudnn_attn.ops", True),
    "lazy, in a function": ("def f():\n    from .ops import no_such_name\n", "cudnn_attn.graph", False),
    "type checking": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .no_such_module import T\n",
        "cudnn_attn.graph",
        False,
    ),
    "absolute import": ("import cudnn_attn.no_such_module\n", None, False),
    "absolute import, deep": ("import cudnn_attn.ops.no_such_module\n", None, False),
    "absolute from, in a test": ("from cudnn_attn.ops import no_such_name\n", None, False),
    "absolute from, in a method": (
        "class T:\n    def m(self):\n        from cudnn_attn.errors import NoSuchError\n",
        None,
        False,
    ),
}

RESOLVING = {
    "relative submodule": ("from . import errors\n", "cudnn_attn.graph", False),
    "relative name": ("from .ops import get_backend, BACKEND_NAMES\n", "cudnn_attn.graph", False),
    "relative, in __init__": ("from .base import Backend\n", "cudnn_attn.ops", True),
    "absolute": ("import cudnn_attn.ops.base\n", None, False),
    "imported name re-exported": ("from cudnn_attn.ops import AttentionProblem\n", None, False),
    "not the package": ("import torch\nfrom os import path\n", "cudnn_attn.graph", False),
}


@pytest.mark.parametrize("case", STALE, ids=list(STALE))
def test_a_stale_import_is_caught(case):
    source, module, is_package = STALE[case]
    found = imports(source, module, is_package, "synthetic.py")
    assert found, "the walk did not see the import"
    assert problems(found), f"a stale import passed: {source!r}"


@pytest.mark.parametrize("case", RESOLVING, ids=list(RESOLVING))
def test_a_good_import_passes(case):
    source, module, is_package = RESOLVING[case]
    assert problems(imports(source, module, is_package, "synthetic.py")) == []


def test_a_stale_import_in_a_package_file_fails_the_walk(tmp_path):
    """On a copy of the package with one module's lazy import made stale, the whole walk fails."""
    copy = tmp_path / PACKAGE
    for path in (ROOT / PACKAGE).rglob("*.py"):
        target = copy / path.relative_to(ROOT / PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    dispatch = copy / "ops" / "__init__.py"
    text = dispatch.read_text(encoding="utf-8")
    assert "            _backends[name] = CudnnBackend()" in text
    dispatch.write_text(
        text.replace(
            "            _backends[name] = CudnnBackend()",
            "            from .no_longer_here import CudnnBackend as _Moved  # noqa: F401\n"
            "            _backends[name] = CudnnBackend()",
        ),
        encoding="utf-8",
    )
    found = []
    for path in sorted(copy.rglob("*.py")):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        found += imports(path.read_text(encoding="utf-8"), name, is_package, str(path.relative_to(tmp_path)))
    stale = problems(found, root=tmp_path)
    assert len(stale) == 1 and "no module cudnn_attn.ops.no_longer_here" in stale[0], stale


# LAYER RULE (ARCHITECTURE.md §3.1), to come with the layout: a table of the layers as a dict
# (path prefix -> layer), and a test that every import found by ``imports()`` above points down
# the table (TYPE_CHECKING imports included); then no module reading another's ``_name``, file
# length <= 450, and no public top-level name shadowing a submodule (``graph`` excepted).
