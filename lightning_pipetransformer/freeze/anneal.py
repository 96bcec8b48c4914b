"""Smooth freezing (FreezeOut, Brock et al. 2017): anneal the blocks' learning rate to zero before they freeze.

Without it, a block trains at the scheduled learning rate up to its freeze point and then stops
at once. FreezeOut anneals each layer's learning rate to zero over the time before it freezes, so
the freeze itself changes nothing: a block whose rate has reached zero has already stopped.

How the rate is annealed here: the optimizer's *update* of each annealed parameter is scaled after
its step, ``p <- p_before + f (p_after - p_before)``, with ``f`` in [0, 1] from the annealing curve
(:func:`anneal_curve`). For every torch optimizer whose step is ``lr`` times a direction computed
from lr-independent state, that equals running those parameters at ``f * lr``:

* SGD, with momentum, Nesterov and weight decay: ``buf = mu buf + g + wd p`` does not see ``lr``;
  ``p -= lr buf``.
* Adam / AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta: the moments do not see ``lr``;
  AdamW's decoupled decay ``p *= 1 - lr wd`` is part of the update and is scaled with it.

It is *not* the same for optimizers whose state depends on ``lr`` (Rprop's step sizes, ASGD's
averages, LBFGS's line search, learning-rate-free optimizers such as D-Adaptation or Prodigy): for
them the update is still annealed to zero, which is what a freeze needs, but it is not ``f * lr``.

Why scale the update instead of the learning rate: no parameter-group surgery. The user's
optimizer and learning-rate schedulers stay untouched (a scheduler keeps writing its group's lr;
the annealing multiplies on top of whatever it wrote, per param group or OneCycleLR alike), and
checkpoints keep their layout (nothing here is in the optimizer's state). The cost is one copy of
the annealed parameters per optimizer step while an interval anneals, and nothing otherwise.

The scaling runs in the optimizer's own step hooks (``register_step_pre_hook`` /
``register_step_post_hook``), so it acts on real optimizer steps only: once per gradient
accumulation window, not at all for a step AMP's scaler skips (an unfused optimizer's step is not
called; a fused one is called and changes nothing, and scaling no change is no change). Parameters
with ``grad=None`` are skipped by the optimizer, so they do not move either way. Parameters may
sit on several devices (the pipeline's stages): each copy stays on its parameter's device.

This module is pure torch (no Lightning): :mod:`lightning_pipetransformer.freeze.anneal_timing`
chooses the plans from AutoFreeze's freeze points, this module carries them out.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_pipetransformer.freeze.apply import frozen_parameters
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["AnnealPlan", "Annealer", "AnnealSpec", "anneal_curve", "annealed_parameters"]

#: ``"linear"``, ``"cosine"``, or a callable ``progress in [0, 1) -> factor in [0, 1]``.
AnnealSpec = Literal["linear", "cosine"] | Callable[[float], float]


def _linear(t: float) -> float:
    return 1.0 - t


def _cosine(t: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * t))


def anneal_curve(spec: AnnealSpec) -> Callable[[float], float]:
    """The curve for ``spec``: ``"linear"`` (``1 - t``), ``"cosine"`` (FreezeOut's ``(1 + cos(pi t)) / 2``),
    or a callable. Both named curves start at 1 (the first step of an interval runs at the full rate)
    and reach 0 at ``t = 1``, the freeze point. Raises ``ValueError`` for anything else."""
    if spec == "linear":
        return _linear
    if spec == "cosine":
        return _cosine
    if callable(spec) and not isinstance(spec, str):
        for t in (0.0, 0.5, 0.99):  # a curve outside [0, 1] would grow or reverse updates: refused now, not mid-run
            value = spec(t)
            if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"anneal: the curve returned {value!r} at progress {t}; it must return a number in [0, 1].")
        return spec
    raise ValueError(
        f"anneal must be None, 'linear', 'cosine' or a callable progress -> factor in [0, 1], got {spec!r}."
    )


@dataclass(frozen=True)
class AnnealPlan:
    """Blocks ``source..target-1`` anneal over the optimizer steps ``start..end-1`` and freeze before step ``end``.

    Steps are global optimizer steps (Lightning's ``global_step`` before the step runs). The factor at
    step ``s`` is ``curve((s - start) / (end - start))`` inside the interval, 1 before it and 0 from
    ``end`` on (if the freeze is late, the blocks still do not move).
    """

    source: int
    target: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.source < self.target:
            raise ValueError(f"An anneal plan needs 0 <= source < target, got {self.source}..{self.target}.")
        if self.end <= self.start:
            raise ValueError(f"An anneal plan needs start < end, got steps {self.start}..{self.end}.")

    @property
    def steps(self) -> int:
        return self.end - self.start


def annealed_parameters(
    stack: BlockStack, source: int, target: int, include_pre: bool, pre_frozen: bool | None = None
) -> list[nn.Parameter]:
    """The parameters that freezing ``target`` blocks covers and the ``source`` frozen ones do not.

    ``include_pre``: the freeze takes the modules before the stack (the embeddings) with it, as
    ``freeze_embeddings``. ``pre_frozen``: whether they are frozen already (default: with any frozen
    block, ``include_pre and source > 0``; False for blocks that were frozen before fit while the
    embeddings still train: then they anneal with the next freeze)."""
    if pre_frozen is None:
        pre_frozen = include_pre and source > 0
    already = {id(p) for p in frozen_parameters(stack, source, False)}
    if pre_frozen and source > 0:
        already |= {id(p) for p in frozen_parameters(stack, source, True)}
    out, seen = [], set(already)
    for p in frozen_parameters(stack, target, include_pre):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class Annealer:
    """Scale the optimizer's updates of the blocks about to freeze, by a curve over the interval before the freeze.

    Usage (what :class:`~lightning_pipetransformer.freeze.anneal_timing.AnnealTiming` does)::

        annealer = Annealer("cosine")
        annealer.bind(stack, include_pre=True)
        annealer.begin(AnnealPlan(source=0, target=2, start=0, end=24))
        for step in range(...):
            annealer.at_step(step, [optimizer])   # before each optimizer step: which step comes, hooks attached
            ...backward...; optimizer.step()

    Args:
        spec: the curve (:func:`anneal_curve`).
    """

    def __init__(self, spec: AnnealSpec) -> None:
        self.curve = anneal_curve(spec)
        self.spec = spec
        self.plan: AnnealPlan | None = None
        self._step = 0
        self._stack: BlockStack | None = None
        self._include_pre = True
        self._pre_frozen: bool | None = None
        self._handles: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, Any]] = weakref.WeakKeyDictionary()
        # Per optimizer, between its pre- and post-step hook: (factor, parameters, their values before the step).
        self._saved: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[float, list[torch.Tensor], list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ the plan

    def bind(self, stack: BlockStack, include_pre: bool, pre_frozen: bool | None = None) -> None:
        """The stack whose blocks the plans name (the parameters are looked up at every step, so a
        block moved between devices or modules re-wrapped is still found); ``include_pre`` and
        ``pre_frozen`` as in :func:`annealed_parameters`."""
        self._stack, self._include_pre, self._pre_frozen = stack, include_pre, pre_frozen

    def begin(self, plan: AnnealPlan) -> bool:
        """Start annealing ``plan``; False (and nothing changes) if the same blocks already anneal,
        so that a hook called again for the same point (a resumed epoch start) keeps the restored plan."""
        if self.plan is not None and (self.plan.source, self.plan.target) == (plan.source, plan.target):
            return False
        self.plan = plan
        return True

    def clear(self) -> None:
        self.plan = None

    def factor(self, step: int) -> float:
        """The factor on the annealed parameters' update at optimizer step ``step``."""
        plan = self.plan
        if plan is None or step < plan.start:
            return 1.0
        if step >= plan.end:
            return 0.0
        value = float(self.curve((step - plan.start) / plan.steps))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"The anneal curve returned {value} at progress {(step - plan.start) / plan.steps:.3f}; it must be in [0, 1].")
        return value

    def parameters(self) -> list[nn.Parameter]:
        """The parameters the current plan anneals (none without a plan or a bound stack)."""
        if self.plan is None or self._stack is None:
            return []
        return annealed_parameters(self._stack, self.plan.source, self.plan.target, self._include_pre, self._pre_frozen)

    # ------------------------------------------------------------------ the optimizer's step hooks

    def at_step(self, step: int, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Before an optimizer step: the global index of the step that comes next, and the hooks on
        every optimizer (attached once each; an optimizer built later is attached when it shows up)."""
        self._step = int(step)
        for optimizer in optimizers:
            self.attach(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._handles:
            return
        self._handles[optimizer] = (
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        )

    def detach(self) -> None:
        """Remove the hooks from every optimizer (the end of a fit)."""
        for pre, post in list(self._handles.values()):
            pre.remove()
            post.remove()
        self._handles = weakref.WeakKeyDictionary()
        self._saved = weakref.WeakKeyDictionary()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._saved.pop(optimizer, None)
        f = self.factor(self._step)
        if f >= 1.0:
            return  # the full rate: the update stays as the optimizer makes it, and nothing is copied
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = [p.detach() for p in self.parameters() if id(p) in owned]
        if not params:
            return
        with torch.no_grad():
            before = [p.clone() for p in params]  # on each parameter's own device
        self._saved[optimizer] = (f, params, before)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved.pop(optimizer, None)
        if saved is None:
            return
        f, params, before = saved
        with torch.no_grad():
            for group in _by_device_and_dtype(params, before):
                after, start = group
                torch._foreach_lerp_(start, after, f)  # start + f (after - start)
                torch._foreach_copy_(after, start)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"plan": asdict(self.plan) if self.plan is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        plan = (state or {}).get("plan")
        self.plan = AnnealPlan(**{k: int(v) for k, v in plan.items()}) if plan else None


def _by_device_and_dtype(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Pairs grouped by (device, dtype): a foreach call takes tensors of one device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, b in zip(params, before):
        a, s = groups.setdefault((p.device, p.dtype), ([], []))
        a.append(p)
        s.append(b)
    return list(groups.values())
