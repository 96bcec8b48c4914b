"""What runs before and after the block stack, read from the model's call order (one forward observed).

Registration order says where a module is *declared*, not when it runs: a task head registered
before the backbone (transformers 5.x ``XLMRobertaForSequenceClassification``: ``classifier``
before ``roberta``) would be frozen as an embedding, and a module registered after the stack that
runs before it (MPNet's ``relative_attention_bias``, BART's ``layernorm_embedding``, Gemma3n's
``altup_projections``) would keep training while the frozen blocks read its output. So the split
of :mod:`~lightning_pipetransformer.stack.discovery` is provisional, and :class:`CallOrderObserver`
watches one training forward (the first one, which the training loop makes anyway: no extra pass,
no data drawn) with hooks on

- every module discovery placed before or after the stack (the children of the ancestors of the
  block container), recording each call;
- the ancestors themselves (``model``, ``model.roberta``, ``model.roberta.encoder``), which nest
  the calls: a call is judged inside the innermost ancestor call it happens in, against that call's
  way to the stack (the next ancestor's calls, or, in the container's parent, the blocks' runs);
- the blocks (their first and last run in the parent's call: the stack's span), and the
  parameters the first block's arguments are computed from: a module whose weight is *read*
  before the stack rather than called (DeBERTa's ``rel_embeddings.weight``, handed to every
  layer) and that is never called runs before the stack too.

A call before the span is *before*, after it *after*, inside it *during*; between two calls of
the way to the stack (a ``training_step`` that runs the model twice) it says nothing. A module
called only before the stack joins ``pre`` (in the order of its first call: ``pre[0]`` is what runs
first, the embeddings); a module called before and after it (shared embeddings that a decoder reads too) cannot be frozen with
the prefix without freezing what runs after: :class:`CallOrderError` names it and the override
(one without parameters, such as T5's dropout used on both sides, stays outside the prefix).
Anything else, called or not, is ``post``.

No Lightning imports: AutoFreeze drives it (the first training batch), under any strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer import tree
from lightning_pipetransformer.stack.calls import is_called_block
from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.terminal import wrap

__all__ = ["CallOrder", "CallOrderError", "CallOrderObserver", "OrderWatch", "graph_leaves", "split_by_order"]

BEFORE, AFTER, DURING, BETWEEN = "before", "after", "during", "between"


class CallOrderError(BlockStackError):
    """A module runs both before and after the block stack: what to freeze with the prefix is not defined."""


@dataclass
class _Frame:
    """One call of an ancestor of the container (or the observation window, for an uncalled root)."""

    level: int
    spanned: bool = False  # whether it opened a span in the enclosing call (it is on the way to the stack)
    spans: list[list[int]] = field(default_factory=list)  # [start, end] of the way to the stack
    calls: list[tuple[int, int]] = field(default_factory=list)  # (time, id of the module called)
    block_span: list[int] | None = None


@dataclass(frozen=True)
class CallOrder:
    """Per module (by ``id``): where its calls ran relative to the stack, and its first call's time."""

    relations: dict[int, frozenset[str]]
    first_call: dict[int, int]
    #: Whether a block ran in the forward observed (a stand-in step that runs no block tells nothing).
    saw_stack: bool = True

    def relation(self, module: nn.Module) -> frozenset[str]:
        return self.relations.get(id(module), frozenset())


class CallOrderObserver:
    """Hooks that record one forward's call order around ``stack`` inside ``root``; :meth:`finish` reads it.

    Args:
        root: the module the stack's paths are relative to (the LightningModule).
        stack: the stack, with discovery's provisional ``pre``/``post`` (the modules watched).
    """

    def __init__(self, root: nn.Module, stack: BlockStack) -> None:
        self._time = 0
        self._handles: list[Any] = []
        parts = stack.path.split(".") if stack.path else []
        ancestors = [root]
        for part in parts[:-1]:
            ancestors.append(getattr(ancestors[-1], part))
        self._deepest = len(ancestors) - 1
        # The observation window stands for the root's call when the root is not called (a
        # LightningModule's training_step calls its model directly).
        self._frames: list[_Frame] = [_Frame(level=0)]
        self._done: list[_Frame] = []
        watched = {id(m): m for _, m in (*stack.pre, *stack.post)}
        for level, ancestor in enumerate(ancestors):
            self._handles.append(ancestor.register_forward_pre_hook(lambda *_, lv=level: self._enter(lv)))
            self._handles.append(ancestor.register_forward_hook(lambda *_, lv=level: self._leave(lv), always_call=True))
        for module in watched.values():
            self._handles.append(module.register_forward_pre_hook(lambda *_, key=id(module): self._called(key)))
        for block in stack.blocks:
            for runs in _called_parts(block):
                self._handles.append(runs.register_forward_pre_hook(lambda *_: self._block(start=True)))
                self._handles.append(runs.register_forward_hook(lambda *_: self._block(start=False), always_call=True))
        # Parameters read (not called) before the stack: from the first block's arguments' graph.
        self._owner = {id(p): id(m) for m in watched.values() for p in m.parameters()}
        self._reads: dict[int, int] = {}
        self._walks = 0
        if stack.blocks:
            for runs in _called_parts(stack.blocks[0])[:1]:
                self._handles.append(runs.register_forward_pre_hook(self._read_arguments, with_kwargs=True))

    # ------------------------------------------------------------------ hooks

    def _tick(self) -> int:
        self._time += 1
        return self._time

    def _enter(self, level: int) -> None:
        now = self._tick()
        top = self._frames[-1]
        # The way to the stack, seen from the enclosing call (the root's own call, seen from the window).
        spanned = level > top.level or len(self._frames) == 1
        if spanned:
            top.spans.append([now, now])
        self._frames.append(_Frame(level=level, spanned=spanned))

    def _leave(self, level: int) -> None:
        now = self._tick()
        if len(self._frames) > 1 and self._frames[-1].level == level:
            frame = self._frames.pop()
            self._done.append(frame)
            if frame.spanned:
                self._frames[-1].spans[-1][1] = now

    def _called(self, key: int) -> None:
        self._frames[-1].calls.append((self._tick(), key))

    def _block(self, start: bool) -> None:
        now = self._tick()
        frame = self._frames[-1]
        if frame.block_span is None:
            frame.block_span = [now, now]
        frame.block_span[1] = now

    def _read_arguments(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A few runs of block 0 suffice (the strategy's first pass probes it without a graph, then runs it).
        if self._walks >= _MAX_WALKS:
            return
        self._walks += 1
        now = self._tick()
        for leaf in graph_leaves([*args, *kwargs.values()]):
            owner = self._owner.get(id(leaf))
            if owner is not None:
                self._reads.setdefault(owner, now)

    # ------------------------------------------------------------------ reading

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self) -> CallOrder:
        """Remove the hooks and classify every recorded call."""
        self.remove()
        relations: dict[int, set[str]] = {}
        first: dict[int, int] = {}
        for frame in [*self._done, *self._frames]:
            spans = [s for s in frame.spans if s[1] >= s[0]]
            if frame.block_span is not None:
                spans = sorted([*spans, frame.block_span])
            for time, key in frame.calls:
                first.setdefault(key, time)
                relations.setdefault(key, set()).add(_where(time, spans))
        for key, time in self._reads.items():
            if key not in relations:  # never called, but its weights feed the first block
                relations[key] = {BEFORE}
                first[key] = time
        saw = any(f.block_span is not None for f in [*self._done, *self._frames])
        return CallOrder({k: frozenset(v - {BETWEEN}) for k, v in relations.items()}, first, saw)


def _called_parts(block: nn.Module) -> list[nn.Module]:
    """What runs when a block runs: the block, or, for a container that is never called itself (Funnel's
    blocks are ``nn.ModuleList``s of layers), its first descendants that are."""
    if is_called_block(block):
        return [block]
    return [part for child in block.children() for part in _called_parts(child)]


_MAX_WALKS = 4
_MAX_NODES = 512


def graph_leaves(values: Sequence[Any]) -> list[Tensor]:
    """The leaf tensors (parameters) the gradient of the tensors in ``values`` reaches, within a bounded walk."""
    roots: list[Any] = []
    leaves: list[Tensor] = []
    # Pushed last to first: the walk pops the first argument (the hidden state) first, within the bound.
    for value in reversed(tree.tensors(list(values))):
        if value.requires_grad and value.grad_fn is None:
            leaves.append(value)  # a parameter handed to the block as it is (DeBERTa's rel_embeddings.weight)
        elif value.requires_grad:
            roots.append(value.grad_fn)
    seen: set[int] = set()
    while roots and len(seen) < _MAX_NODES:
        node = roots.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        roots.extend(n for n, _ in node.next_functions)
    return leaves


def _where(time: int, spans: Sequence[Sequence[int]]) -> str:
    if not spans:
        return BETWEEN  # no way to the stack in this call: says nothing
    if time < spans[0][0]:
        return BEFORE
    if time > spans[-1][1]:
        return AFTER
    if any(start <= time <= end for start, end in spans):
        return DURING
    return BETWEEN


def split_by_order(
    stack: BlockStack, order: CallOrder, mixed_after: bool = False
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """``(pre, post)`` for ``stack`` from an observed ``order`` (see the module docstring).

    ``mixed_after``: a module run both before and after the stack goes to ``post`` instead of
    raising. Only for a run in which nothing freezes the prefix (no AutoFreeze): ``post`` is what
    keeps training, which is what such a module does there anyway.

    Raises:
        CallOrderError: a module ran before the stack and also after it (or inside it).
    """
    entries = [*stack.pre, *stack.post]
    mixed: dict[int, list[str]] = {}
    pre: list[tuple[int, str, nn.Module]] = []
    post: list[tuple[str, nn.Module]] = []
    for path, module in entries:
        where = order.relation(module)
        if BEFORE in where and where - {BEFORE}:
            if mixed_after or not any(True for _ in module.parameters()):
                # Nothing to freeze (T5's one dropout, used on the embeddings and after the last block): it stays
                # outside the prefix, so it keeps its training mode for its use after the stack.
                post.append((path, module))
                continue
            mixed.setdefault(id(module), []).append(path)
        elif where == {BEFORE}:
            pre.append((order.first_call[id(module)], path, module))
        else:
            post.append((path, module))
    if mixed:
        names = list(mixed.values())
        listed = "; ".join(f"'{p[0]}'" + (f" (also held as {', '.join(p[1:])})" if len(p) > 1 else "") for p in names)
        before = [p for _, p, _ in sorted(pre, key=lambda e: e[0])]
        example = [*before, *names[0]]
        raise CallOrderError(
            f"{listed} runs both before the block stack '{stack.path}' and after it (or inside it): a module that "
            "feeds the first block and also what comes after (shared embeddings that a decoder or a head reads "
            "too) cannot be frozen with the prefix without freezing what runs after it. Say what runs before the "
            f"stack: AutoFreeze(pre={example!r}) freezes it with the embeddings (what runs after it then stops "
            "training too), or leave it out of that list to keep it training (the cache then stands aside)."
        )
    pre.sort(key=lambda e: e[0])
    return [(p, m) for _, p, m in pre], post


class OrderWatch:
    """Watches training steps until one runs the stack, then refines ``stack`` (for a run without AutoFreeze).

    ``start()`` before a step's forward, ``finish()`` after it (before backward): True once the order
    is known (refined here, or by someone else meanwhile). A step that ran no block (an idle AutoDP
    rank's stand-in) tells nothing: the next one is watched.

    Nothing in such a run freezes the prefix, so a module with parameters that runs both before and
    after the stack is not refused: it stays outside the prefix (it trains, or stays as the user
    froze it), and ``announce`` is told. A cache then keys on what reaches the first block, and
    stands aside while that still trains.
    """

    def __init__(self, root: nn.Module, stack: BlockStack, announce: Callable[[str], None] | None = None) -> None:
        self.root, self.stack = root, stack
        self.announce = announce
        self._observer: CallOrderObserver | None = None

    def start(self) -> None:
        if self.stack.provisional and self._observer is None:
            self._observer = CallOrderObserver(self.root, self.stack)

    def finish(self) -> bool:
        observer, self._observer = self._observer, None
        if observer is None:
            return not self.stack.provisional
        order = observer.finish()
        if not self.stack.provisional:
            return True
        if not order.saw_stack:
            return False
        pre, post = split_by_order(self.stack, order, mixed_after=True)
        feeds = [(p, m) for p, m in post if BEFORE in order.relation(m) and any(True for _ in m.parameters())]
        self.stack.refine(pre, post, feeds)
        if feeds and self.announce is not None:
            self.announce(wrap(
                f"PipeTransformer: {', '.join(p for p, _ in feeds)} run(s) both before the block stack '{self.stack.path}' "
                "and after it: kept outside the prefix (nothing in this run freezes the prefix; with AutoFreeze this is "
                "refused). A cache checks it like the prefix: it must be frozen and deterministic."
            ))  # fmt: skip
        return True

    def remove(self) -> None:
        if self._observer is not None:
            self._observer.remove()
            self._observer = None
