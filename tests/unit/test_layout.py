"""The package's layout rules (issue 16): who may import Lightning, and who may touch its private names.

A Lightning upgrade should have one place to look (``lightning_internals.py``), and the parts of
the paper (stack/, freeze/, pipe/, dp/, cache/, costmodel/) should stay usable and testable
without a Trainer. These tests read the source (``ast``), so they fail on a new import even in a
branch no test executes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_pipetransformer

PACKAGE = Path(lightning_pipetransformer.__file__).parent

#: Modules that speak Lightning, each for a reason; every other module must not import it.
LIGHTNING_FACING = {
    "strategy.py": "the Strategy itself",
    "processes.py": "the Strategy's process-level hooks (its base class)",
    "lightning_internals.py": "every private Lightning name, in one place",
    "freeze/callback.py": "AutoFreeze is a Callback",
    "dp/idle_hooks.py": "wraps the LightningModule's hooks on idle ranks",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def _imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import, at any depth (lazy imports count too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names], node.lineno))
    return out


def _is_lightning(module: str) -> bool:
    return module.split(".")[0] in ("lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning")


def test_only_the_lightning_facing_modules_import_lightning() -> None:
    modules = _modules()
    assert len(modules) > 30 and any(name == "strategy.py" for name, _ in modules), "the package was not found"
    offenders = [
        f"{name}:{line} imports {module}"
        for name, tree in modules
        if name not in LIGHTNING_FACING
        for module, _, line in _imports(tree)
        if _is_lightning(module)
    ]
    assert not offenders, (
        "These modules import Lightning but are not in LIGHTNING_FACING (tests/unit/test_layout.py): "
        + "; ".join(offenders)
        + ". Keep the parts Lightning-free, or add the module there with its reason."
    )
    # The allow-list names real modules, and each of them does import Lightning (else drop it).
    imports_lightning = {name for name, tree in modules if any(_is_lightning(m) for m, _, _ in _imports(tree))}
    assert set(LIGHTNING_FACING) <= imports_lightning, sorted(set(LIGHTNING_FACING) - imports_lightning)


def test_private_lightning_names_only_in_lightning_internals() -> None:
    offenders = []
    for name, tree in _modules():
        if name == "lightning_internals.py":
            continue
        for module, names, line in _imports(tree):
            private = [n for n in names if n.startswith("_")] + [part for part in module.split(".") if part.startswith("_")]
            if _is_lightning(module) and private:
                offenders.append(f"{name}:{line} imports {private} from {module}")
        for node in ast.walk(tree):  # trainer._logger_connector, loop._results, ...
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and _root_name(node.value) in ("trainer", "fit_loop", "epoch_loop", "loop", "pl_module")
            ):
                offenders.append(f"{name}:{node.lineno} reads {_root_name(node.value)}...{node.attr}")
    assert not offenders, "Private Lightning names outside lightning_internals.py: " + "; ".join(offenders)


def _root_name(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def test_the_layout_rules_catch_a_violation(tmp_path) -> None:
    """The checks above can fail: a Lightning import and a private read are found in a sample module."""
    tree = ast.parse("import torch\nfrom lightning.pytorch.loops import _Loop\n\ndef f(trainer):\n    return trainer._logger_connector\n")
    found = _imports(tree)
    assert any(_is_lightning(m) and "_Loop" in names for m, names, _ in found)
    reads = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _root_name(n.value) == "trainer"]
    assert reads == ["_logger_connector"]
