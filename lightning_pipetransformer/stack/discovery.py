"""Block-stack discovery: find a model's stack of repeated blocks and what runs before and after it.

PipeTransformer freezes a model bottom-up, one Transformer block at a time, and pipelines the
blocks that stay active. Both need the same picture of the model::

    pre (embeddings, patch embedding, cls token ...)
      -> blocks[0] -> blocks[1] -> ... -> blocks[L-1]     (an nn.ModuleList or nn.Sequential)
    post (pooler, final norm, classifier head ...)

Discovery finds the largest ``nn.ModuleList`` / ``nn.Sequential`` whose children are two or more
modules of one class (BERT-family ``encoder.layer``, ViT-family ``encoder.layer``, timm's
``blocks``, ``nn.TransformerEncoder.layers``), preferring containers whose blocks have trainable
parameters (a frozen teacher next to its student is not the stack that trains), or takes an
explicit attribute path. What comes
*before* the stack is read from registration order along the path from the root to the stack:
at each ancestor, children registered before the branch that leads to the stack are ``pre``
(plus parameters held directly by an ancestor, such as timm's ``cls_token``), children
registered after it are ``post``. That split is *provisional*: registration order is not call
order (transformers 5.x ``XLMRobertaForSequenceClassification`` registers its ``classifier``
before ``roberta``; MPNet registers the ``relative_attention_bias`` it computes before the layers
after them; BART's ``layernorm_embedding`` runs before the encoder's layers and is registered
after). :mod:`lightning_pipetransformer.stack.execution` observes the first training forward and
:meth:`BlockStack.refine` puts each module where it runs, in place, so every holder of the stack
(AutoFreeze, the engine, the cache) sees the same picture. An explicit ``pre`` is taken as given.

This module has no Lightning imports: the callback and the strategy both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from lightning_pipetransformer.stack.shared_depth import find_shared_depth, shared_depth, shared_depth_message
from lightning_pipetransformer.terminal import names

__all__ = [
    "BlockStack",
    "BlockStackError",
    "Candidate",
    "find_block_stack",
    "find_candidates",
    "resolve_block_stack",
]

# A second candidate holding at least this fraction of the best one's parameters makes the
# choice ambiguous (an encoder-decoder model has two stacks of similar size, for example).
_AMBIGUITY_RATIO = 0.5


class BlockStackError(ValueError):
    """No usable block stack, or more than one equally plausible one."""


@dataclass(frozen=True)
class Candidate:
    """A container of repeated blocks found in a model."""

    path: str
    container: nn.Module
    block_type: str
    num_blocks: int
    num_params: int
    #: Parameters that require grad (a frozen teacher's stack has none).
    num_trainable: int = 0

    def describe(self) -> str:
        frozen = "" if self.num_trainable else ", none trainable"
        return f"'{self.path}' ({self.num_blocks} x {self.block_type}, {self.num_params:,} parameters{frozen})"


@dataclass(frozen=True)
class BlockStack:
    """The model's repeated blocks and the modules that run before and after them.

    Attributes:
        path: attribute path of the container, relative to the root it was found in.
        container: the ``nn.ModuleList`` / ``nn.Sequential`` (or other iterable module) itself.
        pre: ``(path, module)`` pairs that run before the first block (embeddings, ...).
        pre_params: ``(path, parameter)`` pairs held directly by an ancestor of the stack, read
            as inputs of the first block (timm's ``cls_token`` and ``pos_embed``).
        post: ``(path, module)`` pairs that run after the last block (pooler, norm, head).
        feeds: those of ``post`` with parameters that also run before the first block (observed
            without AutoFreeze, which would refuse them): they stay outside the prefix, yet what they
            compute reaches the frozen blocks, so a cache must check them like the prefix.
        order: where ``pre``/``post`` come from: ``"declared"`` (given by the user: taken as is),
            ``"registration"`` (discovery's provisional split, until the first forward is
            observed) or ``"observed"`` (the model's call order, :meth:`refine`).
    """

    path: str
    container: nn.Module
    pre: tuple[tuple[str, nn.Module], ...] = ()
    pre_params: tuple[tuple[str, nn.Parameter], ...] = ()
    post: tuple[tuple[str, nn.Module], ...] = field(default=())
    order: Literal["declared", "registration", "observed"] = "declared"
    feeds: tuple[tuple[str, nn.Module], ...] = ()
    _listeners: list[Callable[[], None]] = field(default_factory=list, compare=False, repr=False)

    @property
    def provisional(self) -> bool:
        """Whether ``pre``/``post`` still come from registration order (the call order is not known yet)."""
        return self.order == "registration"

    def refine(
        self, pre: Sequence[tuple[str, nn.Module]], post: Sequence[tuple[str, nn.Module]],
        feeds: Sequence[tuple[str, nn.Module]] = (),
    ) -> None:
        """Put the modules where the model runs them (observed), in place, and tell the listeners.

        In place because the engine, the cache and AutoFreeze hold this very object since set-up; the
        listeners (:meth:`when_refined`) move what they hooked on the old ``pre`` (the cache's key recorder).
        """
        object.__setattr__(self, "pre", tuple(pre))
        object.__setattr__(self, "post", tuple(post))
        object.__setattr__(self, "feeds", tuple(feeds))
        object.__setattr__(self, "order", "observed")
        for listener in list(self._listeners):
            listener()

    def when_refined(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every :meth:`refine` (registered once)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.container.children())

    def __len__(self) -> int:
        return len(self.blocks)

    def describe(self, limit: int | None = None) -> str:
        """The stack in words: its blocks, where they are, and what runs before and after them.

        ``limit``: name at most that many modules on each side and count the rest, for the one line
        an ordinary run prints (a model's head, dropout and metrics after the stack make a list of
        200 columns otherwise); ``None``: every module, for errors and the DEBUG log.
        """
        pre, post = ([p for p, _ in side] for side in (self.pre, self.post))
        kinds = sorted({type(b).__name__ for b in self.blocks})
        if limit is None:
            listed = f"before: {', '.join(pre) or 'nothing'}; after: {', '.join(post) or 'nothing'}"
            provisional = ", by registration order until the first training forward shows the call order"
        else:
            listed = f"before: {names(pre, limit)}; after: {names(post, limit)}"
            provisional = ", until the first forward shows the call order"
        return f"{len(self)} x {'/'.join(kinds)} at '{self.path}' ({listed}{provisional if self.provisional else ''})"


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_candidates(root: nn.Module) -> list[Candidate]:
    """All containers of two or more same-class, parameterised blocks, largest first.

    A container nested inside a block of another candidate is dropped: the outer stack is the
    one that repeats (a Sequential of identical sub-layers inside each block is not a stack).
    """
    found: list[Candidate] = []
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        # Every position, a module held at several of them included (refused later, by name).
        children = [c for c in module._modules.values() if c is not None]
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        n = _num_params(module)
        if n == 0:
            continue
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        found.append(Candidate(path, module, type(children[0]).__name__, len(children), n, trainable))
    outer = [c for c in found if not any(c.path.startswith(o.path + ".") for o in found if o is not c)]
    return sorted(outer, key=lambda c: (-c.num_params, c.path))


def _get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        module = root.get_submodule(path)
    except AttributeError as err:
        found = find_candidates(root)
        hint = (
            "Stacks of repeated blocks in it: " + "; ".join(c.describe() for c in found[:3]) + "."
            if found else "Give the attribute path of the block container, e.g. layers='model.bert.encoder.layer'."
        )
        raise BlockStackError(
            f"'{path}' does not name a submodule of {type(root).__name__} (paths are relative to it): {err}. {hint}"
        ) from None
    return module


def _split_around(root: nn.Module, path: str) -> tuple[list, list, list]:
    """Modules before / after the stack along the root-to-stack path, by registration order."""
    pre: list[tuple[str, nn.Module]] = []
    pre_params: list[tuple[str, nn.Parameter]] = []
    post_levels: list[list[tuple[str, nn.Module]]] = []
    parts = path.split(".") if path else []
    node, prefix = root, ""
    for part in parts:
        names = list(node._modules.keys())
        where = names.index(part)
        for name in names[:where]:
            if node._modules[name] is not None:
                pre.append((prefix + name, node._modules[name]))
        post_levels.append(
            [(prefix + name, node._modules[name]) for name in names[where + 1 :] if node._modules[name] is not None]
        )
        for name, param in node._parameters.items():
            if param is not None:
                pre_params.append((prefix + name, param))
        node = node._modules[part]
        prefix += part + "."
    # Deeper levels run first after the stack (the pooler before the classifier head).
    post = [item for level in reversed(post_levels) for item in level]
    return pre, pre_params, post


def _shared_positions(container: nn.Module) -> list[str]:
    """Where the container's positions share a module or a parameter, in words (empty: none do).

    ``container.children()`` (and so :attr:`BlockStack.blocks`) lists a module once however many
    positions hold it, while the model's loop runs every position: ``nn.ModuleList([A, A, B, B])``
    would be seen as 2 blocks and run as 4.
    """
    positions = [(name, m) for name, m in container._modules.items() if m is not None]
    found: list[str] = []
    first_at: dict[int, str] = {}
    for name, module in positions:
        if id(module) in first_at:
            found.append(f"positions {first_at[id(module)]} and {name} are the same {type(module).__name__}")
        else:
            first_at[id(module)] = name
    if found:
        return found
    owner: dict[int, tuple[str, str]] = {}
    for name, module in positions:
        for param_name, param in module.named_parameters():
            other = owner.setdefault(id(param), (name, param_name))
            if other[0] != name:
                found.append(f"positions {other[0]} and {name} share the parameter {other[1]} (tied weights)")
                break
    return found


def _refuse_shared(path: str, container: nn.Module) -> None:
    """Raise :class:`BlockStackError` if blocks of the container are shared or tied (ALBERT-style)."""
    shared = _shared_positions(container)
    if shared:
        listed = "; ".join(shared[:3]) + (f"; and {len(shared) - 3} more" if len(shared) > 3 else "")
        raise BlockStackError(
            f"The block stack '{path}' ({type(container).__name__} of {len(container._modules)}) has shared blocks: "
            f"{listed}. Shared (tied) blocks cannot be frozen or pipelined one position at a time: freezing one "
            "position would freeze the others holding the same weights, and a pipeline would put one module on "
            "several stages. Give every position its own copy (e.g. nn.ModuleList(copy.deepcopy(b) for b in "
            "container)) if that is the model you want, or train this model without AutoFreeze and "
            "PipeTransformerStrategy."
        )


def _stack_at(root: nn.Module, path: str, pre: Sequence[str] | None) -> BlockStack:
    container = _get_submodule(root, path)
    if len(list(container.children())) < 1:
        raise BlockStackError(f"'{path}' holds no blocks; point `layers` at the container of the repeated blocks.")
    _refuse_shared(path, container)
    shared = shared_depth(container, path)
    if shared is not None and shared.groups == 1:  # one block, every depth: nothing to freeze block by block
        raise BlockStackError(shared_depth_message(shared))
    found_pre, pre_params, post = _split_around(root, path)
    if pre is not None:
        chosen = {p: _get_submodule(root, p) for p in pre}
        post = [(p, m) for p, m in post + found_pre if p not in chosen]
        found_pre = list(chosen.items())
    order = "declared" if pre is not None else "registration"
    return BlockStack(path, container, tuple(found_pre), tuple(pre_params), tuple(post), order)


def find_block_stack(root: nn.Module, layers: str | None = None, pre: Sequence[str] | None = None) -> BlockStack:
    """Find the block stack of ``root``, or take the one named by ``layers``.

    Args:
        root: the model (a LightningModule is fine: paths are then relative to it).
        layers: attribute path of the block container, e.g. ``"model.bert.encoder.layer"``;
            ``None`` searches for it.
        pre: attribute paths of the modules that run before the blocks, taken as given (no
            observation); everything else along the path is ``post``. ``None``: the registration
            split, refined from the first training forward (see the module docstring).

    Raises:
        BlockStackError: no candidate, or two comparable candidates (the message names them
            and how to choose).
    """
    if layers is not None:
        return _stack_at(root, layers, pre)
    candidates = find_candidates(root)
    if not candidates:
        shared = find_shared_depth(root)
        if shared is not None:
            raise BlockStackError(shared_depth_message(shared))
        raise BlockStackError(
            f"No stack of repeated blocks found in {type(root).__name__}: looked for an nn.ModuleList or "
            "nn.Sequential of two or more modules of the same class with parameters. Name the container "
            "explicitly, e.g. AutoFreeze(layers='model.encoder.layer'), or define "
            "`configure_block_stack(self)` on your LightningModule returning that path."
        )
    # A module holding several transformers (distillation: a frozen teacher and a student) trains the
    # one whose blocks have trainable parameters: that is the stack to freeze and pipeline.
    trainable = [c for c in candidates if c.num_trainable]
    if trainable and len(trainable) < len(candidates):
        candidates = trainable
    best = candidates[0]
    rivals = [c for c in candidates[1:] if c.num_params >= _AMBIGUITY_RATIO * best.num_params]
    if rivals:
        listed = "; ".join(c.describe() for c in [best, *rivals])
        raise BlockStackError(
            f"Found more than one plausible block stack in {type(root).__name__}: {listed}. "
            f"Choose one with layers='<path>' (e.g. layers='{best.path}')."
        )
    return _stack_at(root, best.path, pre)


def resolve_block_stack(root: nn.Module, spec: str | BlockStack | nn.Module | None = None) -> BlockStack:
    """Turn what a user passed as ``layers`` into a :class:`BlockStack`.

    ``spec`` may be ``None`` (search), an attribute path, the container module itself, or a
    ready :class:`BlockStack`.
    """
    if spec is None or isinstance(spec, str):
        return find_block_stack(root, spec)
    if isinstance(spec, BlockStack):
        _refuse_shared(spec.path, spec.container)
        return spec
    if isinstance(spec, nn.Module):
        for path, module in root.named_modules():
            if module is spec:
                return _stack_at(root, path, None)
        raise BlockStackError(f"The module passed as `layers` ({type(spec).__name__}) is not part of {type(root).__name__}.")
    raise BlockStackError(
        f"`layers` must be None, an attribute path string, a module or a BlockStack; got {type(spec).__name__}."
    )

