"""The first training forward with kept entries: served before the call order is known, read-only, then confirmed.

What runs before the stack is read from the first training forward (stack/execution.py): until then ``pre`` is
discovery's provisional split (registration order), and a boundary opened before it waits (``Deferred``, unchecked).
Within one run that costs nothing, since nothing is stored yet. With entries kept by an earlier run (``cache_keep``)
the first step could be served, and a sweep's later runs should be: so in that forward the cache opens the
deferred boundary's store on the provisional prefix, **only if its folder already exists** (a folder is only ever
made by a store whose prefix was observed, so its name is the fingerprint of an observed prefix), and serves it
read-only: misses are computed, not stored, so nothing is written under a name that the observation may still prove
wrong. When the order is known (before the backward), the prefix is compared with the one the store opened on: the
same modules, and the store stays (misses stored from then on); others, and the store closes and the boundary opens
again, checked, at the next lookup.

It serves only where that forward is what a plain run computes (:func:`why_not`):

- nothing random runs in the prefix as it is now (the embeddings in train mode with dropout, before AutoFreeze puts
  them in eval mode after this forward: then the plain run's first step has that dropout, and so does this one);
- the stack's input needs no gradient, or only one into the modules before the stack that AutoFreeze freezes with
  the first block before this step's backward (it then drops their gradient: a parameter that no longer requires
  grad gets none). That promise is checked after the backward (:meth:`FirstForward.check_cut`).

The first batch with hits is still recomputed and compared (the first-hit check), as at every boundary's open.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_pipetransformer.cache.budget import CacheConfigError
from lightning_pipetransformer.cache.validity import stochastic_reasons

__all__ = ["FirstForward", "why_not"]

#: How many autograd nodes the walk from the stack's input to its parameters visits at most (the embeddings: tens).
_MAX_NODES = 4096


def input_leaves(hidden: Tensor) -> list[Tensor] | None:
    """The tensors the gradient of ``hidden`` would reach (parameters), or ``None`` when the walk is too long to tell."""
    if not hidden.requires_grad:
        return []
    if hidden.grad_fn is None:
        return [hidden]
    todo, seen, leaves = [hidden.grad_fn], set(), []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= _MAX_NODES:
            return None
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.append(variable)
        todo.extend(n for n, _ in node.next_functions)
    return leaves


def why_not(
    modules: Sequence[tuple[str, nn.Module]], loose: Sequence[tuple[str, Tensor]], leaves: list[Tensor] | None,
    pre_freezes: bool,
) -> str | None:
    """Why the first forward cannot be served from kept entries (``None``: it can).

    ``modules``/``loose``: the provisional prefix and the loose parameters before the stack; ``leaves``: what the
    stack input's gradient reaches (:func:`input_leaves`); ``pre_freezes``: AutoFreeze freezes the modules before the
    stack with the first block, before this step's backward.
    """
    random = stochastic_reasons(modules)
    if random:
        return f"{random[0]} until the call order is known, as in a run without the cache"
    if leaves is None:
        return "the stack's input comes from a graph too long to check for trainable parameters"
    if not leaves:
        return None
    owned = {id(p) for _, m in modules for p in m.parameters()} | {id(t) for _, t in loose}
    outside = [t for t in leaves if id(t) not in owned]
    if outside:
        return "the stack's input needs a gradient into a parameter outside the frozen prefix"
    if not pre_freezes:
        return "the modules before the stack still train (nothing freezes them before this step's backward)"
    return None


@dataclass
class FirstForward:
    """The store opened early on the provisional prefix, until the call order confirms or refutes it."""

    #: Ids of the prefix modules the store opened on (``None``: no store opened early, or confirmed since).
    opened_on: frozenset[int] | None = None
    #: Whether the early store is still read-only (the order is not known yet).
    read_only: bool = False
    #: Parameters whose gradient the served rows cut: they must no longer require grad at the backward.
    cut: list[tuple[str, Tensor]] = field(default_factory=list)
    #: Whether a kept folder was looked for in this fit (once: a second forward before the order is known
    #: would pay the fingerprint again for nothing).
    tried: bool = False

    def opened(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.opened_on = frozenset(id(m) for _, m in modules)
        self.read_only = True

    def confirm(self, modules: Sequence[tuple[str, nn.Module]]) -> bool | None:
        """The call order is known: whether the prefix is the one the store opened on (``None``: none opened early)."""
        if self.opened_on is None:
            return None
        same = self.opened_on == frozenset(id(m) for _, m in modules)
        self.opened_on, self.read_only = None, False
        return same

    def note_cut(self, names: dict[int, str], leaves: Sequence[Tensor]) -> None:
        known = {id(t) for _, t in self.cut}
        self.cut += [(names.get(id(t), "a parameter before the stack"), t) for t in leaves if id(t) not in known]

    def check_cut(self) -> None:
        """After the first step's backward: every parameter whose gradient the served rows cut must be frozen by now
        (AutoFreeze froze the modules before the stack), so that the plain run gave it no gradient either."""
        cut, self.cut = self.cut, []
        trains = [name for name, t in cut if t.requires_grad]
        if trains:
            raise CacheConfigError(
                f"AutoCache served the first training step from kept entries on the condition that the modules before "
                f"the stack freeze before its backward (AutoFreeze freezes them with the first block), but "
                f"{', '.join(trains[:3])} still require(s) grad: that step left out a gradient a run without the cache "
                "computes. Please report this; to go on, use cache_keep=False (the first step then computes the prefix)."
            )
