"""Per-block costs for AutoPipe: parameter counts, profiled times and activation memory.

The paper balances partitions by parameter size, a proxy that needs no device; when asked, the
blocks can instead be profiled on the real device (forward+backward time, activation memory).
Either way a frozen block weighs ``frozen_cost`` times an active one (paper: 1/6), because it
runs forward only and keeps no gradients, optimizer state or saved activations.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: the planner uses this module without it.
    import torch
    from torch import Tensor, nn

__all__ = ["parameter_costs", "parameter_count", "weighted_costs", "BlockProfile", "profile_blocks"]

Costs = tuple[float, ...]
OutputFn = Callable[[Any], "Tensor"]


def parameter_count(module: nn.Module) -> int:
    """Number of parameters of ``module``, trainable or not (a tied weight counts once)."""
    return sum(p.numel() for p in module.parameters())


def parameter_costs(blocks: Iterable[nn.Module]) -> Costs:
    """The paper's cost proxy: the parameter count of each block, as floats."""
    return tuple(float(parameter_count(block)) for block in blocks)


def weighted_costs(costs: Sequence[float], num_frozen: int, frozen_cost: float) -> Costs:
    """``costs`` with the ``num_frozen`` leading blocks scaled by ``frozen_cost``.

    Raises:
        ValueError: ``num_frozen`` is not in ``0..len(costs)`` or ``frozen_cost`` not in [0, 1].
    """
    if not 0 <= num_frozen <= len(costs):
        raise ValueError(f"num_frozen must be in 0..{len(costs)} (the number of blocks), got {num_frozen}.")
    if not 0.0 <= frozen_cost <= 1.0:
        raise ValueError(
            f"frozen_cost must be in [0, 1] (a frozen block never costs more than an active one), "
            f"got {frozen_cost}."
        )
    return tuple(float(c) * (frozen_cost if i < num_frozen else 1.0) for i, c in enumerate(costs))


@dataclass(frozen=True)
class BlockProfile:
    """What :func:`profile_blocks` measured, one entry per block.

    ``activation_bytes`` is, on CUDA, the rise of the allocator's peak during the forward pass
    (saved activations plus the output); elsewhere it is the bytes of the tensors autograd
    saves for backward, parameters excluded (CPU has no allocator statistics).
    """

    forward_s: tuple[float, ...]
    forward_backward_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    device: str

    @property
    def frozen_cost(self) -> float:
        """Measured time of a frozen block relative to an active one (forward / forward+backward)."""
        total = sum(self.forward_backward_s)
        return min(1.0, sum(self.forward_s) / total) if total > 0 else 1.0


def profile_blocks(
    blocks: Sequence[nn.Module],
    sample: Tensor,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    output_fn: OutputFn | None = None,
) -> BlockProfile:
    """Time and measure each block on ``device``, feeding each the previous block's output.

    ``sample`` is the hidden state entering the first block (batch first); ``args``/``kwargs``
    are passed to every block (e.g. an attention mask). Blocks are deep-copied onto the device
    (a sandbox, as in torchgpipe), so the caller's model is neither moved nor given gradients.
    Times are medians over ``repeats`` runs after ``warmup`` runs. ``output_fn`` maps a block's
    output to the next hidden state; by default a tensor passes through and the first element of
    a tuple/list is taken.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    import torch

    dev = torch.device(device) if device is not None else sample.device
    cuda = dev.type == "cuda"
    pick = output_fn or _first_tensor
    args = tuple(_to(a, dev) for a in args)
    kwargs = {k: _to(v, dev) for k, v in (kwargs or {}).items()}
    x = sample.detach().to(dev)

    fwd: list[float] = []
    fwd_bwd: list[float] = []
    act: list[int] = []
    for block in blocks:
        # A sandbox copy with trainable parameters: we measure the *active* cost.
        sandbox = copy.deepcopy(block).to(dev)
        for p in sandbox.parameters():
            p.requires_grad_(True)
        param_ptrs = {p.untyped_storage().data_ptr() for p in sandbox.parameters()}

        def forward_only(sandbox: nn.Module = sandbox, x: Tensor = x) -> None:
            with torch.no_grad():
                pick(sandbox(x, *args, **kwargs))

        def forward_backward(sandbox: nn.Module = sandbox, x: Tensor = x) -> Tensor:
            inp = x.detach().requires_grad_(x.is_floating_point())
            out = pick(sandbox(inp, *args, **kwargs))
            # Backward with a ones gradient: no extra reduction op in the measured graph.
            torch.autograd.backward(out, grad_tensors=torch.ones_like(out))
            return out

        fwd.append(_median_time(forward_only, repeats, warmup, cuda))
        fwd_bwd.append(_median_time(forward_backward, repeats, warmup, cuda))
        out, nbytes = _activation_bytes(sandbox, x, args, kwargs, pick, param_ptrs, dev)
        act.append(nbytes)
        x = out.detach()
        del sandbox, forward_only, forward_backward
    return BlockProfile(tuple(fwd), tuple(fwd_bwd), tuple(act), str(dev))


def _first_tensor(output: Any) -> Tensor:
    from torch import Tensor

    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(
        f"Cannot find the hidden state in a block output of type {type(output).__name__}: "
        "pass output_fn= to profile_blocks to pick it."
    )


def _to(value: Any, device: torch.device) -> Any:
    from torch import Tensor

    return value.to(device) if isinstance(value, Tensor) else value


def _median_time(fn: Callable[[], object], repeats: int, warmup: int, cuda: bool) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        # Synchronise around the call on CUDA only: kernels are asynchronous there.
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _activation_bytes(
    block: nn.Module,
    x: Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    pick: OutputFn,
    param_ptrs: set[int],
    device: torch.device,
) -> tuple[Tensor, int]:
    """One forward with grad enabled; returns its output and the activation bytes it holds."""
    import torch

    inp = x.detach().requires_grad_(x.is_floating_point())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = pick(block(inp, *args, **kwargs))
        torch.cuda.synchronize(device)
        return out, max(0, torch.cuda.max_memory_allocated(device) - before)

    seen: set[int] = set()
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        # Count each storage once, and never the weights: they are not activations.
        if ptr not in seen and ptr not in param_ptrs:
            seen.add(ptr)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pick(block(inp, *args, **kwargs))
    return out, total
