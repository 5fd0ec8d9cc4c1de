"""The package's structure, read from the source alone (no module is imported, so code that only
runs on a GPU is checked too).

Today: every import of the package's own modules resolves. An AST walk of every module under
``cudnn_attn/`` (module level, inside functions, under ``if TYPE_CHECKING:``, in ``try`` blocks;
relative and absolute), of ``tests/``, ``samples/`` and the notebooks' code cells finds each
``cudnn_attn`` import and checks that the module exists and that each imported name is either a
submodule or a top-level name of that module (defined, imported or assigned there). A lazy import
inside a function that only runs on a GPU is the import this catches: nothing else runs it here.

Then the layout rules of ARCHITECTURE.md §3.1, on the same walk, so the layout cannot drift back:
every module has a place in the layer table (``LAYERS``) and imports only its own layer or those
below it (``TYPE_CHECKING`` and function-level imports included); no module reads another
module's ``_name``; no module is over ``MAX_LINES`` lines of code (docstrings, the API reference's
source, are not counted); no package ``__init__.py`` binds a name
that shadows one of its submodules. Each rule is a pure function over sources, tried on a
synthetic breach below so that it is known to be able to fail.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import tokenize
from collections.abc import Iterator
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


def _scope(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run in a module's or class's own scope: ``body`` and what is nested in
    its ``if``, ``for``, ``while``, ``with`` and ``try`` blocks, not in functions or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While)):
            yield from _scope(node.body + node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _scope(node.body)
        elif isinstance(node, ast.Try):
            yield from _scope(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _binds(node: ast.stmt) -> list[str]:
    """The names one statement binds in its scope (``*`` for a star import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n for target in node.targets for n in _targets(target)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        return _targets(node.target)
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [n for item in node.items if item.optional_vars for n in _targets(item.optional_vars)]
    if isinstance(node, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    return []


@cache
def top_level_names(module: str, root: Path = ROOT) -> frozenset[str] | None:
    """The names module ``module`` binds at its top level (see ``_scope``), with those its module
    ``__getattr__`` resolves by name (the keys of a ``_LAZY`` table, strings it compares ``name``
    with); None for any name (a ``__getattr__`` that resolves names it does not list, or a star
    import: permissive, not wrong)."""
    path = module_file(module, root)
    assert path is not None, module
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = {n for node in _scope(tree.body) for n in _binds(node)}
    hooks = [n for n in _scope(tree.body) if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    resolves = any(isinstance(r, ast.Return) and r.value is not None for h in hooks for r in ast.walk(h))
    listed = _lazy_names(tree) | {
        c.value
        for h in hooks
        for cmp in ast.walk(h)
        if isinstance(cmp, ast.Compare)
        for c in (cmp.left, *cmp.comparators)
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }
    if "*" in names or (resolves and not listed) or ("__getattr__" in names and not hooks):
        return None
    return frozenset(names | listed)


def _lazy_names(tree: ast.Module) -> set[str]:
    """The string keys of a top-level ``_LAZY = {...}`` table (``**dict.fromkeys((...), ...)`` included)."""
    keys: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Dict):
                    keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                elif isinstance(sub, ast.Call) and getattr(sub.func, "attr", None) == "fromkeys" and sub.args:
                    seq = sub.args[0]
                    if isinstance(seq, ast.Tuple | ast.List):
                        keys |= {e.value for e in seq.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return keys


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
    files = [*sorted((ROOT / PACKAGE).rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    out = [
        (str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
        for path in files + sorted((ROOT / "samples").glob("*.py"))
    ]
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
    backend_dispatch = module_file("cudnn_attn.ops.dispatch")
    assert backend_dispatch is not None
    found = imports(backend_dispatch.read_text(encoding="utf-8"), "cudnn_attn.ops.dispatch", False, "ops/dispatch.py")
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
    "imported name re-exported": ("from cudnn_attn.ops import ReferenceBackend\n", None, False),
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
    shutil.copytree(ROOT / PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dispatch = copy / "ops" / "dispatch.py"
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


# The layer rule (ARCHITECTURE.md §3.1). A module may import its own layer and those below it. The
# doors are ordered (each may use the doors before it, as fp8 uses functional), so they hold
# sub-ranks 6.0, 6.1, ...; the root re-exports layers 1-6 and only a tool may import it, as a user
# would, so it sits after the last door and below the tools; bench (7.0) is below cli (7.1), which
# runs the bench command. The most specific prefix wins.
DOORS = (
    "varlen.py",
    "functional/",
    "fp8_scaling.py",
    "fp8_tensor.py",
    "fp8.py",
    "nn.py",
    "buckets.py",
    "serving/",
    "distributed/",
)
DOORS += ("integrations/",)
ROOT_LAYER = round(6 + len(DOORS) / 10, 1)
LAYERS: dict[str, float] = {
    f"{PACKAGE}/{prefix}": layer
    for prefix, layer in {
        **dict.fromkeys(("errors.py", "log.py", "core/"), 1),
        "kernels/": 2,
        **dict.fromkeys(("ops/", "plan_store.py"), 3),
        **dict.fromkeys(("runtime/", "cache.py"), 4),
        # Graph's machinery, the frontend's dialect on it, then Graph, which imports both.
        "recording/": 5,
        "frontend/": 5.1,
        "graph.py": 5.2,
        **{door: round(6 + i / 10, 1) for i, door in enumerate(DOORS)},
        "__init__.py": ROOT_LAYER,
        "bench/": 7.0,
        "cli/": 7.1,
        "__main__.py": 7.1,  # python -m cudnn_attn: the command line, as a tool
    }.items()
}
LAYER_NAMES = {1: "core", 2: "kernels", 3: "backends", 4: "runtime", 5: "graph", 6: "doors", 7: "tools"}
# Imports the numbers allow but the design does not: a backend gets no help from a Triton kernel,
# and the recording machinery and the frontend's dialect take what they need from Graph as
# arguments (typed by Protocols), never by importing it.
FORBIDDEN = (
    (f"{PACKAGE}/ops/", f"{PACKAGE}/kernels/"),
    (f"{PACKAGE}/recording/", f"{PACKAGE}/graph.py"),
    (f"{PACKAGE}/frontend/", f"{PACKAGE}/graph.py"),
)
MAX_LINES = 450


def layer_of(path: str) -> float | None:
    """The layer of a file (``cudnn_attn/ops/base.py``): its longest matching prefix in ``LAYERS``
    (a folder ``x/`` or an exact file); None when it matches none."""
    matches = [p for p in LAYERS if path == p or (p.endswith("/") and path.startswith(p))]
    return LAYERS[max(matches, key=len)] if matches else None


def layer_label(layer: float) -> str:
    return "root" if layer == ROOT_LAYER else f"{layer} {LAYER_NAMES[int(layer)]}"


def imported_modules(imp: Import) -> list[str]:
    """The modules an import runs: each name that is a submodule is that submodule (``from .. import
    errors``), any other name is the module it is taken from (``from .. import Graph``: the root)."""
    names = [f"{imp.module}.{n}" if module_file(f"{imp.module}.{n}") else imp.module for n in imp.names]
    return list(dict.fromkeys(names or [imp.module]))


def layer_problems(label: str, source: str) -> list[str]:
    """Each import in file ``label`` (relative to the repository) that goes up the layer table or is
    forbidden: ``file:line: <its layer> imports <module> (<that module's layer>)``."""
    importer = layer_of(label)
    module = module_name(ROOT / label)
    out = []
    for imp in imports(source, module, label.endswith("/__init__.py"), label):
        for target in imported_modules(imp):
            path = module_file(target)
            layer = layer_of(path.relative_to(ROOT).as_posix()) if path else None
            if importer is None or layer is None:
                continue  # a missing module is the resolution test's; an unplaced one the placement test's
            target_path = path.relative_to(ROOT).as_posix()
            if layer > importer or any(label.startswith(a) and target_path.startswith(b) for a, b in FORBIDDEN):
                out.append(f"{imp.where}: {layer_label(importer)} imports {target} ({layer_label(layer)})")
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def private_definitions(source: str) -> set[str]:
    """The ``_names`` a module defines: its module-level and class-level names (not those it
    imports), any ``def``, and the attributes it sets on ``self`` or ``cls``."""
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef)):
            body = [s for s in _scope(node.body) if not isinstance(s, (ast.Import, ast.ImportFrom))]
            names.update(n for s in body for n in _binds(s))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


# The one module whose job is calling the cuDNN frontend's private API; what it reads is the frontend's.
PRIVATE_API_ADAPTERS = {f"{PACKAGE}/ops/cudnn/frontend_internals.py"}


def private_read_problems(files: dict[str, str]) -> list[str]:
    """Each ``x._name`` (``x`` not ``self``/``cls``) in one of ``files`` (label -> source) where
    ``_name`` is defined by another of them and not by the reader: a reach into another module's
    state. Third-party privates (``tensor._version``) pass unless a package module reuses the name."""
    defined = {label: private_definitions(source) for label, source in files.items()}
    out = []
    for label, source in files.items():
        if label in PRIVATE_API_ADAPTERS:
            continue
        reads = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and _is_private(n.attr)]
        for node in sorted((n for n in reads if not _on_self(n)), key=lambda n: (n.lineno, n.col_offset)):
            owner = ast.unparse(node.value)
            owners = [o for o, names in defined.items() if o != label and node.attr in names]
            if owners and node.attr not in defined[label]:
                owners.sort(key=lambda o: (Path(o).stem not in owner, o))  # ``graph._x``: graph.py first
                shown = ", ".join(owners[:3]) + (", ..." if len(owners) > 3 else "")
                out.append(f"{label}:{node.lineno}: reads {owner}.{node.attr} (defined in {shown})")
    return out


# ``graph`` is left open: a public ``cudnn_attn.graph()`` function may come (ARCHITECTURE.md §3.4),
# and it would shadow the module graph.py on purpose.
ALLOWED_SHADOWS = {(PACKAGE, "graph")}


def shadowing_problems(label: str, package: str, source: str, submodules: set[str]) -> list[str]:
    """Each top-level name the ``__init__.py`` of ``package`` binds that is also one of its
    ``submodules``, unless it binds that submodule itself (``from . import nn``): otherwise
    ``import package.name as m`` gives the shadowing object, not the module."""
    out = []
    for node in _scope(ast.parse(source).body):
        of_package = isinstance(node, ast.ImportFrom) and (
            (node.level == 1 and not node.module) or (node.level == 0 and node.module == package)
        )
        aliases = {a.asname or a.name: a.name for a in node.names} if isinstance(node, ast.ImportFrom) else {}
        for name in _binds(node):
            if name in submodules and (package, name) not in ALLOWED_SHADOWS:
                if not (of_package and aliases.get(name) == name):
                    out.append(f"{label}:{node.lineno}: {package}.{name} is bound to something other than the module")
    return out


@cache
def package_sources() -> dict[str, str]:
    """Every module of the package: repository-relative path -> source."""
    return {
        p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in sorted((ROOT / PACKAGE).rglob("*.py"))
    }


def test_every_module_has_a_layer():
    assert [path for path in package_sources() if layer_of(path) is None] == []


def test_imports_follow_the_layers():
    found = [p for label, source in package_sources().items() for p in layer_problems(label, source)]
    assert not found, "imports against the layer table:\n" + "\n".join(found)


def test_no_module_reads_another_modules_private_names():
    found = private_read_problems(package_sources())
    assert not found, "reads of another module's _name:\n" + "\n".join(found)


def code_lines(source: str) -> int:
    """The lines of ``source`` that are not docstrings (module, class and function docstrings are
    the API reference's source: a documented module is not a longer one)."""
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstring_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(source.splitlines()) - len(docstring_lines)


def test_no_module_is_too_long():
    lines = {path: code_lines(source) for path, source in package_sources().items()}
    found = [f"{path}: {n} lines of code" for path, n in lines.items() if n > MAX_LINES]
    assert not found, f"modules over {MAX_LINES} lines of code:\n" + "\n".join(found)


def test_code_lines_leave_out_docstrings_only():
    source = "\n".join(
        [
            '"""Module.',  # a module docstring: 3 lines
            "",
            'More."""',
            "",
            "def f(x):",
            '    """One.',  # a function's: 4
            "",
            "    Two.",
            '    """',
            "    return x",
            "",
            "class C:",
            '    """Doc."""',  # a class's: 1
            '    y = "not a docstring"',  # a string value counts
        ]
    )
    assert len(source.splitlines()) == 14
    assert code_lines(source) == 14 - 3 - 4 - 1
    assert code_lines("x = 1\n" * (MAX_LINES + 1)) > MAX_LINES


def test_no_package_name_shadows_a_submodule():
    found = []
    for label, source in package_sources().items():
        if label.endswith("/__init__.py"):
            folder = (ROOT / label).parent
            subs = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
            found += shadowing_problems(label, module_name(ROOT / label), source, subs - {"__init__", "__pycache__"})
    assert not found, "names that shadow a submodule:\n" + "\n".join(found)


# Synthetic sources written in a real file's place, and how many imports the layer rule must refuse.
LAYER_CASES = {
    "core imports graph": ("cudnn_attn/core/problem.py", "from ..graph import Graph\n", 1),
    "a backend imports a kernel": ("cudnn_attn/ops/reference/backend.py", "from ...kernels.lse_merge import x\n", 1),
    "recording, for types": ("cudnn_attn/recording/node.py", "if TYPE_CHECKING:\n    from ..graph import G\n", 1),
    "runtime, lazily": ("cudnn_attn/runtime/runner.py", "def f():\n    from ..recording import node\n", 1),
    "a door imports a later door": ("cudnn_attn/varlen.py", "from .functional import sdpa\n", 1),
    "a door imports the root": ("cudnn_attn/nn.py", "from . import Graph\n", 1),
    "the root, absolute": ("cudnn_attn/serving/schedule.py", "import cudnn_attn\n", 1),
    "a door imports a tool": ("cudnn_attn/integrations/transformers.py", "from ..bench import shapes\n", 1),
    "the root imports a tool": ("cudnn_attn/__init__.py", "from .cli import main\n", 1),
    "bench imports cli": ("cudnn_attn/bench/attention.py", "from ..cli import commands\n", 1),
    "same layer": ("cudnn_attn/core/problem.py", "from .roles import ROLES\n", 0),
    "earlier doors": ("cudnn_attn/fp8.py", "from .functional import sdpa\nfrom .varlen import x\n", 0),
    "submodules through the root": ("cudnn_attn/nn.py", "from . import errors, functional\n", 0),
    "a tool: root and bench": ("cudnn_attn/cli/info.py", "from .. import Graph\nfrom ..bench import shapes\n", 0),
    "the root re-exports a door": ("cudnn_attn/__init__.py", "from .serving.paged_attention import Paged\n", 0),
    "graph imports recording": ("cudnn_attn/graph.py", "from .recording import node\n", 0),
    "graph imports the frontend wing": ("cudnn_attn/graph.py", "from .frontend import execute\n", 0),
    "the wing imports recording": ("cudnn_attn/frontend/execute.py", "from ..recording.state import Recording\n", 0),
    "the wing imports graph": ("cudnn_attn/frontend/plans.py", "if TYPE_CHECKING:\n    from ..graph import Graph\n", 1),
    "recording imports the wing": (
        "cudnn_attn/recording/build.py",
        "def f():\n    from ..frontend import declared\n",
        1,
    ),
    "core imports the wing": ("cudnn_attn/core/roles.py", "from ..frontend.compat import heur_mode\n", 1),
    "not the package": ("cudnn_attn/core/problem.py", "import torch\n", 0),
}


@pytest.mark.parametrize("case", LAYER_CASES, ids=list(LAYER_CASES))
def test_the_layer_rule_on_a_synthetic_import(case):
    label, source, refused = LAYER_CASES[case]
    assert len(layer_problems(label, source)) == refused


def test_the_layer_report_names_file_line_and_layers():
    found = layer_problems("cudnn_attn/core/problem.py", '"""Doc."""\nfrom ..graph import Graph\n')
    assert found == ["cudnn_attn/core/problem.py:2: 1 core imports cudnn_attn.graph (5.2 graph)"]


def test_a_private_read_across_modules_is_caught():
    files = {
        "cudnn_attn/graph.py": "class Graph:\n    def __init__(self):\n        self._runner = None\n",
        "cudnn_attn/functional/eager.py": "def run(graph, x):\n    return graph._runner(x), x._version, x.__dict__\n",
        "cudnn_attn/runtime/runner.py": "class Runner:\n    _steps = ()\n\n    def f(self, other):\n        return other._steps\n",
        "cudnn_attn/ops/cudnn/frontend_internals.py": "def f(graph):\n    return graph._runner\n",
    }
    assert private_read_problems(files) == [
        "cudnn_attn/functional/eager.py:2: reads graph._runner (defined in cudnn_attn/graph.py)"
    ]


def test_a_name_shadowing_a_submodule_is_caught():
    source = "from . import nn\nfrom .fp8 import fp8\nfrom .core.dtypes import data_type\n\ndef graph(): ...\n"
    found = shadowing_problems("__init__.py", PACKAGE, source, {"nn", "fp8", "data_type", "graph"})
    assert [line.split(": ")[1].split()[0] for line in found] == ["cudnn_attn.fp8", "cudnn_attn.data_type"]


# Which engine runs a problem, and which kernel a paged decode step, is chosen in ops/dispatch.py
# alone (issue 43, move 1): no other layer tells backends or kernels apart by name, so a new one
# touches ops/ (and runtime/, which passes names on).
ENGINE_NAMES = frozenset({"cudnn", "reference", "torch", "torch_cudnn", "triton"})
CHOOSERS = (f"{PACKAGE}/ops/", f"{PACKAGE}/runtime/")


def backend_name_comparisons(label: str, source: str) -> list[str]:
    """Each comparison in ``source`` with a backend's name as a literal operand (``x == "cudnn"``,
    ``name in ("cudnn", "triton")``): ``file:line: the comparison``."""

    def names_a_backend(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in ENGINE_NAMES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_a_backend(e) for e in node.elts)

    return [
        f"{label}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare) and any(names_a_backend(e) for e in (node.left, *node.comparators))
    ]


def test_only_ops_and_runtime_compare_backend_names():
    found = [
        line
        for label, source in package_sources().items()
        if not label.startswith(CHOOSERS)
        for line in backend_name_comparisons(label, source)
    ]
    assert not found, "backend names compared outside ops/ and runtime/:\n" + "\n".join(found)


def test_a_backend_name_comparison_is_caught():
    source = (
        'if chosen.name == "cudnn":\n    pass\n'
        'on_gpu = name != "reference"\n'
        'fast = kernel in ("triton", "cudnn")\n'
        'fine = name in BACKENDS and column == "picked"\n'
    )
    found = backend_name_comparisons("cudnn_attn/functional/eager.py", source)
    assert [line.split(":")[1] for line in found] == ["1", "3", "4"], found


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """Each circle of imports among ``files`` (label -> source), ``TYPE_CHECKING`` and lazy imports
    included: the modules of one strongly connected group, sorted; none when they import acyclically."""
    modules = {label: module_name(ROOT / label) or label for label in files}
    edges: dict[str, set[str]] = {module: set() for module in modules.values()}
    for label, source in files.items():
        module = modules[label]
        for imp in imports(source, module, label.endswith("/__init__.py"), label):
            edges[module] |= {t for t in imported_modules(imp) if t in edges and t != module}
    reach = {name: _reachable(name, edges) for name in edges}
    groups = {frozenset(n for n in edges if name in reach[n] and n in reach[name]) for name in edges}
    return sorted(sorted(group) for group in groups if len(group) > 1)


def _reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


# Folders whose modules import each other one way only (recording/'s six-file circle was broken
# with small Protocols: handles.RecordingPort, key.Recorded).
ACYCLIC_FOLDERS = (f"{PACKAGE}/recording/", f"{PACKAGE}/frontend/")


@pytest.mark.parametrize("folder", ACYCLIC_FOLDERS)
def test_a_folders_modules_import_each_other_acyclically(folder):
    files = {label: source for label, source in package_sources().items() if label.startswith(folder)}
    assert len(files) > 3, f"{folder}: almost no modules found"
    assert import_cycles(files) == []


def test_an_import_cycle_is_caught_type_only_included():
    files = {
        "cudnn_attn/recording/state.py": "from .handles import InputHandle\n",
        "cudnn_attn/recording/handles.py": "if TYPE_CHECKING:\n    from .key import RecordingKey\n",
        "cudnn_attn/recording/key.py": "def f():\n    from .state import Recording\n",
        "cudnn_attn/recording/node.py": "from .handles import InputHandle\n",
    }
    assert import_cycles(files) == [
        ["cudnn_attn.recording.handles", "cudnn_attn.recording.key", "cudnn_attn.recording.state"]
    ]
    del files["cudnn_attn/recording/key.py"]
    assert import_cycles(files) == []


# The formatter lays out every line (the 450-line rule counts its layout); a marker that keeps a
# hand-aligned table is allowed, a few dozen at most, never to pack code onto fewer lines.
MAX_FMT_SKIP_MARKERS = 24


FORMATTER_OFF = re.compile(r"#\s*(fmt:\s*(skip|off)|yapf:\s*disable)\b")
FORMATTER_ON = re.compile(r"#\s*fmt:\s*on\b")


def lines_the_formatter_leaves(source: str) -> list[int]:
    """The lines a formatter is told to leave as written: each ``# fmt: skip`` (any spacing, any
    comment after it), ``# yapf: disable``, and every line from ``# fmt: off`` to ``# fmt: on``."""
    found, off_since = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if off_since is not None and FORMATTER_ON.match(token.string):
            found += range(off_since, line + 1)
            off_since = None
        elif FORMATTER_OFF.match(token.string):
            if "off" in token.string:
                off_since = line
            else:
                found.append(line)
    if off_since is not None:
        found += range(off_since, len(source.splitlines()) + 1)
    return found


def test_lines_the_formatter_leaves_are_found_however_marked():
    source = (
        "a = 1  # fmt:skip\nb = 2  # fmt: skip # noqa\n# fmt: off\nc = 3\n# fmt: on\nd = 4  # yapf: disable\ne = 5\n"
    )
    assert lines_the_formatter_leaves(source) == [1, 2, 3, 4, 5, 6]


def test_the_formatter_lays_out_the_package_its_tests_samples_and_docs_hooks():
    sources = {
        p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for folder in (PACKAGE, "tests", "samples", "docs")
        for p in sorted((ROOT / folder).rglob("*.py"))
    }
    found = [f"{label}:{line}" for label, source in sources.items() for line in lines_the_formatter_leaves(source)]
    assert len(found) <= MAX_FMT_SKIP_MARKERS, f"{len(found)} lines the formatter is told to leave:\n" + "\n".join(
        found
    )
