"""Which code computes the frozen prefix: each module class's code and the version of the package it comes from.

Weights do not name a function on their own: the same weights through another forward (an edited model
file, another transformers release, a patched method) compute something else. Within one run that
cannot happen unnoticed for long, but entries kept for later runs (``cache_keep``) would be served to
whatever code the later run has. So the prefix's fingerprint
(:func:`~lightning_pipetransformer.cache.validity.prefix_fingerprint`) also hashes, for every distinct class
among the prefix's modules and their bases (torch's own classes are named by the torch version the
fingerprint already holds):

- the code objects of every function the class defines (``forward`` and the helpers it calls as
  methods; decorated functions through their ``__wrapped__`` and closures), and of the module-level
  functions of the class's own module they call by name (a model file's ``eager_attention_forward``);
- the version of the installed distribution the class's top-level package comes from (``transformers``,
  ``timm``), which covers the rest of that package (functions reached by other ways than a name).

Code objects rather than source text: they are what runs. A file edited after it was imported (a
notebook session) shows source that is not the code in memory, and two classes of one name in one
file would make ``inspect`` read the wrong one. Bytecode differs between Python versions, so the
interpreter's version is part of the identity too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

__all__ = ["class_code_lines", "interpreter"]

#: The attribute that marks the block subclasses the interception swaps in (stack/interception.py sets it).
_INTERCEPTION_MARK = "_pipetransformer_base"

#: How many functions one class's digest follows at most (a model file's helpers call few others).
_MAX_FUNCTIONS = 512


def interpreter() -> str:
    """The interpreter whose bytecode the code digests hash."""
    return f"{sys.implementation.name} {sys.version.split()[0]}"


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Top-level package -> the distributions that install it (read once per process: it scans site-packages)."""
    return dict(importlib.metadata.packages_distributions())


@functools.cache
def package_version(module: str) -> str:
    """``name==version`` of the distribution ``module`` belongs to, or ``unversioned`` (a script, a test file)."""
    top = module.split(".")[0]
    for name in _distributions().get(top, []):
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unversioned"


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _const(value: Any) -> str:
    """A constant of a code object, the same text in every process (a frozenset's order follows the string hash
    seed, so its items are sorted)."""
    if isinstance(value, types.CodeType):
        return _code_digest(value)
    if isinstance(value, frozenset):
        return "frozenset(" + ",".join(sorted(_const(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_const(v) for v in value) + ")"
    return repr(value)


def _code_digest(code: types.CodeType) -> str:
    """What one code object computes: its bytecode, the names it reads and its constants (nested code too)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount, code.co_kwonlyargcount)).encode())
    h.update(",".join(_const(c) for c in code.co_consts).encode())
    return h.hexdigest()


def _functions_of(value: Any) -> Iterator[types.FunctionType]:
    """The Python functions behind a class attribute: methods, static/class methods, properties, decorated wrappers."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for part in (value.fget, value.fset, value.fdel):
            yield from _functions_of(part)
        return
    if isinstance(value, types.FunctionType):
        yield value


def _reached(function: types.FunctionType) -> Iterator[types.FunctionType]:
    """Functions one function hands the work to: what it wraps, what its closure holds, and the functions of its
    own module it calls by name (not another package's: that one's version names them)."""
    wrapped = getattr(function, "__wrapped__", None)
    if isinstance(wrapped, types.FunctionType):
        yield wrapped
    for cell in function.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, types.FunctionType):
            yield content
    module = function.__module__
    for name in _names(function.__code__):
        found = function.__globals__.get(name)
        if isinstance(found, types.FunctionType) and found.__module__ == module:
            yield found


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _class_digest(klass: type) -> str:
    """The code of the functions ``klass`` defines itself, and of those they reach (bounded)."""
    todo = [f for value in vars(klass).values() for f in _functions_of(value)]
    seen: set[int] = set()
    digests: list[str] = []
    while todo and len(seen) < _MAX_FUNCTIONS:
        function = todo.pop()
        if id(function) in seen or _is_torch(function.__module__ or ""):
            continue
        seen.add(id(function))
        digests.append(f"{function.__module__}.{function.__qualname__}:{_code_digest(function.__code__)}")
        todo.extend(_reached(function))
    return hashlib.blake2b("\n".join(sorted(digests)).encode(), digest_size=16).hexdigest()


def _classes(modules: Iterable[nn.Module]) -> list[type]:
    """Every distinct class among ``modules``, their submodules and their bases (but ``object``), in a fixed order."""
    found: dict[str, type] = {}
    for root in modules:
        for sub in root.modules():
            for klass in type(sub).__mro__:
                # Not object, and not the subclass the interception swaps in (stack/interception.py): it is this
                # package's, present or not depending on the runner installed when the fingerprint is taken.
                if klass is not object and _INTERCEPTION_MARK not in vars(klass):
                    found.setdefault(f"{klass.__module__}.{klass.__qualname__}#{id(klass)}", klass)
    return [found[name] for name in sorted(found, key=lambda n: n.split("#")[0])]


def class_code_lines(modules: Iterable[nn.Module]) -> list[str]:
    """One line per distinct class of the prefix: its name, its package's version and (outside torch) its code."""
    lines = []
    for klass in _classes(modules):
        module = klass.__module__ or ""
        code = "torch" if _is_torch(module) else _class_digest(klass)
        lines.append(f"code {module}.{klass.__qualname__} {package_version(module)} {code}")
    return lines
