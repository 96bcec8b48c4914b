"""Gradient statistics of a block stack, summed over the optimizer steps of a freeze interval.

A freeze rule decides from what the active blocks' gradients did since the last freeze point. The
sums stay on the device and a step is added without a host sync: the host reads them once, at the
decision. A step whose gradients are not finite (AMP's scaler skips it) adds nothing, decided on
the device too, so that an overflow neither counts as a tiny norm nor ends the run.

Three statistics, one per measuring rule (:mod:`lightning_pipetransformer.freeze.policies`):

* :class:`NormSums`: each active block's gradient L2 norm, summed, and the finite steps counted
  (the ``"paper"`` rule reads their mean);
* :class:`GradientSums`: each active block's gradient tensors, summed (the ``"autofreeze"`` rule
  reads the L1 norm of each block's sum). A copy of the active blocks' size.
* :class:`Displacement`: the active blocks' weights as they were at the first step (the
  ``"plasticity"`` rule reads how far each block moved from them). A copy of the active blocks' size,
  taken once; nothing is added per step, and the copy of a block is dropped once it freezes.

Pure torch: the callback calls :meth:`observe` from ``on_before_optimizer_step``, where the
gradients are final (after DDP's averaging and accumulation, unscaled under AMP); a test calls it
with gradients set by hand.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["Displacement", "GradientSums", "NormSums", "block_grad_norms"]


def block_grad_norms(stack: BlockStack, num_frozen: int) -> torch.Tensor | None:
    """Per block, the L2 norm of its gradients (0 for the ``num_frozen`` frozen ones and for blocks
    without a gradient), on the device of the last block; None when the last block has no gradient."""
    blocks = stack.blocks
    device = next((p.grad.device for p in blocks[-1].parameters() if p.grad is not None), None)
    if device is None:
        return None
    norms = []
    for index, block in enumerate(blocks):
        grads = [p.grad for p in block.parameters() if p.grad is not None] if index >= num_frozen else []
        if not grads:
            norms.append(torch.zeros((), device=device))
            continue
        per_tensor = torch._foreach_norm(grads, dtype=torch.float32)  # in fp16 a finite gradient's L2 norm can overflow
        norms.append(torch.linalg.vector_norm(torch.stack(per_tensor)).to(device, non_blocking=True))
    return torch.stack(norms).float()


class NormSums:
    """Per block, the gradient norm summed over the interval's finite optimizer steps.

    State (checkpoint keys kept flat in the callback's state): ``norm_sum`` (the sums as a list,
    None before the first step) and ``norm_steps`` (finite steps summed).
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._steps: int | torch.Tensor = 0  # a device tensor while training: no host sync per step
        self._restored: list[float] | None = None  # restored sums, moved to the device at the next step

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        self.add(block_grad_norms(stack, num_frozen))

    def add(self, norms: torch.Tensor | None) -> None:
        """Add one step's per-block norms; a step with a non-finite norm adds nothing and is not counted."""
        if norms is None:
            return
        if self._sum is None:
            self._sum = torch.zeros_like(norms)
            if self._restored is not None:
                self._sum += torch.tensor(self._restored, dtype=norms.dtype, device=norms.device)
                self._restored = None
        finite = torch.isfinite(norms).all()
        self._sum += torch.where(finite, norms, torch.zeros_like(norms))
        self._steps = self._steps + finite.to(torch.int64)

    def mean(self) -> list[float] | None:
        """The mean norm per block over the finite steps; None when no finite step was summed."""
        steps = int(self._steps)
        if steps == 0:
            return None
        if self._sum is None:
            return None if self._restored is None else [v / steps for v in self._restored]
        return (self._sum / steps).tolist()

    def reset(self) -> None:
        self._sum, self._steps, self._restored = None, 0, None

    def state_dict(self) -> dict[str, Any]:
        sums = self._sum.tolist() if self._sum is not None else self._restored
        return {"norm_sum": sums, "norm_steps": int(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sum = None
        self._restored = state.get("norm_sum")
        self._steps = int(state.get("norm_steps", 0))


class GradientSums:
    """Per block, its gradient tensors summed over the interval's finite optimizer steps.

    State: ``grad_sums`` (per block, one CPU tensor per parameter; None before the first step).
    Sums restored from a checkpoint sit where it was loaded (callbacks load before the strategy
    moves the model): each follows its gradient's device at the next step.
    """

    def __init__(self) -> None:
        self.sums: list[list[torch.Tensor]] | None = None

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        """Add this step's gradients of the active blocks (index ``>= num_frozen``)."""
        if self.sums is None:
            self.sums = [[torch.zeros_like(p) for p in block.parameters()] for block in stack.blocks]
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for index, block in enumerate(stack.blocks):
            if index < num_frozen:
                continue
            sums = self.sums[index]
            for position, p in enumerate(block.parameters()):
                if p.grad is None:
                    continue
                if sums[position].device != p.grad.device:
                    sums[position] = sums[position].to(p.grad.device)
                by_device.setdefault(p.grad.device, []).append((sums[position], p.grad))
        if not by_device:
            return
        # One flag for the whole step, as the optimizer skips a step as a whole (pipeline stages may
        # sit on several devices: each checks its own gradients, the flags meet on one device).
        # The largest magnitude (ord=inf) cannot overflow in half precision as an L2 norm can, and keeps nan and inf.
        flags = [torch.isfinite(torch.stack(torch._foreach_norm([g for _, g in pairs], ord=math.inf))).all() for pairs in by_device.values()]
        finite = torch.stack([f.to(flags[0].device) for f in flags]).all()
        for device, pairs in by_device.items():
            ok = finite.to(device)
            torch._foreach_add_([s for s, _ in pairs], [torch.where(ok, g, 0.0) for _, g in pairs])

    def l1_norms(self, num_frozen: int) -> list[float] | None:
        """Per block, the L1 norm of its summed gradient (0 for the ``num_frozen`` frozen blocks:
        what a block gathered before it froze is not a change); None before the first step."""
        if self.sums is None:
            return None
        return [0.0 if index < num_frozen else float(sum(float(s.abs().sum()) for s in sums)) for index, sums in enumerate(self.sums)]

    def reset(self) -> None:
        self.sums = None

    def state_dict(self) -> dict[str, Any]:
        return {"grad_sums": [[t.detach().cpu() for t in block] for block in self.sums] if self.sums is not None else None}

    def load_state_dict(self, state: dict[str, Any], stack: BlockStack | None) -> None:
        sums = state.get("grad_sums")
        if sums is None or stack is None:
            self.sums = None
            return
        self.sums = [[t.to(p.device) for t, p in zip(block, module.parameters())] for block, module in zip(sums, stack.blocks)]


class Displacement:
    """Per block, how far its weights moved from where they were at the first optimizer step, relative
    to their size: ``||w - w(0)|| / ||w(0)||`` (the ``"plasticity"`` rule).

    :meth:`observe` copies the active blocks' parameters once, at the first step (before its update:
    the weights fine-tuning starts from), and afterwards only drops the copies of blocks that froze; no
    work per step. :meth:`relative` computes every block's displacement on the device and reads them in
    one transfer, at a decision. State: ``plasticity_reference`` (per block, one CPU tensor per
    parameter, or None for a block frozen before the copy or since). Copies restored from a checkpoint
    follow their parameter's device at the next read.
    """

    def __init__(self) -> None:
        self.reference: list[list[torch.Tensor] | None] | None = None

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        """At an optimizer step: copy the active blocks at the first one; later, drop frozen blocks' copies."""
        if self.reference is None:
            self.reference = [
                None if index < num_frozen else [p.detach().clone() for p in block.parameters()]
                for index, block in enumerate(stack.blocks)
            ]
            return
        for index in range(min(num_frozen, len(self.reference))):
            self.reference[index] = None

    def relative(self, stack: BlockStack, num_frozen: int) -> list[float] | None:
        """Per block, ``||w - w(0)|| / ||w(0)||`` (0 for the ``num_frozen`` frozen blocks and for blocks
        without a copy or without parameters); None before the first step."""
        if self.reference is None:
            return None
        moved: list[torch.Tensor] = []
        sizes: list[torch.Tensor] = []
        where: list[int] = []
        for index, (block, copy) in enumerate(zip(stack.blocks, self.reference)):
            params = [p.detach() for p in block.parameters()]
            if index < num_frozen or copy is None or not params:
                continue
            copy = [c if c.device == p.device else c.to(p.device) for c, p in zip(copy, params)]
            self.reference[index] = copy
            device = params[-1].device
            diff = torch._foreach_sub(params, copy)
            moved.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diff, dtype=torch.float32))).to(device))
            sizes.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(copy, dtype=torch.float32))).to(device))
            where.append(index)
        out = [0.0] * len(stack.blocks)
        if not where:
            return out
        home = moved[0].device
        values = torch.stack([torch.stack([m.to(home) for m in moved]), torch.stack([s.to(home) for s in sizes])]).tolist()
        for index, distance, size in zip(where, values[0], values[1]):
            out[index] = distance / size if size > 0 else 0.0
        return out

    def reset(self) -> None:
        self.reference = None

    def state_dict(self) -> dict[str, Any]:
        if self.reference is None:
            return {"plasticity_reference": None}
        return {"plasticity_reference": [None if c is None else [t.detach().cpu() for t in c] for c in self.reference]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = state.get("plasticity_reference")
