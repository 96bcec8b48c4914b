"""Every cross-reference in the package's docstrings names a module or object that exists.

A reference that names a moved, renamed or deleted module sends the reader to the wrong place and
fails the docs build's link check only long after the change that broke it. Checked in every
docstring (module, class, function) of ``lightning_pipetransformer``:

* Sphinx roles (``:func:``, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:exc:``, ``:data:``,
  ``:obj:``, ``:const:``), ``~`` and ``!`` prefixes and ``title <target>`` forms included. A target
  starting with ``.`` is resolved against the module, then each package above it; an unqualified one
  against the enclosing classes, the module's names (``TYPE_CHECKING`` imports too) and builtins, and
  failing those, any module or class of the package that defines that name.
* Dotted ``lightning_pipetransformer.x.y`` names anywhere in the text.
* Names in backticks that point at our modules: ``something.py`` paths, dotted names that start with
  one of our subpackages (``pipe.microbatch``), and bare names shaped like a module of ours
  (``cache_validity``: a subpackage name, ``_``, a word) that nothing in the package is called.

A module reached through an attribute must define it or list it in ``__all__`` (a package's
``__init__`` may re-export): a name that only happens to be imported there is where the object was,
not where it is.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "lightning_pipetransformer"
SKIPPED_MODULES = {"__main__"}  # importing it runs the command line

ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|exc|data|obj|const):`([^`]+)`")
DOUBLE = re.compile(r"``([^`]+)``")
SINGLE = re.compile(r"(?<![`\w])`([^`]+)`(?![`_])")
IDENTIFIER = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"^{IDENTIFIER}(?:\.{IDENTIFIER})*$")
PATH = re.compile(r"^[\w/.-]*\w\.py$")
REPO_PATH = re.compile(r"\b(?:docs|tests|benchmarks|scripts|examples)/[\w/.-]*\w\.[a-z]+")
FILE_SUFFIXES = {"json", "png", "csv", "md", "txt", "pt", "yaml", "toml", "pdf", "html", "log", "lock"}
# Files of other projects a docstring cites by name, and why each is not ours.
EXTERNAL_FILES = {"freeze_intermediate_e2e_lr.py": "the original AutoFreeze code (Liu et al., 2021)"}


@dataclass(frozen=True)
class Broken:
    path: str
    line: int
    reference: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reference} -- {self.problem}"


# ------------------------------------------------------------------------------------------ the package


@dataclass
class Package:
    """What the checker knows of a package: its modules, every name defined in it, its subpackages."""

    name: str
    root: Path  # the package's folder

    def __post_init__(self) -> None:
        self.files = {self.module_of(p): p for p in sorted(self.root.rglob("*.py")) if p.stem not in SKIPPED_MODULES}
        self.subpackages = {p.parent.name for p in self.root.glob("*/__init__.py")}
        self.basenames = {m.rsplit(".", 1)[-1] for m in self.files}
        self.identifiers: set[str] = set()
        self.definers: dict[str, list[str]] = {}  # name -> the module-level or class-level places that define it
        for module, path in self.files.items():
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                self.identifiers.update(_identifiers(node))
            for qualname, node in _definitions(tree):
                self.definers.setdefault(qualname.rsplit(".", 1)[-1], []).append(f"{module}.{qualname}")

    def module_of(self, path: Path) -> str:
        parts = path.relative_to(self.root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _identifiers(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.alias):
        yield (node.asname or node.name).split(".")[0]


def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Module-level and class-level names (functions, classes, assignments, annotated fields)."""

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                yield prefix + node.name, node
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        yield prefix + target.id, node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                yield prefix + node.target.id, node
            elif isinstance(node, (ast.If, ast.Try)):
                yield from walk(node.body, prefix)

    yield from walk(tree.body, "")


# ------------------------------------------------------------------------------------------ resolving


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _instance_attribute(cls: type, name: str) -> bool:
    """``self.name = ...`` or ``self.name: T`` in a method, a dataclass or annotated field, or a slot."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=", source):
            return True
    return False


def _member(owner: object, name: str) -> tuple[bool, object]:
    """``(found, value)`` of ``owner.name``; an instance attribute of a class is found with value None."""
    if isinstance(owner, ModuleType):
        if hasattr(owner, name):
            return True, getattr(owner, name)
        submodule = _import(f"{owner.__name__}.{name}") if hasattr(owner, "__path__") else None
        return (True, submodule) if submodule is not None else (False, None)
    if isinstance(owner, type):
        if hasattr(owner, name):
            return True, getattr(owner, name)
        return _instance_attribute(owner, name), None
    if owner is None:  # an instance attribute's own attributes: unknown, not checked further
        return True, None
    return hasattr(owner, name), getattr(owner, name, None)


def _imported_only(module: ModuleType, name: str, value: object) -> str | None:
    """Where ``value`` really lives, when ``module`` only imports it (and is not a package re-exporting it)."""
    home = getattr(value, "__module__", None)
    if isinstance(value, ModuleType) or not (inspect.isclass(value) or inspect.isfunction(value)) or home is None:
        return None
    if home == module.__name__ or name in getattr(module, "__all__", ()) or hasattr(module, "__path__"):
        return None
    return f"{home}.{value.__qualname__}"


def walk(owner: object, owner_name: str, parts: list[str]) -> str | None:
    """None when ``owner.parts[0].parts[1]...`` exists; else what is wrong with it."""
    for part in parts:
        found, value = _member(owner, part)
        if not found:
            return f"{owner_name} has no {part!r}"
        if isinstance(owner, ModuleType) and (home := _imported_only(owner, part, value)):
            return f"{owner_name}.{part} is only imported there: it is {home}"
        owner, owner_name = value, f"{owner_name}.{part}"
    return None


def resolve_absolute(target: str) -> str | None:
    """None when ``target`` (fully dotted) exists; else what is wrong with it."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module = _import(".".join(parts[:i]))
        if module is not None:
            return walk(module, module.__name__, parts[i:])
    return f"no module {parts[0]!r}"


class ModuleScope:
    """Where an unqualified or relative reference in one module's docstrings may point."""

    def __init__(self, package: Package, module: str, tree: ast.Module) -> None:
        self.package, self.module_name = package, module
        self.module = importlib.import_module(module)
        self.imported_names: dict[str, str] = {}  # every import in the file, those under TYPE_CHECKING (not run) too
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imported_names.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imported_names.setdefault(alias.asname or alias.name.split(".")[0], alias.name if alias.asname else alias.name.split(".")[0])

    def packages_up(self) -> Iterator[str]:
        """The module, then each package above it, up to the top one."""
        parts = self.module_name.split(".")
        is_package = hasattr(self.module, "__path__")
        start = len(parts) if is_package else len(parts) - 1
        yield self.module_name
        for i in range(start, 0, -1):
            yield ".".join(parts[:i])

    def check(self, target: str, classes: list[str]) -> str | None:
        """None when ``target`` names something that exists; else the problem."""
        if target.startswith("."):
            if any(resolve_absolute(f"{base}{target}") is None for base in self.packages_up()):
                return None
            return f"not in {self.module_name} nor in a package above it"
        head, _, rest = target.partition(".")
        # the enclosing classes, innermost first
        for depth in range(len(classes), 0, -1):
            qualname = ".".join(classes[:depth])
            if resolve_absolute(f"{self.module_name}.{qualname}.{head}") is None:
                return resolve_absolute(f"{self.module_name}.{qualname}.{target}")
        if hasattr(self.module, head):  # defined or imported here: followed from the object itself
            return walk(getattr(self.module, head), head, rest.split(".") if rest else [])
        if head in self.imported_names:
            return resolve_absolute(f"{self.imported_names[head]}{'.' + rest if rest else ''}")
        if hasattr(builtins, head):
            return None if not rest or hasattr(getattr(builtins, head), rest.split(".")[0]) else f"builtin {head} has no {rest!r}"
        problem = resolve_absolute(target)
        if problem is None:
            return None
        # Elsewhere in the package (Sphinx would need the qualified name, but the object exists).
        last = target.rsplit(".", 1)[-1]
        if any(place.endswith("." + target) for place in self.package.definers.get(last, [])):
            return None
        return f"nothing called {target!r} in {self.module_name} or anywhere in {self.package.name}"


# ------------------------------------------------------------------------------------------ reading docstrings


def docstrings(tree: ast.Module) -> Iterator[tuple[list[str], str, int]]:
    """``(enclosing classes, docstring, line of its first character)`` for every docstring."""

    def visit(node: ast.AST, classes: list[str]) -> Iterator[tuple[list[str], str, int]]:
        body = getattr(node, "body", None)
        inner = classes + [node.name] if isinstance(node, ast.ClassDef) else classes  # a class's docstring sees its members
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                yield inner, first.value.value, first.value.lineno
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(tree, [])


def _blank(text: str, match: re.Match) -> str:
    return text[: match.start()] + " " * (match.end() - match.start()) + text[match.end() :]


def references(text: str, package: str) -> Iterator[tuple[int, str, str]]:
    """``(offset, kind, target)``: kind is a role name, ``"dotted"``, ``"path"`` or ``"name"``."""
    for match in ROLE.finditer(text):
        target = match.group(2).strip()
        if target.endswith(">") and "<" in target:
            target = target[target.rindex("<") + 1 : -1]
        target = target.lstrip("~!").removesuffix("()")
        yield match.start(), match.group(1), target
        text = _blank(text, match)
    for match in REPO_PATH.finditer(text):
        yield match.start(), "path", match.group(0)
        text = _blank(text, match)
    for match in re.finditer(rf"\b{package}(?:\.{IDENTIFIER})+", text):
        yield match.start(), "dotted", match.group(0)
    for pattern in (DOUBLE, SINGLE):
        for match in pattern.finditer(text):
            content = match.group(1).strip()
            if PATH.match(content):
                yield match.start(), "path", content
            elif DOTTED.match(content) and not content.startswith(package + "."):
                yield match.start(), "name", content
            text = _blank(text, match)


def check_name(package: Package, scope: ModuleScope, name: str) -> str | None:
    """A backticked name that points at one of our modules: a subpackage path, or a bare module-shaped name."""
    head, _, rest = name.partition(".")
    if rest and name.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # a file name such as timeline.json
        return None
    if rest and head in package.subpackages and not hasattr(scope.module, head):
        return resolve_absolute(f"{package.name}.{name}")
    if not rest and "_" in name and name.split("_", 1)[0] in package.subpackages | {"pipeline"}:
        if name not in package.identifiers and name not in package.basenames:
            return f"no module, object or name {name!r} in {package.name}"
    return None


def check_path(package: Package, path: str) -> str | None:
    if path in EXTERNAL_FILES:
        return None
    candidates = [package.root / path, package.root.parent / path]
    if any(c.is_file() for c in candidates) or any(str(p).endswith("/" + path) for p in package.files.values()):
        return None
    return f"no file {path}"


def where(package: Package, target: str) -> list[str]:
    """Where the package defines what ``target`` seems to mean: its last name as an object or a module
    (``cache_validity`` read as ``cache/validity``)."""
    last = target.rsplit(".", 1)[-1]
    places = list(package.definers.get(last, []))
    places += [m for m in package.files if m.rsplit(".", 1)[-1] == last]
    head, _, tail = last.partition("_")
    places += [m for m in package.files if tail and m.endswith(f".{head}.{tail}")]
    return sorted(set(places))


def broken_references(package: Package) -> list[Broken]:
    """Every broken reference in the package's docstrings."""
    if str(package.root.parent) not in sys.path:
        sys.path.insert(0, str(package.root.parent))
    out = []
    for module, path in package.files.items():
        tree = ast.parse(path.read_text())
        scope = ModuleScope(package, module, tree)
        shown = path.relative_to(package.root.parent).as_posix()
        for classes, text, first_line in docstrings(tree):
            for offset, kind, target in references(text, package.name):
                if kind == "dotted":
                    problem = resolve_absolute(target)
                elif kind == "path":
                    problem = check_path(package, target)
                elif kind == "name":
                    problem = check_name(package, scope, target)
                else:
                    problem = scope.check(target, classes)
                if problem:
                    if places := where(package, target):
                        problem += f"; did it mean {' or '.join(places)}?"
                    line = first_line + text[:offset].count("\n")
                    shown_target = target if kind in ("dotted", "path", "name") else f":{kind}:`{target}`"
                    out.append(Broken(shown, line, shown_target, problem))
    return out


# ------------------------------------------------------------------------------------------ the tests


def test_every_docstring_reference_names_something_that_exists():
    broken = broken_references(Package(PACKAGE, REPO / PACKAGE))
    assert not broken, f"{len(broken)} docstring references name nothing that exists:\n" + "\n".join(map(str, broken))


SYNTHETIC = {
    "__init__.py": '''"""A package: :class:`Thing` is re-exported here, :mod:`.inner` is a module."""
from refpkg.inner import Thing, helper
__all__ = ["Thing"]
''',
    "inner.py": '''"""Module docstring: :func:`helper`, :class:`~.inner.Thing`, :mod:`refpkg.other_mod`."""
import os


def helper() -> None:
    """Uses :meth:`Thing.run`, :attr:`Thing.size`, :func:`os.path.join`, :exc:`ValueError`."""


class Thing:
    """Sees :meth:`run` and :attr:`size`; not :meth:`walk`."""

    def __init__(self) -> None:
        self.size = 1

    def run(self) -> None:
        """See ``refpkg.inner.Thing.run``, ``inner.py`` and ``refpkg_gone``; also `refpkg.inner.nothing`."""
''',
    "user.py": '''"""Imports helper from inner: :func:`~.user.helper` is not where it lives, :func:`~.inner.helper` is.

:class:`~.missing.Thing` points at a module that is gone; see ``gone.py``, docs/there.md, not docs/gone.md.
"""
from refpkg.inner import helper
''',
}


def test_the_checker_finds_each_kind_of_broken_reference_and_passes_the_good_ones(tmp_path, monkeypatch):
    root = tmp_path / "refpkg"
    root.mkdir()
    for name, text in SYNTHETIC.items():
        (root / name).write_text(textwrap.dedent(text))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("here")
    monkeypatch.syspath_prepend(str(tmp_path))
    package = Package("refpkg", root)
    package.subpackages.add("refpkg")  # so that a bare "refpkg_<word>" looks like one of its modules
    try:
        found = {(b.path, b.reference) for b in broken_references(package)}
    finally:
        for name in [m for m in sys.modules if m == "refpkg" or m.startswith("refpkg.")]:
            del sys.modules[name]
    assert found == {
        ("refpkg/inner.py", ":mod:`refpkg.other_mod`"),
        ("refpkg/inner.py", ":meth:`walk`"),
        ("refpkg/inner.py", "refpkg_gone"),
        ("refpkg/inner.py", "refpkg.inner.nothing"),
        ("refpkg/user.py", ":func:`.user.helper`"),
        ("refpkg/user.py", ":class:`.missing.Thing`"),
        ("refpkg/user.py", "gone.py"),
        ("refpkg/user.py", "docs/gone.md"),
    }, found
