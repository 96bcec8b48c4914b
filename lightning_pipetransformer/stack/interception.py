"""Block-level interception: the model's own loop calls every block; the stack's last call runs them all.

A pipeline (or AutoCache) must take over the model's loop over its block stack without
changing the model's code. Models loop in many ways::

    for layer in self.layer: hidden = layer(hidden, mask)                       # BERT, ViT
    for layer in self.layers[: config.num_hidden_layers]: hidden = layer(...)    # Llama: a slice
    for i, block in enumerate(self.h): out = block(hidden, alibi=...); hidden = out[0]   # BLOOM
    layer(hidden, attention_mask=masks[layer.attention_type], ...)               # ModernBERT: reads the block

so the interception is on each *block*, not on the container. Every block's class is swapped for
a subclass whose ``__call__`` records the call's arguments instead of running it and returns a
:class:`~.deferred.Deferred` placeholder for its output; the call of the *last* block hands the whole pass,
every block with its own arguments (:class:`~.stack_call.StackCall`), to the installed runner (the pipeline
executor, AutoCache's cached stack) and returns the real output of the last block::

    block 0 (h, a0) -> Deferred d0        recorded: h, (a0)
    block 1 (d0, a1) -> Deferred d1       recorded: (a1)      d0 must arrive unchanged
    ...
    block L-1 (d_{L-2}, a_{L-1}) -> runner(StackCall(h, [a0, ..., a_{L-1}])) -> real output

Indexing, slicing, ``enumerate``, ``len`` and attribute reads on blocks work as before: the
container is untouched and each block is still an instance of its own class.

What cannot be deferred is refused loudly, never run wrongly:

- a placeholder used for anything but being passed to the next block (the model reads or
  changes an intermediate output between blocks, e.g. DeBERTa-v2's convolution after block 0,
  or a loop that stops before the last block) raises :class:`~.stack_call.InterceptionError` at that use;
- blocks called out of order, or an intermediate output passed as another argument, raise;
- to return a placeholder of the right structure, the interception must know what each block
  returns (a tensor, or a tuple such as BLOOM's ``(hidden, attention)``). The first pass over a
  stack therefore runs the blocks as the model calls them, under ``no_grad``, as a probe on
  copies of the pass's input and arguments; it restores the random-number state and the blocks'
  buffers and hands the pass to the runner like every other. The model gets placeholders in
  that pass too (the probe's outputs have no graph: one the model kept would train wrongly), and
  hooks that observe the blocks (:mod:`~.observers`) do not fire in the probe. A first pass whose blocks get a
  key-value cache object (it cannot be copied) runs as the model calls it, and is final; so does any
  pass whose hidden state is a nested tensor (``nn.TransformerEncoder``'s fast path in eval mode),
  which has no batch dimension to split or key. A later pass whose real outputs differ from the structure learnt raises.

Runs the runner makes itself call blocks through :func:`call_block`, which bypasses the
interception. The cost per block call is a dictionary lookup and a tuple append. What a pass is
(the types every runner shares) is :mod:`~.stack_call`; the placeholders are :mod:`~.deferred`;
what the probe puts back is :mod:`~.probe`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer import tree
from lightning_pipetransformer.stack.deferred import Deferred, contains_deferred, output_template, placeholder_output, same_structure
from lightning_pipetransformer.stack.observers import BlockHooks, Observer, block_modules, silenced
from lightning_pipetransformer.stack.placeholders import is_placeholder, refuse_placeholder
from lightning_pipetransformer.stack.probe import Probe, block_device
from lightning_pipetransformer.stack.stack_call import Args, BlockArgs, InterceptionError, Kwargs, Runner, StackCall, hidden_of
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = [
    "InterceptionStats",
    "arm_self_check",
    "bypass",
    "call_block",
    "uncounted",
    "install_pipeline",
    "installed_pipeline",
    "interception_stats",
    "pipelined",
    "remove_pipeline",
]


# -- the interception itself ------------------------------------------------------------------------

_ATTR = "_pipetransformer_interceptor"
_INTERCEPTED: dict[type, type] = {}  # block class -> its intercepting subclass
_local = threading.local()
#: What each container's blocks were seen to return, kept across installs (fit, then validate ...).
_TEMPLATES: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def _intercepting_class(base: type) -> type:
    cls = _INTERCEPTED.get(base)
    if cls is None:

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            found = self.__dict__.get(_ATTR)
            if found is None or getattr(_local, "bypass", 0) or found[0].runner is None:
                return base.__call__(self, *args, **kwargs)
            return found[0].called(found[1], args, kwargs)

        # torch.compile of the whole model (``model.compile()``, ``torch.compile(model)``) must not trace
        # the interception: Dynamo would read the placeholders it returns (and fail on them) and turn
        # the runner's dictionaries into guards. Each block call is a graph break instead: the compiled
        # model runs the parts before and after the stack, the runner runs the blocks (compile those
        # with ``block.compile()`` to compile them too).
        __call__ = torch.compiler.disable(__call__, recursive=True)
        cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__, "__qualname__": base.__qualname__})
        cls._pipetransformer_base = base  # type: ignore[attr-defined]
        _INTERCEPTED[base] = cls
    return cls


def call_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``block`` for real, even while the stack is intercepted (what runners call)."""
    refuse_placeholder(args[0] if args else kwargs.get("hidden_states"), f"{type(block).__name__}")
    base = getattr(type(block), "_pipetransformer_base", None)
    if base is None:
        return block(*args, **kwargs)
    found = block.__dict__.get(_ATTR)
    if found is not None and found[1] == len(found[0].blocks) - 1 and not getattr(_local, "uncounted", 0):
        found[0].stats.last_block_runs += 1
    return base.__call__(block, *args, **kwargs)


@contextmanager
def uncounted() -> Iterator[None]:
    """Block runs inside are not counted as the pass's micro-batches (e.g. timing runs)."""
    _local.uncounted = getattr(_local, "uncounted", 0) + 1
    try:
        yield
    finally:
        _local.uncounted -= 1


@contextmanager
def bypass() -> Iterator[None]:
    """Block calls inside run for real (e.g. advancing cache entries between epochs)."""
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        yield
    finally:
        _local.bypass -= 1


@dataclass
class _Pass:
    """The pass of the model's loop in progress."""

    hidden: Tensor
    #: The first pass with gradients: blocks also run (no graph) to learn what they return, see :class:`~.probe.Probe`.
    probe: Probe | None
    #: A pass run as the model calls it, block by block, and final: no runner (a first pass whose
    #: blocks update a key-value cache, or a pass over a nested tensor).
    eager: bool = False
    calls: list[BlockArgs] = field(default_factory=list)
    #: The probe's copies of the pass's input and arguments, by ``id`` of the original (shared ones copied once).
    copies: dict[int, Tensor] = field(default_factory=dict)
    last: Any = None  # the hidden state the next block must receive (a placeholder, or a real output)
    #: Hooks observing the blocks in this pass (see :mod:`~.observers`).
    observed: tuple[Observer, ...] = ()
    #: In the probe: the real output of the block probed last (the model holds its placeholder).
    probe_hidden: Any = None


@dataclass
class InterceptionStats:
    """How the model's passes over the stack were run (for the user's logger: engagement)."""

    #: Passes handed to the runner (pipelined or cached).
    deferred: int = 0
    #: Passes whose blocks also ran one by one, to learn what they return (the first one of a stack).
    probes: int = 0
    #: Passes run block by block as the model called them, without the runner (not engaged).
    eager: int = 0
    #: Real runs of the last block in deferred passes: ``last_block_runs / deferred`` is the
    #: micro-batches per pass (M when the pipeline engages).
    last_block_runs: int = 0
    #: Deferred passes with hooks observing the blocks (run as one micro-batch, the cache aside).
    observed: int = 0

    def since(self, earlier: InterceptionStats) -> InterceptionStats:
        """The counts since ``earlier`` (a copy taken before)."""
        return InterceptionStats(*(a - b for a, b in zip(astuple(self), astuple(earlier))))

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """``engaged``: share of passes handed to the runner; ``microbatches``: micro-batches per such pass;
        ``observed``: share of those passes that hooks observed (run as one micro-batch, without the cache)."""
        total = self.deferred + self.eager
        return {
            f"{prefix}engaged": float(self.deferred / total) if total else 0.0,
            f"{prefix}microbatches": float(self.last_block_runs / self.deferred) if self.deferred else 0.0,
            f"{prefix}observed": float(self.observed / self.deferred) if self.deferred else 0.0,
        }


class _Interceptor:
    """One per block container: the blocks' order, what they return, and the installed runner."""

    def __init__(self, container: nn.Module, blocks: tuple[nn.Module, ...]) -> None:
        self.container = container
        self.blocks = blocks
        self.runner: Runner | None = None
        known = _TEMPLATES.get(container)
        self.templates: list[Any] = known if known is not None and len(known) == len(blocks) else [None] * len(blocks)
        _TEMPLATES[container] = self.templates
        self.stats = InterceptionStats()
        self._pass: _Pass | None = None
        self._hooks: BlockHooks | None = None  # the hook dictionaries of every module inside the blocks
        self._say = WarnOnce()  # each observer named once per stack
        #: Runs the next training pass instead of the runner, comparing it with the plain loop (see :func:`arm_self_check`).
        self.self_check: Callable[[Runner, StackCall], Any] | None = None

    def observers(self) -> tuple[Observer, ...]:
        """The hooks observing the blocks now (transformers' recorders count only while they record)."""
        if self._hooks is None:
            self._hooks = BlockHooks(block_modules(self.blocks))
        return tuple(self._hooks.observers())

    # Called from each block's __call__ while a runner is installed.
    def called(self, index: int, args: Args, kwargs: Kwargs) -> Any:
        hidden, args, kwargs = _split_hidden(self.blocks[index], args, kwargs)
        if index == 0:
            if isinstance(hidden, Deferred):
                raise InterceptionError(
                    f"Block 0 of the stack got {hidden._what} as its input: the model runs the stack twice in one "
                    "pass. Name one container with layers=, or use pipe_len=1, chunks=1, cache=False."
                )
            learn = any(t is None for t in self.templates)
            # A nested tensor (nn.TransformerEncoder's fast path in eval mode: padding dropped) has no batch
            # dimension to split into micro-batches or to key cache rows by: the pass runs as the model calls it.
            eager = hidden.is_nested or (learn and any(tree.is_stateful(v) for v in tree.leaves((args, kwargs))))
            self._pass = _Pass(hidden, Probe(self.blocks) if learn and not eager else None, eager, observed=self.observers())
        else:
            current = self._pass
            if current is None or index != len(current.calls):
                expected = "block 0" if current is None else f"block {len(current.calls)}"
                raise InterceptionError(
                    f"The model called block {index} of its stack where {expected} was next. strategy='pipetransformer' "
                    "needs the model to call every block of the stack once per pass, in order. Use pipe_len=1, "
                    "chunks=1 and cache=False for this model, or name another container with layers=."
                )
            if hidden is not current.last:
                self._pass = None
                raise InterceptionError(
                    f"Block {index} did not receive block {index - 1}'s output: the model's loop changes the hidden "
                    f"state between blocks {index - 1} and {index} (e.g. DeBERTa-v2 with conv_kernel_size > 0). A "
                    "pipeline or cache cannot reproduce that: use pipe_len=1, chunks=1 and cache=False for this model."
                )
        if contains_deferred((args, kwargs)):
            self._pass = None
            raise InterceptionError(
                f"Block {index} got an earlier block's output as an extra argument: the model feeds intermediate "
                "outputs into later blocks, which a pipeline or cache cannot reproduce. Use pipe_len=1, chunks=1 "
                "and cache=False for this model."
            )
        current = self._pass
        assert current is not None
        current.calls.append((args, kwargs))
        last = index == len(self.blocks) - 1
        if current.eager:
            out = self._run_eagerly(index, hidden, args, kwargs, probe=False)
            self.templates[index] = output_template(out)
            current.last = hidden_of(out)
            if last:
                self._pass = None
                self.stats.eager += 1
            return out
        if current.probe is not None:
            # The probe's outputs have no graph and are not the pass's: the model gets placeholders, as in
            # every later pass, so that one it keeps (per-layer outputs collected in its own loop) is refused
            # here, in the first step, instead of training that step without their gradient.
            real = hidden if index == 0 else current.probe_hidden
            out = self._run_eagerly(index, real, args, kwargs, probe=True)
            self.templates[index] = output_template(out)
            if not last:
                current.probe_hidden = hidden_of(out)
                out, current.last = placeholder_output(self.templates[index], current.hidden, f"the output of block {index}")
                return out
            current.probe.restore()  # the runner's pass draws and updates as if the probe never ran
            self.stats.probes += 1
        elif not last:
            out, current.last = placeholder_output(self.templates[index], current.hidden, f"the output of block {index}")
            return out
        self._pass = None
        assert self.runner is not None
        call = StackCall(current.hidden, tuple(current.calls), self._check_structure, self._as_last_output, current.observed)
        if current.observed:
            self.stats.observed += 1
            _warn_observed(current.observed, self._say)
        check = self.self_check if torch.is_grad_enabled() and not is_placeholder(current.hidden) else None
        with bypass():
            if check is not None:
                self.self_check = None
                out = check(self.runner, call)
            else:
                out = self.runner.run(call)
        self.stats.deferred += 1
        return out

    def _run_eagerly(self, index: int, hidden: Tensor, args: Args, kwargs: Kwargs, probe: bool) -> Any:
        """Block ``index`` for real, on its own device; its output back where the pass's input lives.

        ``probe``: without a graph, on copies of the pass's input and arguments (the runner runs
        the pass again), refusing a key-value cache object (it would be updated twice).
        """
        home = self._pass.hidden.device if self._pass is not None else hidden.device
        where = block_device(self.blocks[index], home)
        if where != home or hidden.device != where:
            hidden, args, kwargs = tree.map_tensors(lambda v: v.to(where), (hidden, args, kwargs))
        if probe:
            if any(tree.is_stateful(v) for v in tree.leaves((args, kwargs))):
                self._pass = None
                raise InterceptionError(
                    f"Block {index} got a key-value cache object but block 0 did not: the first pass cannot learn what "
                    "the blocks return without updating it twice. Pass use_cache=False while training."
                )
            # The runner reads the pass's input and every argument again: the probe works on copies,
            # so a block that changes its inputs in place changes them once, in the runner's pass.
            copies = self._pass.copies if self._pass is not None else {}
            copy = lambda v: v.detach().clone()  # noqa: E731
            args, kwargs = tree.map_tensors(copy, (args, kwargs), memo=copies)
            if index == 0:
                hidden = tree.map_tensors(copy, hidden, memo=copies)
        observed = self._pass.observed if probe and self._pass is not None else ()
        quiet = silenced(o.module for o in observed if o.module is not None) if observed else contextlib.nullcontext()
        with bypass(), uncounted(), torch.no_grad() if probe else contextlib.nullcontext(), quiet:
            out = call_block(self.blocks[index], hidden, *args, **kwargs)
        if where != home:
            out = tree.map_tensors(lambda v: v.to(home), out)
        return out

    def _as_last_output(self, hidden: Tensor) -> Any:
        """``hidden`` in the structure the last block returns; its other tensors raise if used."""
        out, placeholder = placeholder_output(self.templates[-1], hidden, "an output of the last block")
        if out is placeholder:
            return hidden
        items = [hidden, *out[1:]]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)

    def _check_structure(self, index: int, output: Any) -> None:
        """A block's real output must have the structure its placeholder had (learned in the first pass)."""
        template = output_template(output)
        if not same_structure(template, self.templates[index]):
            previous, self.templates[index] = self.templates[index], template
            raise InterceptionError(
                f"Block {index} returned {template} this time but {previous} in the model's first pass, whose "
                "structure its placeholder copied: a flag passed to the blocks changes what they return (e.g. "
                "output_attentions). Keep such flags fixed during training, or use pipe_len=1, chunks=1, cache=False."
            )


def _warn_observed(observed: Sequence[Observer], say: WarnOnce) -> None:
    """Once per hook (and stack): it observes the blocks, so its passes run each block once on the whole batch."""
    named = observed[0].describe()
    more = f" (and {len(observed) - 1} more)" if len(observed) > 1 else ""
    say(
        named,
        f"PipeTransformer: {named}{more} observes the blocks (a hook that fires inside the block stack; transformers "
        "installs such hooks for output_hidden_states, output_attentions and output_router_logits). So that it sees "
        "each block once per pass with the whole batch, as in the plain loop, these passes run the pipeline as one "
        "micro-batch and without the activation cache: exact, but without micro-batch overlap or cache hits "
        "(pipetransformer/observed logs their share). To keep both: remove the hook or the output_* flag while training, "
        "or mark a hook that should see every real block run (micro-batches, e.g. to count them) with "
        "lightning_pipetransformer.sees_block_runs(hook).",
    )


def _split_hidden(block: nn.Module, args: Args, kwargs: Kwargs) -> tuple[Tensor, Args, Kwargs]:
    """The hidden state (first positional argument, or ``hidden_states=``) and the rest of a block call."""
    if args:
        hidden, rest = args[0], tuple(args[1:])
    elif "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        hidden, rest = kwargs.pop("hidden_states"), ()
    else:
        raise InterceptionError(
            f"{type(block).__name__} was called without a positional hidden state or hidden_states=: cannot tell "
            "which argument flows from block to block. Use pipe_len=1, chunks=1 and cache=False for this model."
        )
    if not isinstance(hidden, Tensor):
        raise TypeError(
            "The pipeline's first argument must be the hidden state, a tensor whose first dimension is the batch; "
            f"{type(block).__name__} got {type(hidden).__name__}."
        )
    return hidden, rest, kwargs


# -- installing a runner -------------------------------------------------------------------------


def _blocks_of(container: nn.Module) -> tuple[nn.Module, ...]:
    return tuple(m for m in container._modules.values() if m is not None)


def install_pipeline(container: nn.Module, runner: Runner | None) -> None:
    """Route the model's passes over ``container``'s blocks to ``runner`` (``None``: run them as written).

    The first install swaps each block's class for its intercepting subclass; later installs
    only replace the runner, keeping what the blocks were seen to return. ``len``, indexing,
    slicing, ``children()``, ``parameters()``, ``state_dict()`` keys and attribute reads on the
    blocks are untouched. :func:`remove_pipeline` restores the classes.

    Raises:
        ValueError: ``runner.blocks`` are not exactly the container's children, in order, or a
            block appears twice in the container.
    """
    blocks = _blocks_of(container)
    if runner is None and _ATTR not in container.__dict__:
        return  # nothing to route, nothing installed: the model's loop runs as written
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError(
            f"The same block object appears more than once in this {type(container).__name__} (shared blocks): "
            "a pipeline places each block on one device and cannot run it at two positions."
        )
    if runner is not None and (len(runner.blocks) != len(blocks) or any(a is not b for a, b in zip(runner.blocks, blocks))):
        raise ValueError(
            f"The pipeline runs {len(runner.blocks)} blocks that are not the {len(blocks)} children "
            f"of this {type(container).__name__}, in order: build it from list(container)."
        )
    interceptor = container.__dict__.get(_ATTR)
    if interceptor is None or interceptor.blocks != blocks:
        if interceptor is not None:
            remove_pipeline(container)
        interceptor = _Interceptor(container, blocks)
        for index, block in enumerate(blocks):
            base = getattr(type(block), "_pipetransformer_base", type(block))
            block.__class__ = _intercepting_class(base)
            block.__dict__[_ATTR] = (interceptor, index)
        # Not a submodule: kept out of _modules so the module tree and state dict stay the model's.
        container.__dict__[_ATTR] = interceptor
    interceptor.runner = runner
    interceptor._pass = None


def installed_pipeline(container: nn.Module) -> Runner | None:
    """The runner :func:`install_pipeline` installed on ``container`` (``None`` if none)."""
    interceptor = container.__dict__.get(_ATTR)
    return interceptor.runner if interceptor is not None else None


def interception_stats(container: nn.Module) -> InterceptionStats | None:
    """How the passes over ``container`` were run since the first install (``None``: never installed)."""
    interceptor = container.__dict__.get(_ATTR)
    return interceptor.stats if interceptor is not None else None


def arm_self_check(container: nn.Module, check: Callable[[Runner, StackCall], Any] | None) -> None:
    """Run the next pass with gradients (a training step) through ``check(runner, call)`` instead of
    ``runner.run(call)``: it returns the runner's output after comparing it with the plain loop
    (:mod:`~.self_check`). ``None`` disarms. Needs :func:`install_pipeline` first."""
    interceptor = container.__dict__.get(_ATTR)
    if interceptor is None:
        raise ValueError(f"No pipeline is installed on this {type(container).__name__}: nothing to self-check.")
    interceptor.self_check = check


def remove_pipeline(container: nn.Module) -> None:
    """Undo :func:`install_pipeline`: the blocks get their own classes back (idempotent)."""
    interceptor = container.__dict__.pop(_ATTR, None)
    if interceptor is None:
        return
    for block in interceptor.blocks:
        if block.__dict__.pop(_ATTR, None) is not None:
            block.__class__ = type(block)._pipetransformer_base  # type: ignore[attr-defined]


@contextmanager
def pipelined(container: nn.Module, runner: Runner) -> Iterator[nn.Module]:
    """:func:`install_pipeline` for the duration of a ``with`` block."""
    install_pipeline(container, runner)
    try:
        yield container
    finally:
        remove_pipeline(container)
