"""Print the requirements of the package's extras that this environment lacks, one per line.

    python scripts/missing_requirements.py dev            # e.g. "pytest>=8", "hypothesis>=6.100", ...
    python scripts/missing_requirements.py examples,cli,plot

scripts/setup.sh runs it with .venv's python when .venv already holds the package for this
pyproject.toml with other extras (the demo's ``examples,cli,plot`` before the tests' ``dev``): pip
then installs only what is printed, instead of reinstalling the package and everything it has. It
reads the installed package's metadata (its ``Requires-Dist`` lines, written from pyproject.toml at
install time), follows extras that name the package itself (``dev`` includes ``examples``) and the
extras of a dependency (``jsonargparse[signatures]``), and checks each requirement against what
is installed. Exit status 2 when the package itself is not installed (a full install is needed).
"""

from __future__ import annotations

import sys
from importlib import metadata

try:  # everything Lightning needs installs packaging; pip vendors a copy too
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - an environment without either: setup.sh's full install covers it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

PACKAGE = "lightning-pipetransformer"

__all__ = ["PACKAGE", "main", "missing"]


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` is required with ``extras`` (its marker names one of them, or it has no extra in its marker)."""
    if req.marker is None:
        return not extras or "" in extras
    return any(req.marker.evaluate({"extra": extra}) for extra in extras or {""})


def _installed(req: Requirement) -> bool:
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    return not req.specifier or req.specifier.contains(version, prereleases=True)


def missing(dist: str, extras: set[str], seen: set[tuple[str, str]] | None = None) -> list[str]:
    """The requirements of ``dist`` with ``extras`` (``""``: its base requirements) that are not installed,
    as pip takes them (markers dropped); the extras of an installed dependency are followed too."""
    seen = set() if seen is None else seen
    out: list[str] = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if not _applies(req, extras):
            continue
        if _key(req.name) == _key(dist):  # "lightning-pipetransformer[examples]" inside "dev": follow it
            todo = {e for e in req.extras if (_key(dist), e) not in seen}
            seen |= {(_key(dist), e) for e in todo}
            out += missing(dist, todo, seen) if todo else []
            continue
        req.marker = None
        if not _installed(req):
            out.append(str(req))
        elif req.extras and any((_key(req.name), e) not in seen for e in req.extras):
            seen |= {(_key(req.name), e) for e in req.extras}
            out += missing(req.name, set(req.extras), seen)
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    extras = {e.strip() for e in (args[0] if args else "dev").split(",") if e.strip()}
    try:
        metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        print(f"{PACKAGE} is not installed here", file=sys.stderr)
        return 2
    for requirement in missing(PACKAGE, extras, {(_key(PACKAGE), e) for e in extras}):
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
