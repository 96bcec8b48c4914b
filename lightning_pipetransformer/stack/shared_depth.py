"""Layers shared across depth (ALBERT): one module the model calls at several depths of one pass.

ALBERT's encoder holds ``num_hidden_groups`` layer groups in ``albert_layer_groups`` and calls
them ``num_hidden_layers`` times per pass, group ``int(i / (layers / groups))`` at depth ``i``:
with the default ``num_hidden_groups=1`` one group is every layer. Discovery sees a container of
one module (no stack), or of a few groups each called several times in a row. Neither is a stack
of distinct blocks: freezing the one group freezes every depth at once, and the pipeline and the
cache take over a pass by each block's *one* call. The model's loop is not readable, so the
sharing is read from the config the layers hold (``num_hidden_groups < num_hidden_layers``,
ALBERT's convention) and the container's length; the refusal says so before training.

No Lightning imports, and no :class:`~.discovery.BlockStackError` (discovery imports this module):
the callers raise it with the words from :func:`shared_depth_message`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["SharedDepth", "find_shared_depth", "shared_depth", "shared_depth_message"]


@dataclass(frozen=True)
class SharedDepth:
    """A container of ``groups`` layer groups that the model calls ``depth`` times per pass."""

    path: str
    groups: int
    depth: int


def shared_depth(container: nn.Module, path: str = "") -> SharedDepth | None:
    """The sharing of ``container`` (at ``path``), when its layers' config says it is a list of shared groups."""
    if not isinstance(container, nn.ModuleList):
        return None
    for module in container.modules():
        config = getattr(module, "config", None)
        groups, depth = getattr(config, "num_hidden_groups", None), getattr(config, "num_hidden_layers", None)
        if isinstance(groups, int) and isinstance(depth, int) and 0 < groups < depth and groups == len(container):
            return SharedDepth(path, groups, depth)
    return None


def find_shared_depth(root: nn.Module) -> SharedDepth | None:
    """The first container in ``root`` (outermost first) whose groups are shared across depth, if any."""
    for path, module in root.named_modules():
        found = shared_depth(module, path)
        if found is not None:
            return found
    return None


def shared_depth_message(found: SharedDepth, asked: str = "") -> str:
    """Why ``found`` cannot be frozen block by block, pipelined or cached, and what the user can do.

    ``asked``: the strategy's arguments that need a stack (``"pipe_len=2"``); empty for AutoFreeze.
    """
    owner = found.path.rpartition(".")[0] or "the model"
    shared = f"(config.num_hidden_groups={found.groups} < num_hidden_layers={found.depth}: weights shared across depth)"
    prefix = f"{asked}: " if asked else ""
    if found.groups == 1:
        return (
            f"{prefix}ALBERT's encoder '{owner}' calls one layer group ('{found.path}.0') {found.depth} times {shared}: "
            "there is no stack of distinct blocks to freeze or pipeline. Freezing the group would freeze every depth at "
            "once, and the pipeline and the cache need each block called once per pass. Train it without AutoFreeze "
            "(freeze by hand what should stay fixed, e.g. the embeddings with requires_grad_(False) before fit) and "
            "without pipe_len/cache (strategy='auto', or PipeTransformerStrategy(pipe_len=1, cache=False), which trains "
            "the model as written); or build it with num_hidden_groups=num_hidden_layers to give each depth its own layer."
        )
    return (
        f"{prefix}ALBERT's encoder '{owner}' calls its {found.groups} layer groups ('{found.path}') {found.depth} times "
        f"per pass, each several times in a row {shared}: the pipeline and the cache need each block called once per "
        "pass. Use pipe_len=1 and cache=False (AutoFreeze alone freezes whole groups: each the depths that share it), "
        "or build the model with num_hidden_groups=num_hidden_layers to give each depth its own layer."
    )
