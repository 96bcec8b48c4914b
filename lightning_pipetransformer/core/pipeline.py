"""The pipeline executor: one process drives a block stack cut into stages on K devices.

GPipe fill-drain in the style of torchgpipe. A call ``pipeline(hidden, *args, **kwargs)``
stands for the model's own loop ``for block in blocks: hidden = block(hidden, *args, **kwargs)``:
the batch is cut into ``chunks`` micro-batches (:mod:`.microbatch`), micro-batch ``i`` runs on
stage ``j`` at clock cycle ``i + j`` (:func:`clock_cycles`), and the last block's outputs are
joined on the last stage's device. Autograd does the backward.

On CUDA each stage computes on its own stream and hands its output to the next stage through
events (:mod:`.devices`), so stages work on different micro-batches at the same time; on CPU the
same code runs the same order with no streams, hence no overlap: micro-batching then only costs.

The executor is not an ``nn.Module``: it holds references to the blocks and never registers
them, so the user's module tree and state-dict keys stay as they are. :func:`install_pipeline`
makes a model's own loop over a ``ModuleList`` / ``Sequential`` call it instead of the blocks.

Micro-batching changes nothing mathematically except for layers that look across the batch
(BatchNorm statistics are per micro-batch) and random ones (dropout draws differ from the
full-batch draws, so results match the plain module in distribution only; use dropout 0 to
compare). Floating-point sums may differ in the last bits (different matmul shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer.core import devices as dev
from lightning_pipetransformer.core.devices import Device, Stream
from lightning_pipetransformer.core.microbatch import BatchArgs, Kwargs, gather, map_tensors, scatter
from lightning_pipetransformer.core.partition import boundaries

__all__ = ["Pipeline", "clock_cycles", "hidden_of", "install_pipeline", "installed_pipeline", "remove_pipeline", "pipelined"]

Blocks = tuple[nn.Module, ...]
Schedule = list[tuple[int, int]]


def hidden_of(output: Any) -> Tensor:
    """The hidden state inside a block's output, to feed the next block.

    A tensor is itself; a tuple or list (older Hugging Face layers) and a ``ModelOutput``-like
    object (anything with ``to_tuple``) give their first element.
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    if hasattr(output, "to_tuple"):
        return output.to_tuple()[0]
    raise TypeError(
        f"Cannot find the hidden state in a block output of type {type(output).__name__}: "
        "pass Pipeline(..., hidden_of=fn) with a function that extracts it."
    )


def clock_cycles(chunks: int, stages: int) -> Iterator[Schedule]:
    """The GPipe fill-drain schedule: ``(micro-batch, stage)`` pairs runnable per clock cycle.

    Micro-batch ``i`` runs on stage ``j`` at cycle ``i + j``, e.g. 3 micro-batches, 3 stages::

        cycle | stage 0 | stage 1 | stage 2
          0   | (0, 0)  |         |
          1   | (1, 0)  | (0, 1)  |
          2   | (2, 0)  | (1, 1)  | (0, 2)
          3   |         | (2, 1)  | (1, 2)
          4   |         |         | (2, 2)

    Pairs within a cycle are independent; on CUDA they run at the same time.
    """
    for k in range(chunks + stages - 1):
        yield [(k - j, j) for j in range(max(0, k - chunks + 1), min(k + 1, stages))]


class Pipeline:
    """Run ``blocks`` as a pipeline of ``len(balance)`` stages over ``chunks`` micro-batches.

    Args:
        blocks: the stack, in order; stage ``j`` holds the next ``balance[j]`` of them.
        balance: blocks per stage, e.g. ``(4, 4, 4)``.
        devices: one device per stage (stages may share a device; on CUDA each still gets its
            own stream). The blocks must already be there: see :meth:`place`.
        chunks: the number of micro-batches ``M``.
        num_frozen: the leading blocks that are frozen (their parameters must not require
            grad). They run under ``torch.no_grad()`` unless something upstream needs gradients
            (a trainable embedding feeding the hidden state), in which case they must stay in
            the graph so the gradient reaches it.
        batch_args: which arguments are batch-shaped (positions, 0 being the hidden state, and
            keyword names); ``None`` uses the first-dimension heuristic of :mod:`.microbatch`.
        hidden_of: extracts the hidden state from a block's output (default :func:`hidden_of`).

    With one stage and one micro-batch a call is the plain loop: no split, no copy, no extra
    autograd node.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        balance: Sequence[int],
        devices: Sequence[Device],
        chunks: int = 1,
        num_frozen: int = 0,
        *,
        batch_args: BatchArgs | None = None,
        hidden_of: Callable[[Any], Tensor] = hidden_of,
    ) -> None:
        blocks, balance = tuple(blocks), tuple(balance)
        if any(b < 1 for b in balance) or not balance:
            raise ValueError(f"Every stage needs at least one block; the balance {balance} has an empty stage.")
        if sum(balance) != len(blocks):
            raise ValueError(
                f"The balance {balance} covers {sum(balance)} blocks, but the stack has {len(blocks)}."
            )
        if len(devices) != len(balance):
            raise ValueError(
                f"Got {len(devices)} devices for {len(balance)} stages (balance {balance}): give one device per stage."
            )
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"The number of micro-batches (chunks) must be a positive integer, got {chunks!r}.")
        if not 0 <= num_frozen <= len(blocks):
            raise ValueError(f"num_frozen must be in 0..{len(blocks)}, got {num_frozen}.")
        for index, block in enumerate(blocks[:num_frozen]):
            trainable = [name for name, p in block.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(
                    f"Block {index} is declared frozen (num_frozen={num_frozen}) but its parameter "
                    f"{trainable[0]!r} requires grad: freeze it (requires_grad_(False)) first."
                )

        self.blocks: Blocks = blocks
        self.balance: tuple[int, ...] = balance
        self.devices: tuple[torch.device, ...] = tuple(dev.as_device(d) for d in devices)
        self.chunks = chunks
        self.num_frozen = num_frozen
        self.batch_args = batch_args
        self.hidden_of = hidden_of
        edges = boundaries(balance)
        # Per stage: (frozen blocks, active blocks); the split is fixed, so slice once.
        self._stages: tuple[tuple[Blocks, Blocks], ...] = tuple(
            (blocks[a : min(b, max(a, num_frozen))], blocks[min(b, max(a, num_frozen)) : b])
            for a, b in zip(edges[:-1], edges[1:])
        )
        self._streams: list[Stream] | None = None  # made on the first pipelined call

    def __repr__(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return (
            f"Pipeline(balance={self.balance}, devices=[{devices}], chunks={self.chunks}, "
            f"num_frozen={self.num_frozen})"
        )

    def place(self) -> Pipeline:
        """Move each block to its stage's device (in place, as ``Module.to`` does); returns self."""
        for (frozen, active), device in zip(self._stages, self.devices):
            for block in frozen + active:
                block.to(device)
        return self

    def __call__(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        if len(self.balance) == 1 and self.chunks == 1:
            return self._call_plain(hidden, args, kwargs)
        return self._call_pipelined(hidden, args, kwargs)

    # -- one stage, one micro-batch: the plain loop ------------------------------------------

    def _call_plain(self, hidden: Tensor, args: tuple[Any, ...], kwargs: Kwargs) -> Any:
        device = self.devices[0]
        if _off_device(device, hidden, args, kwargs):
            move = lambda v: v.to(device) if isinstance(v, Tensor) else v  # noqa: E731
            hidden = move(hidden)
            args = tuple(move(a) for a in args)
            kwargs = {k: move(v) for k, v in kwargs.items()}
        return self._run_stage(0, hidden, args, kwargs)

    # -- the general case ----------------------------------------------------------------------

    def _call_pipelined(self, hidden: Tensor, args: tuple[Any, ...], kwargs: Kwargs) -> Any:
        split = scatter((hidden, *args), kwargs, self.chunks, self.batch_args)
        stages, chunks, devices = len(self.balance), self.chunks, self.devices
        streams = self._stage_streams()
        for stream, device in zip(streams, devices):
            # A stage must see what the caller queued before this call on its device:
            # the optimizer's parameter updates, the inputs.
            dev.wait(stream, dev.current_stream(device))

        # Arguments passed whole go to each stage once, not once per micro-batch.
        whole_args = [
            {i: _hop_in(a, streams[j], devices[j]) for i, a in enumerate(split.batches[0][0]) if i not in split.split_args}
            for j in range(stages)
        ]
        whole_kwargs = [
            {k: _hop_in(v, streams[j], devices[j]) for k, v in split.batches[0][1].items() if k not in split.split_kwargs}
            for j in range(stages)
        ]

        # hiddens[i]: micro-batch i's hidden state, and the stream it was produced on.
        hiddens: list[tuple[Tensor, Stream] | None] = [
            (a[0], dev.current_stream(a[0].device)) for a, _ in split.batches
        ]
        outputs: list[Any] = [None] * chunks
        for schedule in clock_cycles(chunks, stages):
            for i, j in schedule:
                x, src = hiddens[i]  # type: ignore[misc]
                # Hold no reference past its use: under no_grad that frees activations early.
                hiddens[i] = None
                x = dev.hop(x, src, streams[j], devices[j])
                args_i, kwargs_i = split.batches[i]
                stage_args = tuple(
                    x if p == 0 else _hop_in(a, streams[j], devices[j]) if p in split.split_args else whole_args[j][p]
                    for p, a in enumerate(args_i)
                )
                stage_kwargs = {
                    k: _hop_in(v, streams[j], devices[j]) if k in split.split_kwargs else whole_kwargs[j][k]
                    for k, v in kwargs_i.items()
                }
                with dev.use_stream(streams[j]):
                    out = self._run_stage(j, x, stage_args[1:], stage_kwargs)
                if j == stages - 1:
                    outputs[i] = out
                else:
                    hiddens[i] = (self.hidden_of(out), streams[j])

        last, last_stream = devices[-1], streams[-1]
        caller_stream = dev.current_stream(last)
        if last_stream is not None or caller_stream is not None:
            # Back to the caller's stream before joining: it is where the result is used.
            outputs = [map_tensors(lambda t: dev.hop(t, last_stream, caller_stream, last), o) for o in outputs]
        return gather(outputs, split.sizes)

    def _stage_streams(self) -> list[Stream]:
        if self._streams is None:
            self._streams = [dev.new_stream(d) for d in self.devices]
        return self._streams

    def _run_stage(self, j: int, hidden: Tensor, args: tuple[Any, ...], kwargs: Kwargs) -> Any:
        """Stage ``j``'s blocks on one micro-batch; returns the last block's output."""
        frozen, active = self._stages[j]
        output: Any = hidden
        if frozen:
            # No graph for frozen blocks unless a gradient must flow through them to
            # something trainable upstream (then their input requires grad).
            skip_graph = torch.is_grad_enabled() and not _needs_grad(hidden, args, kwargs)
            with torch.no_grad() if skip_graph else nullcontext():
                for block in frozen:
                    output = block(hidden, *args, **kwargs)
                    hidden = self.hidden_of(output)
        for block in active:
            output = block(hidden, *args, **kwargs)
            hidden = self.hidden_of(output)
        return output


def _hop_in(value: Any, stream: Stream, device: torch.device) -> Any:
    """An argument from the caller (on its current stream) made ready for a stage."""
    if not isinstance(value, Tensor):
        return value
    return dev.hop(value, dev.current_stream(value.device), stream, device)


def _off_device(device: torch.device, hidden: Tensor, args: tuple[Any, ...], kwargs: Kwargs) -> bool:
    if hidden.device != device:
        return True
    return any(isinstance(v, Tensor) and v.device != device for v in (*args, *kwargs.values()))


def _needs_grad(hidden: Tensor, args: tuple[Any, ...], kwargs: Kwargs) -> bool:
    if hidden.requires_grad:
        return True
    return any(isinstance(v, Tensor) and v.requires_grad for v in (*args, *kwargs.values()))


# -- making a model's own loop call the pipeline ---------------------------------------------

_PIPELINE_ATTR = "_pipetransformer_pipeline"
_PIPELINED_CLASSES: dict[type, type] = {}


def _pipelined_class(base: type) -> type:
    """A subclass of ``base`` whose iteration yields the installed pipeline, made once per base."""
    cls = _PIPELINED_CLASSES.get(base)
    if cls is None:

        def __iter__(self: nn.Module) -> Iterator[Any]:
            pipeline = self.__dict__.get(_PIPELINE_ATTR)
            # A slice ('self.__class__(...)' in ModuleList/Sequential) has no pipeline.
            if pipeline is None:
                return base.__iter__(self)
            return iter((pipeline,))

        cls = type(f"Pipelined{base.__name__}", (base,), {"__iter__": __iter__, "__module__": __name__})
        _PIPELINED_CLASSES[base] = cls
    return cls


def install_pipeline(container: nn.Module, pipeline: Pipeline) -> None:
    """Make iterating ``container`` yield ``pipeline`` alone, so the model's loop calls it once.

    ``for layer in stack: hidden = layer(hidden, ...)`` (Hugging Face BERT/ViT encoders,
    ``nn.Sequential.forward``, ``nn.TransformerEncoder`` over ``.layers``) then runs the whole
    stack as a pipeline. Only ``__iter__`` changes, by swapping the instance's class to a
    subclass: ``len``, indexing, ``children()``, ``parameters()`` and ``state_dict()`` keys are
    untouched. Code that iterates the container for other reasons (e.g. to freeze its blocks)
    sees the pipeline too while it is installed: prefer :func:`pipelined` around the forward.
    Remove it before pickling the module itself (``state_dict`` is unaffected).

    Raises:
        ValueError: ``pipeline.blocks`` are not exactly the container's children, in order.
    """
    children = tuple(container._modules.values())
    if len(children) != len(pipeline.blocks) or any(a is not b for a, b in zip(children, pipeline.blocks)):
        raise ValueError(
            f"The pipeline runs {len(pipeline.blocks)} blocks that are not the {len(children)} children "
            f"of this {type(container).__name__}, in order: build it from list(container)."
        )
    base = type(container)
    if _PIPELINE_ATTR not in container.__dict__:
        container.__class__ = _pipelined_class(base)
    # object.__setattr__: the pipeline is not a submodule and must not be registered as one.
    object.__setattr__(container, _PIPELINE_ATTR, pipeline)


def installed_pipeline(container: nn.Module) -> Any:
    """What :func:`install_pipeline` installed on ``container`` (``None`` if nothing is installed)."""
    return container.__dict__.get(_PIPELINE_ATTR)


def remove_pipeline(container: nn.Module) -> None:
    """Undo :func:`install_pipeline` (does nothing if none is installed)."""
    if _PIPELINE_ATTR not in container.__dict__:
        return
    object.__delattr__(container, _PIPELINE_ATTR)
    container.__class__ = type(container).__bases__[0]


@contextmanager
def pipelined(container: nn.Module, pipeline: Pipeline) -> Iterator[nn.Module]:
    """:func:`install_pipeline` for the duration of a ``with`` block."""
    install_pipeline(container, pipeline)
    try:
        yield container
    finally:
        remove_pipeline(container)
