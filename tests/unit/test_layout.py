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
    "timeline/callback.py": "PipeTransformerTimeline is a Callback",
    "trainer_side.py": "the strategy's reads of the Trainer (its AutoFreeze, the batch-transfer hooks, the loggers)",
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
        offenders += [f"{name}:{line} reads {read}" for line, read in _private_lightning_reads(tree)]
    assert not offenders, "Private Lightning names outside lightning_internals.py: " + "; ".join(offenders)


#: Private attributes of a LightningModule, caught whatever the name they are read through
#: (``module._trainer``, ``self.lightning_module._trainer``): lightning_internals.attached_trainer reads it.
LIGHTNING_MODULE_PRIVATE = ("_trainer", "_fabric")


def _private_lightning_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of every private Lightning attribute read: ``trainer._logger_connector``, ``loop._results``, ...,
    and a LightningModule's own (:data:`LIGHTNING_MODULE_PRIVATE`) through any name."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, (ast.Name, ast.Attribute)) and _root_name(node.value) in ("trainer", "fit_loop", "epoch_loop", "loop", "pl_module"):
            found.append((node.lineno, f"{_root_name(node.value)}...{node.attr}"))
        elif node.attr in LIGHTNING_MODULE_PRIVATE:
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


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
    assert _private_lightning_reads(tree) == [(5, "trainer..._logger_connector")]


def test_the_private_name_rule_catches_a_lightning_modules_trainer_read_through_any_name():
    """``module._trainer`` (what LightningModule.trainer reads without raising) is Lightning's private name too."""
    sample = ast.parse(
        "def teardown(self, module):\n"
        "    trainer = module._trainer if module is not None else None\n"
        "    status = self.lightning_module._trainer.state.status\n"
        "    return module._parameters, module.__class__, trainer._fit_loop\n"
    )
    assert _private_lightning_reads(sample) == [
        (2, "module._trainer"), (3, "self.lightning_module._trainer"), (4, "trainer..._fit_loop"),
    ]  # fmt: skip


#: The package's floors (issue 26): a folder or top-level module may import only lower floors (and
#: itself). An import sideways or up, or a circle, fails below: the part that needs the other is the
#: higher one, or the shared piece moves down (as cache/prefix.py, plan.boundaries, runners.py did).
FLOORS = {
    "plan": 0, "config": 0, "devices": 0, "lightning_internals": 0, "warn_once": 0, "tree": 0, "terminal": 0,
    "stack": 1,
    "freeze": 2, "pipe": 2,
    "cache": 3, "costmodel": 3, "dp": 3,
    "runners": 4, "report": 4, "timeline": 4,
    "engine": 5, "processes": 5, "trainer_side": 5,
    "coordinator": 5.5,  # between: it drives the engine (floor 5) and the strategy's hooks call it (floor 6)
    "strategy": 6,
    "__init__": 7,  # the package's face: `from lightning_pipetransformer import AutoFreeze` imports everything
}  # fmt: skip


def _unit(name: str) -> str:
    """The folder (``cache``) or top-level module (``engine``) a module path belongs to."""
    first = name.split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def _package_imports(name: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(absolute module, names, line) of every import of the package by ``name``, relative ones resolved."""
    out = []
    here = ["lightning_pipetransformer", *name[:-3].split("/")][:-1]  # the package the module is in
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names if alias.name.split(".")[0] == "lightning_pipetransformer"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] == "lightning_pipetransformer":
                out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


def _unit_arrows(modules: list[tuple[str, ast.Module]]) -> set[tuple[str, str, str]]:
    """(from unit, to unit, where) for every import of the package by another of its units (lazy ones too)."""
    units = {_unit(name) for name, _ in modules} | set(FLOORS)
    arrows = set()
    for name, tree in modules:
        here = _unit(name)
        for module, names, line in _package_imports(name, tree):
            parts = module.split(".")
            if len(parts) > 1:
                targets = [parts[1]]
            else:  # from the package itself: its submodules by name, anything else from its face
                targets = [n if n in units else "__init__" for n in names]
            arrows |= {(here, t, f"{name}:{line}") for t in targets if t in units and t != here}
    return arrows


def _floor_offenders(arrows: set[tuple[str, str, str]], floors: dict[str, int]) -> list[str]:
    return sorted(f"{where}: {a} (floor {floors.get(a)}) imports {b} (floor {floors.get(b)})"
                  for a, b, where in arrows if a not in floors or b not in floors or floors[b] >= floors[a])  # fmt: skip


def _circles_inside_folders(modules: list[tuple[str, ast.Module]]) -> list[list[str]]:
    """Circles among the modules of one folder (``cache/autocache.py`` <-> ``cache/cached_stack.py``)."""
    names = {name for name, _ in modules}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, tree in modules:
        for module, imported, _ in _package_imports(name, tree):
            parts = module.split(".")[1:]
            candidates = ["/".join(parts) + ".py", "/".join(parts) + "/__init__.py"]
            candidates += ["/".join([*parts, n]) + ".py" for n in imported]
            for target in candidates:
                if target in names and target != name and _unit(target) == _unit(name) and "/" in name:
                    graph[name].add(target)
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_every_import_between_folders_runs_down_a_floor() -> None:
    modules = _modules()
    units = {_unit(name) for name, _ in modules}
    assert units == set(FLOORS), f"FLOORS must name every folder and top-level module: add {sorted(units - set(FLOORS))}, drop {sorted(set(FLOORS) - units)}"
    offenders = _floor_offenders(_unit_arrows(modules), FLOORS)
    assert not offenders, "Imports that run sideways or back up a floor (tests/unit/test_layout.py FLOORS): " + "; ".join(offenders)
    circles = _circles_inside_folders(modules)
    assert not circles, f"Modules of one folder that import each other in a circle: {circles}; move what both need into a module of its own"


def test_the_floor_rule_catches_a_back_up_arrow_and_a_circle() -> None:
    modules = [("dp/replicas.py", ast.parse("from lightning_pipetransformer.strategy import PipeTransformerStrategy")),
               ("strategy.py", ast.parse("from lightning_pipetransformer.dp import replicas")),
               ("pipe/partition.py", ast.parse("from lightning_pipetransformer.pipe import planner\nimport torch"))]  # fmt: skip
    offenders = _floor_offenders(_unit_arrows(modules), FLOORS)
    assert offenders == ["dp/replicas.py:1: dp (floor 3) imports strategy (floor 6)"]  # the circle's upward half; same-folder imports pass
    sideways = _floor_offenders(_unit_arrows([("pipe/x.py", ast.parse("from lightning_pipetransformer.freeze import rules"))]), FLOORS)
    assert sideways == ["pipe/x.py:1: pipe (floor 2) imports freeze (floor 2)"]
    # A relative import, and a name from the package's face (which imports the strategy), are found too.
    relative = _unit_arrows([("dp/x.py", ast.parse("from ..engine import Engine\nfrom lightning_pipetransformer import AutoFreeze"))])
    assert _floor_offenders(relative, FLOORS) == ["dp/x.py:1: dp (floor 3) imports engine (floor 5)", "dp/x.py:2: dp (floor 3) imports __init__ (floor 7)"]
    # A circle inside one folder (the cache's, before issue 26).
    inside = [("cache/autocache.py", ast.parse("from lightning_pipetransformer.cache.cached_stack import CachedStack")),
              ("cache/cached_stack.py", ast.parse("from .autocache import AutoCache")),
              ("cache/keys.py", ast.parse("from lightning_pipetransformer.cache import store"))]  # fmt: skip
    assert _circles_inside_folders(inside) == [["cache/autocache.py", "cache/cached_stack.py", "cache/autocache.py"]]


# ----------------------------------------------------------------------------- calls an import check cannot see

#: Modules that still ask the strategy for a name by string, each with its reason; the list may only
#: shrink (the test below fails for an entry that no longer does it).
STRING_DISPATCH_ALLOWED = {
    "timeline/callback.py": "reads the pipeline strategy's plan and cache_stats where present; not yet behind a protocol of freeze/seam.py's kind",
}


def _strategy_members() -> set[str]:
    """The public names PipeTransformerStrategy defines itself (strategy.py) or in its base class (processes.py)."""
    names = set()
    for name, tree in _modules():
        if name in ("strategy.py", "processes.py"):
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                names |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}
    return names


def _string_dispatch(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each ``getattr(<...strategy>, "name")`` / ``hasattr(...)`` naming one of ``names``,
    also through a module-level constant (``HOOK = "on_freeze_point"``)."""
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        key = node.args[1]
        attr = key.value if isinstance(key, ast.Constant) else constants.get(key.id) if isinstance(key, ast.Name) else None
        if attr in names and ast.unparse(node.args[0]).lower().endswith("strategy"):
            found.append((node.lineno, attr))
    return found


def test_no_part_below_the_strategy_calls_it_by_a_string():
    """``getattr(trainer.strategy, "on_freeze_point")`` is a call up to floor 6 that the import check
    cannot see: a part below the strategy reaches it through a protocol it owns (freeze/seam.py)."""
    names = _strategy_members()
    assert {"on_freeze_point", "autofreeze_decides_here", "plan"} <= names, "the strategy's members were not found"
    offenders, allowed_used = [], set()
    for name, tree in _modules():
        if FLOORS[_unit(name)] >= FLOORS["strategy"]:
            continue
        for line, attr in _string_dispatch(tree, names):
            if name in STRING_DISPATCH_ALLOWED:
                allowed_used.add(name)
            else:
                offenders.append(f"{name}:{line} asks the strategy for {attr!r} by name")
    assert not offenders, "; ".join(offenders) + ". Declare what you call in a Protocol on your own floor (see freeze/seam.py)."
    assert allowed_used == set(STRING_DISPATCH_ALLOWED), f"no longer needed in STRING_DISPATCH_ALLOWED: {set(STRING_DISPATCH_ALLOWED) - allowed_used}"


def test_the_string_dispatch_rule_catches_a_call_up():
    sample = ast.parse('HOOK = "on_freeze_point"\ndef f(trainer, strategy):\n    hook = getattr(trainer.strategy, HOOK, None)\n'
                       '    return getattr(strategy, "autofreeze_decides_here", True), hasattr(x, "plan"), getattr(strategy, "model")\n')
    assert _string_dispatch(sample, _strategy_members()) == [(3, "on_freeze_point"), (4, "autofreeze_decides_here")]


def _protocol_members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(vars(protocol).get("__annotations__", {}))


def _attributes_read_on(tree: ast.Module, variable: str) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == variable}


def _same_parameters(protocol: type, implementation: type, name: str) -> bool:
    import inspect

    declared, actual = inspect.getattr_static(protocol, name), inspect.getattr_static(implementation, name)
    if isinstance(declared, property) or isinstance(actual, property):
        return isinstance(declared, property) == isinstance(actual, property)
    return list(inspect.signature(declared).parameters) == list(inspect.signature(actual).parameters)


def test_the_seam_between_autofreeze_and_the_strategy_is_declared_and_implemented():
    """What each side calls on the other is declared in freeze/seam.py and implemented, with the
    same parameters, by the other side; a call outside the protocol fails here."""
    from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
    from lightning_pipetransformer.freeze.seam import FreezeFollower, FreezeSource

    trees = dict(_modules())
    follower = _protocol_members(FreezeFollower)
    assert follower == {"on_freeze_point", "autofreeze_decides_here"}
    called = _attributes_read_on(trees["freeze/callback.py"], "follower")
    assert called and called <= follower, f"the callback calls {sorted(called - follower)} on the strategy outside FreezeFollower"
    assert all(_same_parameters(FreezeFollower, PipeTransformerStrategy, n) for n in follower)
    assert isinstance(PipeTransformerStrategy(), FreezeFollower)

    source = _protocol_members(FreezeSource)
    for module in ("strategy.py", "coordinator.py", "dp/state_transfer.py"):
        read = _attributes_read_on(trees[module], "autofreeze")
        assert read and read <= source, f"{module} reads {sorted(read - source)} of AutoFreeze outside FreezeSource"
    assert all(hasattr(AutoFreeze, n) or n in ("stack", "num_frozen", "freeze_embeddings") for n in source)
    assert all(_same_parameters(FreezeSource, AutoFreeze, n) for n in source if callable(vars(FreezeSource).get(n)))
    assert isinstance(AutoFreeze(), FreezeSource)
