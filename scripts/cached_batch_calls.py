"""The path of one cached training batch through the package: which functions run, in which files.

Builds a tiny BERT from a config (4 blocks, the first frozen with the embeddings), installs AutoCache's
runner for a plan whose active blocks form a 2-stage pipeline (K=2, M=2) on CPU, warms the store with
two batches, then traces ONE training batch (forward and backward; half of its rows hit, half miss)
under ``sys.setprofile`` and prints:

- every package function called, in the order of its first call (``file:function`` and how often);
- how many distinct functions and files that is;
- how often a call goes from one ``cache/`` file into another (the back-and-forth of the cached path).

Comprehensions count as part of the function that holds them, a generator's resumptions as its one call;
the calling file of a call is the file of the frame that made it.

Run: ``python scripts/cached_batch_calls.py``. Deterministic (fixed seeds); nothing is downloaded.
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

import lightning_pipetransformer
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.pipe.planner import Plan
from lightning_pipetransformer.runners import cached_runner
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import install_pipeline

PACKAGE = Path(lightning_pipetransformer.__file__).parent
#: Frames Python 3.11 makes for comprehensions: part of the function that holds them, not functions of their own.
_COMPREHENSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
VOCAB, SEQ, BATCH = 50, 8, 6


def tiny_bert() -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, -3:] = 0
    return ids, mask


def step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask).logits.square().sum().backward()


def trace(run) -> list[tuple[str, str, str | None]]:
    """``(file, function, calling file)`` of every call into the package while ``run()`` runs (this thread)."""
    calls: list[tuple[str, str, str | None]] = []

    def relative(filename: str) -> str | None:
        path = Path(filename)
        return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else None

    generators: dict[int, object] = {}  # generator frames already entered, kept alive so their ids stay theirs

    def profile(frame, event, arg):
        if event != "call":
            return
        here = relative(frame.f_code.co_filename)
        if here is None or frame.f_code.co_name in _COMPREHENSIONS:
            return
        if frame.f_code.co_flags & inspect.CO_GENERATOR:
            if id(frame) in generators:
                return  # a generator resumed (each next() is a "call" event): one call, not one per item
            generators[id(frame)] = frame
        caller = frame.f_back
        calls.append((here, frame.f_code.co_qualname, relative(caller.f_code.co_filename) if caller else None))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_bert().train()
    stack = find_block_stack(model)
    num_frozen = 1
    apply_freeze(stack, num_frozen, include_pre=True)
    cpu = torch.device("cpu")
    plan = Plan(num_frozen=num_frozen, pipe_len=3, chunks=2, partition=(1, 1, 2), devices=(("cpu", "cpu", "cpu"),), active_ranks=(0,))
    with tempfile.TemporaryDirectory() as directory:
        cache = AutoCache(True, directory, 10**7)
        cache.attach(stack, model)
        cache.move_boundary(stack, num_frozen, True, cpu, shard=(0, 1))
        install_pipeline(stack.container, cached_runner(cache, stack.blocks, plan, [cpu] * 3, lambda k: 2))
        first, second = batch(0), batch(1)
        step(model, *first)  # all miss; shows the embeddings' output reaches the stack
        step(model, *second)  # all miss
        # Half the rows seen before (hits), half new (misses); the first-hit check runs on a warm-up batch.
        mixed = tuple(torch.cat([a[: BATCH // 2], b[BATCH // 2 :]]) for a, b in zip(first, batch(2)))
        step(model, first[0][:2], first[1][:2])  # the one-off first-hit check, outside the traced batch
        hits_before = cache.store.stats().hits
        calls = trace(lambda: step(model, *mixed))
        hits = cache.store.stats().hits - hits_before
    assert hits == BATCH // 2, f"expected {BATCH // 2} hits in the traced batch, got {hits}"

    order: dict[str, int] = {}
    for file, function, _ in calls:
        name = f"{file}:{function}"
        order[name] = order.get(name, 0) + 1
    files = {file for file, _, _ in calls}
    crossings = sum(
        1 for file, _, caller in calls
        if caller is not None and file != caller and file.startswith("cache/") and caller.startswith("cache/")
    )
    cross_file = sum(1 for file, _, caller in calls if caller is not None and file != caller)
    cache_functions = [name for name in order if name.startswith("cache/")]
    cache_files = {file for file in files if file.startswith("cache/")}
    print(f"# one cached training batch ({BATCH} rows: {hits} hits, {BATCH - hits} misses), forward + backward")
    for name, count in order.items():
        print(f"{name}" + (f"  x{count}" if count > 1 else ""))
    print(f"distinct functions: {len(order)}")
    print(f"files: {len(files)}  ({', '.join(sorted(files))})")
    print(f"cache functions: {len(cache_functions)} in {len(cache_files)} cache files")
    print(f"calls between cache files: {crossings}")
    pairs: dict[str, int] = {}
    for file, _, caller in calls:
        if caller is not None and file != caller and file.startswith("cache/") and caller.startswith("cache/"):
            pair = f"{caller} -> {file}"
            pairs[pair] = pairs.get(pair, 0) + 1
    for pair, count in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {pair}: {count}")
    print(f"calls between package files: {cross_file}")
    into_tree = sum(1 for file, _, caller in calls if caller is not None and file != caller and file == "tree.py")
    print(f"  of those, into tree.py (the one walker of nested arguments): {into_tree}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
