"""The strategy's and the cache's arguments, as frozen dataclasses validated on construction.

Why a dataclass and not attributes on the strategy: every part below the strategy (the engine,
the cache hooks, the data checks) reads the settings it needs from one immutable object that
was checked once, before any process starts (the Trainer builds the strategy in the launching
process), so no part can see a half-validated or later-edited value. The field docstrings are the
reference: ``docs/configuration.md`` is generated from them (:func:`argument_table`, checked by
``tests/unit/test_config.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from datetime import timedelta
from typing import Literal

__all__ = [
    "CACHE_ARGUMENT", "LIGHTNING_ARGUMENTS", "CacheConfig", "PipeTransformerConfig", "argument_docstring", "argument_table",
    "check_lightning_arguments", "strategy_arguments",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """AutoCache's arguments (``PipeTransformerStrategy(cache=..., cache_key=..., ...)``)."""

    mode: bool | Literal["auto"] = False
    """AutoCache: `True` serves the frozen prefix from the activation cache whenever blocks are
    frozen; `"auto"` does so only while a lookup is measured faster than the frozen prefix;
    `False` never. See [cache.md](cache.md)."""

    key: Literal["content", "index"] = "content"
    """`"content"`: a 128-bit fingerprint of each sample's input to the frozen prefix. This is
    exact: an augmented or masked input just misses. `"index"`: the `index` entry of a dict
    batch. This is the paper's choice and is faster, for inputs that are the same every epoch: a
    probed sample whose input changed (random augmentation or masking) stops the run before its
    first view's activations are served (`InputChanged`)."""

    dir: str | None = None
    """node-local directory for entries beyond the memory budget; default
    `<default_root_dir>/pipetransformer_cache`. Checked by writing to it before training starts."""

    memory: int = 4 * 2**30
    """host bytes for cached entries in memory, for the whole node: each of its processes keeps
    `cache_memory / processes per node`; the rest spills to `cache_dir` (shared by the node)."""

    skip_embeddings: bool = True
    """on batches the cache serves, skip the embeddings as well (they return a NaN placeholder
    the blocks never read; the real embeddings run only for misses). Armed only once their
    output was seen to reach the blocks unchanged; a model where it does not raises with this
    option named. See [cache.md](cache.md#skipping-the-embeddings-too)."""

    frozen_eval: bool = False
    """keep the frozen prefix (frozen blocks and frozen modules before them) in eval mode while the
    cache is on, so that a prefix frozen by something that leaves it in train mode (Lightning's
    `BaseFinetuning`, a `requires_grad_(False)` of your own) can be served. This changes training:
    the frozen part then runs without dropout, where a plain run keeps its dropout (AutoFreeze puts
    what it freezes in eval mode itself). Without it such a prefix is refused before the first
    optimizer step, naming the modules. See [cache.md](cache.md#validity-by-observation)."""

    keep: bool = False
    """keep the entries in `cache_dir` after the run, for later runs: a sweep (seeds, learning
    rates, heads) over the same frozen prefix pays for it once. Every entry is then also written
    to disk, boundary moves keep the earlier boundaries' folders, and a later run reuses only
    entries computed by the same thing (the prefix's weights, buffers, code, configuration, dtype,
    device kind, the entry format, the sample's content), from its first step. Needs `cache_dir`
    (where gigabytes may go is yours to name); content keys only (index keys stay per run). See
    [cache.md](cache.md#kept-entries-a-sweep-pays-once)."""

    keep_bytes: int = 32 * 2**30
    """the most bytes of entries `cache_dir` keeps with `cache_keep=True`: when a boundary opens
    and when the fit ends, the folders of least recent use go first, never one another live run
    holds. Clear by hand with `python -m lightning_pipetransformer.cache clear DIR`."""

    def __post_init__(self) -> None:
        if self.mode not in (False, True, "auto") or (self.mode != "auto" and not isinstance(self.mode, bool)):
            raise ValueError(f"cache must be False, True or 'auto', got {self.mode!r}.")
        if self.key not in ("content", "index"):
            raise ValueError(f"cache_key must be 'content' or 'index', got {self.key!r}.")
        if isinstance(self.memory, bool) or not isinstance(self.memory, int) or self.memory < 0:
            raise ValueError(f"cache_memory must be a number of bytes >= 0 (0: everything on disk), got {self.memory!r}.")
        if self.dir is not None and not isinstance(self.dir, str):
            raise ValueError(f"cache_dir must be a path (str) or None, got {type(self.dir).__name__}.")
        object.__setattr__(self, "skip_embeddings", bool(self.skip_embeddings))
        if not isinstance(self.frozen_eval, bool):
            raise ValueError(f"cache_frozen_eval must be True or False, got {self.frozen_eval!r}.")
        if not isinstance(self.keep, bool):
            raise ValueError(f"cache_keep must be True or False, got {self.keep!r}.")
        if isinstance(self.keep_bytes, bool) or not isinstance(self.keep_bytes, int) or self.keep_bytes <= 0:
            raise ValueError(f"cache_keep_bytes must be a positive number of bytes, got {self.keep_bytes!r}.")
        if self.keep and self.dir is None:
            raise ValueError(
                "cache_keep=True needs cache_dir: name the folder every run of the sweep shares (kept entries can take "
                "gigabytes, so where they go is yours to choose; the default folder is per run and removed when empty)."
            )

    @property
    def enabled(self) -> bool:
        """Whether AutoCache is used at all (``True`` or ``"auto"``)."""
        return bool(self.mode)


@dataclasses.dataclass(frozen=True)
class PipeTransformerConfig:
    """The pipeline strategy's arguments (``PipeTransformerStrategy(pipe_len=..., ...)``)."""

    pipe_len: int = 1
    """initial pipeline length K0. With `devices=1` the K stages are virtual (all on the one
    device: the CPU, or streams of one GPU). With `devices=G`, K must divide G: G/K processes
    per node start as pipeline replicas and the others wait until the pipeline shrinks (AutoDP)."""

    chunks: int | Literal["auto"] = 1
    """micro-batches M per mini-batch: an int, or `"auto"`, which times M in K..6K on the first
    real batch of each new K (the choice is kept in checkpoints)."""

    frozen_cost: float = 1 / 6
    """weight of a frozen block relative to an active one when partitioning and compressing."""

    layers: str | None = None
    """the block container's attribute path (a string, e.g. `"model.bert.encoder.layer"`).
    Default: AutoFreeze's stack when AutoFreeze is used, else `configure_block_stack()`, else
    discovery."""

    process_group_backend: str | None = None
    """`"nccl"` or `"gloo"`; by default chosen from the device type."""

    timeout: float = 1800.0
    """seconds before any collective gives up, on every process group the strategy creates, so a
    dead rank ends the run with an error instead of a hang. A `datetime.timedelta` works too (as
    for Lightning's `DDPStrategy`); it is kept as seconds."""

    batch_policy: Literal["replica", "global"] = "replica"
    """with several processes: `"replica"` keeps each replica's batch (the paper's choice: the
    global batch grows with the replicas); `"global"` keeps the global batch (the DataLoader's
    batch size is split over the replicas, so the run is the same optimisation as on one
    device). See [autodp.md](autodp.md)."""

    self_check: bool = True
    """on the first training batch after each plan is put in force, compare what the pipeline or
    the cache gives the model with a plain run of the same blocks (output structure, shapes,
    values, how often hooks on the blocks fired) and raise before the optimizer step if they
    differ. Costs one forward pass of the stack without gradients on that batch (about a third of
    a training step). See [user-guide.md](user-guide.md#the-first-batch-self-check)."""

    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    """AutoCache's arguments (the strategy's ``cache*`` arguments)."""

    def __post_init__(self) -> None:
        if isinstance(self.pipe_len, bool) or not isinstance(self.pipe_len, int) or self.pipe_len < 1:
            raise ValueError(f"pipe_len must be a positive int (stages per pipeline), got {self.pipe_len!r}.")
        if self.chunks != "auto" and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1):
            raise ValueError(f"chunks must be a positive int or 'auto', got {self.chunks!r}.")
        try:
            frozen_cost = float(self.frozen_cost)
        except (TypeError, ValueError):
            frozen_cost = float("nan")
        if not 0.0 <= frozen_cost <= 1.0:
            raise ValueError(f"frozen_cost must be in [0, 1] (paper: 1/6), got {self.frozen_cost!r}.")
        object.__setattr__(self, "frozen_cost", frozen_cost)
        try:
            timeout = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else float(self.timeout)
        except (TypeError, ValueError):
            timeout = float("nan")
        if isinstance(self.timeout, bool) or not timeout > 0 or timeout == float("inf"):
            raise ValueError(f"timeout must be a positive number of seconds or a datetime.timedelta, got {self.timeout!r}.")
        object.__setattr__(self, "timeout", timeout)
        if self.batch_policy not in ("replica", "global"):
            raise ValueError(f"batch_policy must be 'replica' or 'global', got {self.batch_policy!r}.")
        if self.layers is not None and not isinstance(self.layers, str):
            raise ValueError(f"layers must be an attribute path such as 'model.encoder.layer', got {self.layers!r}.")
        if not isinstance(self.self_check, bool):
            raise ValueError(f"self_check must be True or False, got {self.self_check!r}.")
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, got {type(self.cache).__name__}.")

    @classmethod
    def from_arguments(cls, arguments: dict[str, object]) -> PipeTransformerConfig:
        """The config of the strategy's flat keyword arguments (:func:`strategy_arguments`: ``cache_key`` is the cache config's ``key``)."""
        cache = {field: arguments[name] for field, name in CACHE_ARGUMENT.items() if name in arguments}
        own = {name: value for name, value in arguments.items() if name not in CACHE_ARGUMENT.values()}
        return cls(**own, cache=CacheConfig(**cache))  # type: ignore[arg-type]

    @property
    def pipelines_or_caches(self) -> bool:
        """Whether the stack runs other than as the model wrote it (a pipeline, micro-batches or the cache)."""
        return self.pipe_len > 1 or self.chunks != 1 or self.cache.enabled

    def asks_for_a_stack(self) -> list[str]:
        """The arguments that need a block stack (a model without one is then an error that names them)."""
        c = self
        asked = (
            (f"pipe_len={c.pipe_len}", c.pipe_len > 1), (f"chunks={c.chunks!r}", c.chunks != 1),
            (f"cache={c.cache.mode!r}", c.cache.enabled), (f"layers={c.layers!r}", c.layers is not None),
        )  # fmt: skip
        return [what for what, on in asked if on]


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right below it in the class body)."""
    source = inspect.getsource(cls)
    found = re.findall(r"^    (\w+): [^\n]*\n    \"\"\"(.*?)\"\"\"", source, flags=re.S | re.M)
    return {name: " ".join(text.split()) for name, text in found}


#: The strategy's argument for each cache field (the strategy keeps Lightning-style flat keywords).
CACHE_ARGUMENT = {
    "mode": "cache", "key": "cache_key", "dir": "cache_dir", "memory": "cache_memory", "skip_embeddings": "cache_skip_embeddings",
    "frozen_eval": "cache_frozen_eval", "keep": "cache_keep", "keep_bytes": "cache_keep_bytes",
}


def strategy_arguments() -> list[str]:
    """The strategy's own keyword arguments, from the fields: the config's, then the cache's under their ``cache*`` names."""
    own = [field.name for field in dataclasses.fields(PipeTransformerConfig) if field.name != "cache"]
    return own + [CACHE_ARGUMENT[field.name] for field in dataclasses.fields(CacheConfig)]


#: Lightning's arguments of a ParallelStrategy, which the Trainer fills in after construction.
LIGHTNING_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def check_lightning_arguments(given: dict[str, object]) -> dict[str, object]:
    """The keyword arguments beyond the strategy's own: Lightning's, or an error that lists every argument there is."""
    unknown = sorted(set(given) - set(LIGHTNING_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"PipeTransformerStrategy got unexpected argument(s) {unknown}. Its arguments: {', '.join(strategy_arguments())}, "
            f"and Lightning's {', '.join(LIGHTNING_ARGUMENTS)}."
        )
    return dict(given)


def argument_docstring(indent: str = "        ", width: int = 100) -> str:
    """The strategy's ``Args:`` entries, from the fields' docstrings (the class docstring's; LightningCLI's help reads it)."""
    rows = [(name, doc, default) for cls, rename in _ARGUMENT_CLASSES for name, doc, default in _arguments_of(cls, rename)]
    entries = [textwrap.fill(f"{name}: {doc} Default: {default}.", width, initial_indent=indent, subsequent_indent=indent + "    ")
               for name, doc, default in rows]  # fmt: skip
    return "\n".join(entries)


#: The classes whose fields are the strategy's arguments, and the argument name of each field (the cache's are ``cache*``).
_ARGUMENT_CLASSES: tuple[tuple[type, dict[str, str]], ...] = ((PipeTransformerConfig, {}), (CacheConfig, CACHE_ARGUMENT))


def _arguments_of(cls: type, rename: dict[str, str]) -> list[tuple[str, str, str]]:
    """(argument, its docstring, its default as shown to people) for each field of ``cls`` that is an argument."""
    docs, rows = _field_docs(cls), []
    for field in dataclasses.fields(cls):
        if field.name == "cache" and cls is PipeTransformerConfig:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        shown = {"memory": "4 GiB", "keep_bytes": "32 GiB", "frozen_cost": "1/6"}.get(field.name)
        rows.append((rename.get(field.name, field.name), docs[field.name], shown or (f'"{default}"' if isinstance(default, str) else repr(default))))
    return rows


def argument_table() -> str:
    """The strategy's arguments as a markdown table, from the fields' docstrings (docs/configuration.md)."""
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for cls, rename in _ARGUMENT_CLASSES:
        rows += [f"| `{name}` | `{default}` | {doc} |" for name, doc, default in _arguments_of(cls, rename)]
    return "\n".join(rows)


def write_docs(path: str = "docs/configuration.md") -> None:
    """Put :func:`argument_table` between the ``config`` markers of ``path`` (run from the repository root)."""
    from pathlib import Path

    file = Path(path)
    text = file.read_text()
    begin, end = "<!-- config:begin -->\n", "<!-- config:end -->"
    head, rest = text.split(begin, 1)
    file.write_text(head + begin + argument_table() + "\n" + end + rest.split(end, 1)[1])
