"""What the embeddings did in a forward: their call recorded, skipped where that is exact, and whether
their inputs name what reaches the stack.

A content key is cheapest on the embeddings' inputs (token ids: a few numbers per sample) rather than
on the hidden state they produce, but those inputs name the stack's input only if that very output,
unmodified, is what reaches the stack. :class:`EmbeddingsWatch` records the embeddings' last call
(:class:`InputRecorder`), checks at the stack that their output
arrived unchanged (identity and version counter), and, once that has been seen in a mode, lets the
:class:`~lightning_pipetransformer.cache.embedding_skip.EmbeddingSkipper` hand the model a placeholder
instead of running them on batches the cache serves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_pipetransformer.cache.embedding_skip import EmbeddingSkipper, input_versions, version_of
from lightning_pipetransformer.cache.metrics import BatchCounters
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.interception import installed_pipeline

__all__ = ["EmbeddingsWatch", "InputRecorder", "Pending"]

@dataclass(frozen=True)
class Pending:
    """The embeddings' last call, waiting for the stack: it names the stack's input only if that very
    output, unmodified, arrives there (the version counters tell)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: What the call returned (the placeholder, when the embeddings were skipped).
    output: Any
    #: The output's version counter then (``None`` under ``inference_mode``: not tracked).
    version: int | None
    #: The inputs' version counters then: an input changed in place since no longer names the output.
    inputs: tuple[int | None, ...]


class InputRecorder:
    """A forward hook on the first module before the stack: its last inputs, output and the output's version.

    The inputs stand for the hidden state only if that very output tensor, unmodified, is what
    reaches the stack (checked by identity and version counter in :meth:`EmbeddingsWatch.arrived`): a second embedding
    added to it, an in-place change, or the module called again for another input, and the
    hidden state itself is hashed instead.
    """

    def __init__(self, active: Callable[[], bool] = lambda: True) -> None:
        self.pending: Pending | None = None
        #: Whether a cached stack will take the record: otherwise nothing reads it, and keeping it would
        #: hold the previous batch's embeddings output (on the GPU) until the next forward.
        self.active = active

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self.active():
            self.pending = None
            return
        self.pending = Pending(args, kwargs, output, version_of(output), input_versions(args, kwargs))

    def take(self) -> Pending | None:
        pending, self.pending = self.pending, None
        return pending


#: Per block-stack container: the modes in which its embeddings' output was seen to reach the stack
#: unchanged (:attr:`EmbeddingsWatch.verified_modes`). That is a property of the model's code, so it outlives
#: one cache: validate/test/predict after fit build a new one, and under ``inference_mode`` (no
#: version counters) could not show it again, so they would key on the hidden state and miss fit's entries.
_VERIFIED_MODES: weakref.WeakKeyDictionary[nn.Module, set[bool]] = weakref.WeakKeyDictionary()





class EmbeddingsWatch:
    """The first module before the stack, watched for one cache.

    Args:
        owner: the cache whose cached stack takes the record (the installed runner's ``cache``).
        skip: whether to skip the embeddings on batches the cache serves.
        serves: ``serves(num_frozen)``: whether the cache serves that boundary now (enabled, store open).
        counters: where the forwards that skipped the embeddings are counted.
    """

    def __init__(self, owner: Any, skip: bool, serves: Callable[[int], bool], counters: BatchCounters) -> None:
        self._owner = owner
        self.skip = skip
        self._serves = serves
        self._counters = counters
        self.skipper: EmbeddingSkipper | None = None
        #: The modes (``scope.training``) in which the embeddings' output was seen to reach the stack
        #: as the same, unmodified tensor: skipping them is safe in those modes (a dropout between them
        #: is the identity in eval mode only).
        self.verified_modes: set[bool] = set()
        self._container: nn.Module | None = None
        self.recorder = InputRecorder(self._serving)
        self._hook: Any = None

    def attach(self, stack: BlockStack, root: nn.Module | None = None) -> None:
        """Record the inputs of the first module before the stack (cheap keys); skip it when possible.

        Only for a prefix that includes the embeddings (frozen with the first block). ``root``
        (the module the stack was found in) lets the skipper find the forward that calls both.
        """
        self.detach()
        if not stack.pre:
            return
        pre = stack.pre[0][1]
        self._container = stack.container
        # What earlier AutoCaches showed for this model (shared: what this one shows is kept too).
        self.verified_modes = _VERIFIED_MODES.setdefault(stack.container, set())
        if self.skip and root is not None:
            self.skipper = EmbeddingSkipper.for_stack(root, pre, stack.container, self._may_skip_pre)
        # Registered after the skipper's lazy forward: the recorder sees the placeholder as the output.
        self._hook = pre.register_forward_hook(self.recorder, with_kwargs=True)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.skipper is not None:
            self.skipper.detach()
            self.skipper = None

    def _serving(self) -> bool:
        """A cached stack of this cache is installed: it will take what the recorder records."""
        return self._installed_runner() is not None

    def _may_skip_pre(self) -> bool:
        """The embeddings may return a placeholder: a cached runner serves this forward's boundary."""
        if not (self._mode() in self.verified_modes and self._container is not None):
            return False
        runner = self._installed_runner()
        return runner is not None and self._serves(runner.num_frozen)

    def _installed_runner(self) -> Any:
        """The installed runner if it is this cache's cached stack, else ``None``.

        Told by its ``cache`` (the one runner that holds one), not by its class: the cached stack
        imports the cache, never the other way round.
        """
        runner = installed_pipeline(self._container) if self._container is not None else None
        return runner if getattr(runner, "cache", None) is self._owner else None

    def _mode(self) -> bool:
        """The mode the skip decision depends on: the training flag of the forward that calls the embeddings."""
        return self.skipper.scope.training if self.skipper is not None else True

    def arrived(self, hidden: Tensor) -> tuple[Any, Pending | None]:
        """At the stack: ``(skipped, pending)``, what the embeddings did in this forward.

        ``skipped`` is the skipper's record if the embeddings returned ``hidden`` as a
        placeholder (else ``None``); ``pending`` their recorded call when its inputs name
        ``hidden`` (else ``None``: the hidden state is hashed). A real output that arrives as the
        same tensor with the same version counter marks skipping as safe from the next forward
        on. Under ``inference_mode`` versions are not tracked: the inputs then name ``hidden``
        only once a tracked forward has shown that they do.
        """
        skipped = self.skipper.take(hidden) if self.skipper is not None else None
        pending = self.recorder.take()
        if skipped is not None:
            # The inputs of the very call that returned the placeholder (not whatever call came last).
            pending = Pending(skipped.args, skipped.kwargs, hidden, skipped.version, skipped.inputs)
        elif pending is not None:
            mode = self._mode()
            if pending.output is not hidden or input_versions(pending.args, pending.kwargs) != pending.inputs:
                pending = None  # another tensor, or inputs changed in place since: they do not name it
            elif pending.version is not None:
                if pending.version == hidden._version:
                    self.verified_modes.add(mode)
                else:
                    pending = None  # changed in place after the embeddings: their inputs do not name it
            elif self.verified_modes:
                # inference_mode tracks no versions: identity suffices once a tracked forward ruled out
                # in-place changes (a placeholder, a normal tensor, is still checked at the stack).
                self.verified_modes.add(mode)
            else:
                pending = None
        if skipped is not None:
            self._counters.embeddings_skipped += 1
        return skipped, pending
