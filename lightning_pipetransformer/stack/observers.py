"""Who observes the blocks: module hooks that must see each block once per pass, with the whole batch.

A pipeline calls each block once per micro-batch, the first pass also runs the blocks once as a
probe, and a cache does not run the frozen blocks at all: a hook on a block (or on a module
inside one) would fire a different number of times, with parts of the batch, or not at all.
Hugging Face models record per-layer outputs this way (``output_hidden_states``,
``output_attentions``, ``output_router_logits``: transformers' ``OutputRecorder`` hooks, appended
to a list per call), and so do users' own hooks and global module hooks. So every hook that can
fire inside the blocks is an *observer*, unless

- it is inactive now: a transformers recorder whose key is not being collected in this forward;
- it is this package's own (its code lives in ``lightning_pipetransformer``);
- it was marked with :func:`sees_block_runs`: it wants every real block run (micro-batches
  included), e.g. to count them;
- it only marks an output as requiring grad (transformers' ``enable_input_require_grads()``, which
  gradient checkpointing and PEFT install on the input embeddings): it reads no value.

A pass with observers runs each block exactly once on the whole batch (the pipeline as one
micro-batch, the cache standing aside), so they see what the plain loop shows them; the probe
and the self-check's reference run happen with them :func:`silenced`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn
from torch.nn.modules import module as torch_module

__all__ = [
    "BlockHooks", "Observer", "block_modules", "find_observers", "keeps_values", "replacing_hooks", "sees_block_runs", "silenced",
]

_MARK = "_pipetransformer_sees_block_runs"
_OWN_PACKAGE = "lightning_pipetransformer"
#: The hook dictionaries of a module that fire when it runs (forward) or its gradient flows (backward).
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")

Hook = TypeVar("Hook", bound=Callable[..., Any])


def sees_block_runs(hook: Hook) -> Hook:
    """Mark ``hook`` as one that wants every real run of a block (each micro-batch, the probe).

    Such a hook does not make a pass run as one micro-batch or keep the cache aside. Use it for
    hooks that count or time block runs; a hook that records outputs should stay unmarked, so
    that it sees each block once per pass with the whole batch. Returns ``hook``.
    """
    try:
        setattr(hook, _MARK, True)
    except AttributeError:  # a bound method: mark its function
        setattr(hook.__func__, _MARK, True)  # type: ignore[attr-defined]
    return hook


@dataclass(frozen=True)
class Observer:
    """One hook that observes the blocks: where it is and what it is, in words."""

    #: The module it is registered on (``None``: a global module hook).
    module: nn.Module | None = field(repr=False, compare=False)
    #: Where it sits in the stack (``"block 3 (attn)"``), or ``"every module"`` for a global hook.
    where: str
    #: Its kind (``forward hook``, ``forward pre-hook``, ...), and the hook's own name.
    kind: str
    name: str

    def describe(self) -> str:
        return f"the {self.kind} {self.name} on {self.where}"


def _hook_name(hook: Any) -> str:
    func = getattr(hook, "__func__", hook)
    return getattr(func, "__qualname__", None) or type(hook).__name__


def _is_own(hook: Any) -> bool:
    func = getattr(hook, "__func__", hook)
    owner = getattr(hook, "__self__", None)
    modules = (getattr(func, "__module__", None) or "", type(owner).__module__ if owner is not None else "")
    return any(m == _OWN_PACKAGE or m.startswith(_OWN_PACKAGE + ".") for m in modules)


def _transformers_recorder_active(hook: Any) -> bool | None:
    """For a transformers output recorder: whether its key is collected in this forward; else ``None``."""
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != "output_capturing_hook" or not getattr(hook, "__module__", "").startswith("transformers."):
        return None
    cells = dict(zip(code.co_freevars, hook.__closure__ or ()))
    key = cells["key"].cell_contents if "key" in cells else None
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - a transformers without recorders has none of these hooks
        return True
    collected = _active_collector.get()
    return bool(collected) and (key is None or key in collected)


#: Hooks that only mark an output as requiring grad (``enable_input_require_grads()`` of transformers, used by
#: gradient checkpointing and PEFT): they read no value, and the cache's placeholder is marked the same way.
_MARKERS = {("transformers.", "make_inputs_require_grads"), ("peft.", "make_inputs_require_grad")}


def _only_marks_input_grad(hook: Any) -> bool:
    code = getattr(hook, "__code__", None)
    module = getattr(hook, "__module__", None) or ""
    return code is not None and any(module.startswith(package) and code.co_name == name for package, name in _MARKERS)


def keeps_values(hook: Any) -> bool:
    """Whether ``hook`` leaves what its module computes alone, by construction or by contract: this
    package's own, one marked with :func:`sees_block_runs`, or one that only marks an output as requiring grad."""
    return bool(getattr(getattr(hook, "__func__", hook), _MARK, False)) or _is_own(hook) or _only_marks_input_grad(hook)


def _observes(hook: Any) -> bool:
    if keeps_values(hook):
        return False
    active = _transformers_recorder_active(hook)
    return True if active is None else active


_KINDS = {
    "_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook",
}  # fmt: skip


def find_observers(named_modules: Iterable[tuple[str, nn.Module]]) -> list[Observer]:
    """The hooks that observe these modules now (every module inside the blocks), global ones first."""
    found = [
        Observer(None, "every module", f"global {_KINDS[name.replace('_global', '')]}", _hook_name(hook))
        for name in _GLOBAL_HOOKS
        if (hooks := getattr(torch_module, name))
        for hook in hooks.values()
        if _observes(hook)
    ]
    for where, module in named_modules:
        own = module.__dict__
        # The common case, a module without hooks, costs four dictionary reads (this runs every pass).
        if not (own.get("_forward_hooks") or own.get("_forward_pre_hooks") or own.get("_backward_hooks") or own.get("_backward_pre_hooks")):
            continue
        for attr in _MODULE_HOOKS:
            hooks = own.get(attr)
            if hooks:
                found.extend(Observer(module, where, _KINDS[attr], _hook_name(h)) for h in hooks.values() if _observes(h))
    return found


class BlockHooks:
    """The hook dictionaries of every module inside some blocks, gathered once: :meth:`observers` runs every pass.

    A module's hook dictionaries are the same objects for its whole life (registering a hook adds
    to them), so the per-pass cost is one truthiness test per dictionary.
    """

    def __init__(self, named_modules: Iterable[tuple[str, nn.Module]]) -> None:
        self._named = list(named_modules)
        self._dicts = [
            (index, hooks) for index, (_, module) in enumerate(self._named) for attr in _MODULE_HOOKS
            if isinstance(hooks := module.__dict__.get(attr), dict)
        ]  # fmt: skip
        self._globals = [getattr(torch_module, name) for name in _GLOBAL_HOOKS]

    def observers(self) -> list[Observer]:
        if not any(self._globals) and not any(hooks for _, hooks in self._dicts):
            return []
        return find_observers(self._named)


def block_modules(blocks: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every module inside ``blocks``, named ``"<block index>.<path>"`` (what :func:`find_observers` takes)."""
    return [(f"block {i}" + (f" ({name})" if name else ""), m) for i, block in enumerate(blocks) for name, m in block.named_modules()]


@contextmanager
def silenced(modules: Iterable[nn.Module], every: bool = False) -> Iterator[None]:
    """Inside, the observing hooks of ``modules`` and the global ones do not fire (the others do).

    For block runs that are not the pass the model asked for: the first pass's probe (which hooks
    marked with :func:`sees_block_runs` still see), the self-check's reference run (``every``: no
    hook but this package's own fires). The hooks are back, in their order, on exit.
    """
    silent = (lambda h: not _is_own(h)) if every else _observes
    saved: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    dicts = [getattr(torch_module, name) for name in _GLOBAL_HOOKS]
    dicts += [d for m in modules for attr in _MODULE_HOOKS if (d := m.__dict__.get(attr))]
    seen: set[int] = set()
    for hooks in dicts:
        if id(hooks) in seen or not any(silent(h) for h in hooks.values()):
            continue
        seen.add(id(hooks))
        saved.append((hooks, dict(hooks)))
        for key in [k for k, h in hooks.items() if silent(h)]:
            del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            added = {k: h for k, h in hooks.items() if k not in before}  # registered inside: kept, after
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


_REPLACING = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook"}


@contextmanager
def replacing_hooks(named_modules: Iterable[tuple[str, nn.Module]]) -> Iterator[list[str]]:
    """Inside, the forward hooks and pre-hooks of these modules and the global ones (but this package's
    own) note, in the list yielded, when they return a value: the module then gets or gives what the
    hook returned. A run with the hooks :func:`silenced` (the self-check's reference) lacks that
    effect, so its values say nothing about a pass in which one did. The hooks are back on exit.
    """
    found: list[str] = []
    swapped: list[tuple[dict[Any, Any], Any, Any, Any]] = []

    def noting(hook: Any, describe: str) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            result = hook(*args, **kwargs)
            if result is not None and describe not in found:
                found.append(describe)
            return result

        return noted

    places = [(getattr(torch_module, f"_global{attr}"), f"global {kind}", "every module") for attr, kind in _REPLACING.items()]
    places += [(hooks, kind, where) for where, m in named_modules for attr, kind in _REPLACING.items() if (hooks := m.__dict__.get(attr))]
    for hooks, kind, where in places:
        for key, hook in list(hooks.items()):
            if not _is_own(hook):
                wrapper = noting(hook, f"the {kind} {_hook_name(hook)} on {where}")
                hooks[key] = wrapper
                swapped.append((hooks, key, hook, wrapper))
    try:
        yield found
    finally:
        for hooks, key, hook, wrapper in swapped:
            if hooks.get(key) is wrapper:
                hooks[key] = hook
