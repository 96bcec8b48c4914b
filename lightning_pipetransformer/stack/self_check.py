"""The first-batch self-check: what the runner gives the model equals what the plain loop gives it.

The pipeline and the cache replace the model's own loop over its blocks. Each way a model can
observe or reuse block outputs that they do not reproduce (per-layer outputs, hooks, router
losses, a hidden state whose first dimension is not the batch, ...) was found one case at a time.
This check makes the whole class loud: on the first training pass after a plan is put in force,
the runner runs the pass as usual, then the same blocks run as the plain loop would (one after
the other, the whole batch, under ``no_grad``, on copies of the pass's inputs, from the same
random state; buffers and random state are put back afterwards) and the two are compared:

- the output's structure (a tensor, a tuple and its plain values) and every tensor in it: shape,
  dtype, and values within a tolerance for the lowest precision the blocks computed at (the
  output's dtype, autocast's, TF32 or bf16 fp32 matmuls: :mod:`~.tolerance`), relative to the
  plain loop's largest finite magnitude (values only when the blocks draw no random numbers, e.g.
  dropout in training: its draws differ between micro-batches and a whole batch, and when no hook
  replaced a block's input or output: the plain run fires no hook, so that none fires twice, and
  would lack that effect). A value that is not finite (NaN, inf: a NaN in the batch's data) equals
  the same non-finite value at the same place; a NaN or inf on one side only is a difference;
- how often each hook that observes the blocks (:mod:`~.observers`) fired.

A difference raises :class:`SelfCheckError` naming it, before the first optimizer step. The cost
is one forward pass of the stack without gradients on that batch (docs/user-guide.md gives the
measurement); ``PipeTransformerStrategy(self_check=False)`` turns it off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook

from lightning_pipetransformer import tree
from lightning_pipetransformer.stack.deferred import Deferred, output_template, same_structure
from lightning_pipetransformer.stack.interception import bypass, call_block, uncounted
from lightning_pipetransformer.stack.observers import Observer, block_modules, replacing_hooks, silenced
from lightning_pipetransformer.stack.probe import Probe, block_device
from lightning_pipetransformer.stack.stack_call import InterceptionError, Runner, StackCall, hidden_of
from lightning_pipetransformer.stack.tolerance import lowest_precision, precisions_in_play
from lightning_pipetransformer.terminal import wrap

__all__ = ["SelfCheck", "SelfCheckError", "value_tolerance"]

#: The largest difference allowed, relative to the largest magnitude of the plain loop's tensor, by the
#: lowest precision in play (TF32 stands as float16: :data:`~.tolerance.TF32`).
_TOLERANCE = {torch.float16: 3e-2, torch.bfloat16: 6e-2}
_DEFAULT_TOLERANCE = 1e-3


def value_tolerance(dtype: torch.dtype, precisions: Sequence[torch.dtype | None] = ()) -> float:
    """The largest difference the self-check allows in a ``dtype`` tensor, relative to the plain loop's largest
    magnitude, when the blocks' math ran at ``precisions`` (:func:`~.tolerance.precisions_in_play`).

    The runner and the plain loop run the blocks at other batch shapes (micro-batches, the cache's
    misses), so other kernels: they agree to the lowest precision in play, which an fp32 output
    under bf16 autocast or TF32 matmuls does not show.
    """
    return _TOLERANCE.get(lowest_precision(dtype, *precisions), _DEFAULT_TOLERANCE)  # type: ignore[arg-type]


class SelfCheckError(InterceptionError):
    """The runner (pipeline, cache) gave the model something else than the plain loop over the same blocks."""


class SelfCheck:
    """``check(runner, call)``: the runner's output for ``call``, after comparing it with the plain loop's."""

    def __init__(self, blocks: Sequence[nn.Module], what: str = "the pipeline", announce: Callable[[str], None] | None = None) -> None:
        self.blocks = tuple(blocks)
        self.what = what
        #: Told, in words, that the check ran and passed (e.g. ``rank_zero_info``): a check that runs is visible.
        self.announce = announce
        self._modules = block_modules(self.blocks)

    def __call__(self, runner: Runner, call: StackCall) -> Any:
        blocks = self.blocks
        before = Probe(blocks)  # random state and buffers as the runner found them
        # Copies, a tensor shared by several blocks copied once: the plain loop gets what the runner got.
        hidden, calls = tree.map_tensors(lambda v: v.detach().clone(), (call.hidden, call.calls), memo={})
        watched = self._watched(call.observed)
        # Read before the runner runs: the autocast and matmul precision both passes compute at.
        precisions = precisions_in_play(block_device(blocks[0], call.hidden.device) if blocks else call.hidden.device, blocks)
        with _counting(watched) as fired, replacing_hooks(self._modules) as replacing:
            out = runner.run(call)
        after = Probe(blocks)
        before.restore()
        rng = _rng_states(blocks)
        with _counting(watched) as expected, silenced((m for _, m in self._modules), every=True):
            plain = self._plain(hidden, calls, _home(out, call.hidden.device))
        draws = any(not torch.equal(a, b) for a, b in zip(_rng_states(blocks), rng))
        after.restore()
        largest: list[float] = []
        # A hook that replaced a block's input or output had no effect in the plain run (hooks silenced there).
        values = not draws and not replacing
        differences = _differences(out, plain, values=values, largest=largest, precisions=precisions)
        for key, name in watched.items():
            if fired[key] != expected[key]:
                differences.append(f"{name} fired {fired[key]} time(s) where the plain loop fires it {expected[key]} time(s)")
        if differences:
            raise SelfCheckError(
                f"PipeTransformer's first-batch self-check: {self.what} ({type(runner).__name__}) gave the model something "
                f"else than the plain loop over the same blocks, so training would differ from plain training: "
                f"{'; '.join(differences[:4])}{' ...' if len(differences) > 4 else ''}. Nothing was trained yet. Use "
                "pipe_len=1, chunks=1, cache=False for this model, or remove what makes the difference (a flag or hook that "
                "observes the blocks); self_check=False turns this check off (not advised: the difference stays)."
            )
        if self.announce is not None:
            compared = (
                "values not compared: the blocks draw random numbers (dropout in training)" if draws
                else f"values not compared: {replacing[0]} returns what the module gets or gives, which the plain run "
                "(hooks silenced, so that they fire once) does not repeat" if replacing
                else f"values within {max(largest, default=0.0):.1e} of the plain loop's, relative to its largest magnitude"
            )
            hooks = f", {len(watched)} observed module(s) fired as often" if watched else ""
            # Wrapped: in one line this is some 210 columns, which a terminal breaks mid-word.
            self.announce(wrap(
                f"PipeTransformer: first-batch self-check passed: {self.what} gives the model what the plain loop over the "
                f"same blocks gives ({compared}{hooks})."
            ))  # fmt: skip
        return out

    def _watched(self, observed: Sequence[Observer]) -> dict[int, str]:
        """Module id -> the hook to name, for every module an observing hook sits on (all modules for a global one)."""
        watched: dict[int, str] = {}
        for observer in observed:
            modules = [observer.module] if observer.module is not None else [m for _, m in self._modules]
            for module in modules:
                watched.setdefault(id(module), observer.describe())
        return watched

    def _plain(self, hidden: Tensor, calls: Sequence[Any], home: torch.device) -> Any:
        """The plain loop: each block on the whole batch, on its own device, in order."""
        out: Any = hidden
        with bypass(), uncounted(), torch.no_grad():
            for block, (args, kwargs) in zip(self.blocks, calls):
                where = block_device(block, hidden.device)
                here, args, kwargs = tree.map_tensors(lambda v, d=where: v.to(d), (hidden, args, kwargs))
                out = call_block(block, here, *args, **kwargs)
                hidden = hidden_of(out)
        return tree.map_tensors(lambda v: v.to(home), out)


def _home(out: Any, default: torch.device) -> torch.device:
    return next((v.device for v in tree.tensors(out)), default)


def _rng_states(blocks: Sequence[nn.Module]) -> list[Tensor]:
    cuda = sorted({t.device.index for b in blocks for t in b.parameters() if t.is_cuda})
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda)]


@contextmanager
def _counting(watched: dict[int, str]) -> Iterator[Counter[int]]:
    """Counts the calls of the watched modules inside (a global pre-hook of this package: never an observer)."""
    fired: Counter[int] = Counter()
    if not watched:
        yield fired
        return

    def count(module: nn.Module, args: Any) -> None:
        if id(module) in watched:
            fired[id(module)] += 1

    handle = register_module_forward_pre_hook(count)
    try:
        yield fired
    finally:
        handle.remove()


def _differences(
    out: Any, plain: Any, values: bool, largest: list[float] | None = None, precisions: Sequence[torch.dtype | None] = (),
) -> list[str]:
    """What differs between the runner's output and the plain loop's, in words (empty: nothing).

    ``largest`` gets each compared tensor's largest difference relative to the plain loop's largest
    magnitude; ``precisions``: what the blocks' math ran at (:func:`value_tolerance`).
    """
    shape, expected = output_template(out), output_template(plain)
    if not same_structure(shape, expected):
        return [f"the last block's output is {shape} where the plain loop's is {expected}"]
    found: list[str] = []
    got, want = tree.leaves(out), tree.leaves(plain)
    for index, (a, b) in enumerate(zip(got, want)):
        where = "the hidden state" if index == 0 else f"element {index} of the last block's output"
        if isinstance(a, Deferred):
            continue  # a runner that did not run the last block (all cached): this element raises if the model uses it
        if not isinstance(a, Tensor) or not isinstance(b, Tensor):
            if a is not b and a != b:
                found.append(f"{where} is {a!r} where the plain loop gives {b!r}")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            found.append(f"{where} has shape {tuple(a.shape)} {a.dtype} where the plain loop gives {tuple(b.shape)} {b.dtype}")
            continue
        if values and a.is_floating_point() and a.numel():
            tolerance = value_tolerance(a.dtype, precisions)
            found += _value_differences(where, a.detach().float(), b.detach().float().to(a.device), tolerance, largest)
        elif values and not a.is_floating_point() and not torch.equal(a, b.to(a.device)):
            found.append(f"{where} differs from the plain loop's")
    return found


def _value_differences(where: str, a: Tensor, b: Tensor, tolerance: float, largest: list[float] | None) -> list[str]:
    """How the runner's values ``a`` differ from the plain loop's ``b`` (fp32, one device), in words.

    Non-finite values are the data's, not the runner's: a NaN in one sample's features gives NaN on
    both sides, at the same places, and equals it there; only the finite values are measured. A NaN
    or inf on one side where the other is finite (or another infinity) is a difference.
    """
    a_finite, b_finite = torch.isfinite(a), torch.isfinite(b)
    both = a_finite & b_finite
    same_nonfinite = (a.isnan() & b.isnan()) | (a == b)  # both NaN, or the same infinity
    unmatched = int((~both & ~(~a_finite & ~b_finite & same_nonfinite)).sum())
    error = float(torch.where(both, a - b, 0.0).abs().max())
    scale = float(torch.where(b_finite, b, 0.0).abs().max())
    if largest is not None:
        largest.append(error / max(scale, 1e-6))
    found = []
    if unmatched:
        found.append(f"{where} holds another non-finite value (NaN/inf) than the plain loop's at {unmatched} place(s) "
                     "(finite on one side only, or another infinity)")
    if not error <= tolerance * max(scale, 1e-6):
        found.append(f"{where} differs by up to {error:.3g} (plain loop's largest finite magnitude {scale:.3g})")
    return found
