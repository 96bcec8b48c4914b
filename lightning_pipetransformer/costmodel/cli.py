"""``python -m lightning_pipetransformer.costmodel`` (also ``.plan``): predict PipeTransformer's multi-GPU speed-up.

Simulates a run epoch by epoch for the baseline (GPipe + DDP) and PipeTransformer with its
components switched on one by one, and prints the plan sequence and speed-ups::

    python -m lightning_pipetransformer.costmodel --preset paper-vit-b16-imagenet
    python -m lightning_pipetransformer.costmodel --preset paper-vit-b16-imagenet --json
    python -m lightning_pipetransformer.costmodel --preset paper-vit-b16-imagenet --nodes 4 --alpha 0.25 --plot out.png

The Python API is :func:`simulate` (from :mod:`lightning_pipetransformer.costmodel.simulator`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from lightning_pipetransformer.costmodel.presets import PRESETS, get_preset
from lightning_pipetransformer.costmodel.simulator import Report, simulate

__all__ = ["main", "simulate", "format_table", "plot_report"]

GB = 1e9


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_pipetransformer.costmodel",
        description="Predict the speed-up of PipeTransformer (freeze, AutoPipe, AutoDP, AutoCache) "
        "over GPipe + DDP with a cost model. Start from a preset and override what differs.",
    )
    p.add_argument("--preset", default="paper-vit-b16-imagenet", choices=sorted(PRESETS))
    p.add_argument("--list-presets", action="store_true", help="describe the presets and exit")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write per-epoch throughput and speed-ups to a PNG")
    g = p.add_argument_group("cluster overrides")
    g.add_argument("--nodes", type=int)
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--intra-bw", type=float, metavar="GB/s", help="GPU-GPU bandwidth inside a node")
    g.add_argument("--inter-bw", type=float, metavar="GB/s", help="network bandwidth per node")
    g.add_argument("--cache-bw", type=float, metavar="GB/s", help="cache read rate per process")
    t = p.add_argument_group("training overrides")
    t.add_argument("--epochs", type=int)
    t.add_argument("--batch-size", type=int, help="samples per pipeline per step")
    t.add_argument("--pipe-len", type=int, help="initial pipeline length K")
    t.add_argument("--micro-batches", help="an integer, or 'auto' for the predicted best M per K")
    t.add_argument("--alpha", type=float, help="geometric freeze schedule F(e)=ceil(L(1-(1-alpha)^e))")
    t.add_argument("--frozen", help="explicit frozen blocks per epoch, comma-separated, e.g. 0,4,7,9")
    t.add_argument("--min-active", type=int, help="blocks that never freeze, as AutoFreeze(min_active=...)")
    t.add_argument("--dataset-size", type=int)
    t.add_argument("--cache-hit-rate", type=float)
    t.add_argument("--partition", choices=("optimal", "paper-greedy"))
    return p


def _configure(args: argparse.Namespace):  # -> (ModelCost, Cluster, Training)
    preset = get_preset(args.preset)
    cluster_kw = {
        k: v
        for k, v in dict(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            intra_node_bw=args.intra_bw and args.intra_bw * GB,
            inter_node_bw=args.inter_bw and args.inter_bw * GB,
            cache_read_bw=args.cache_bw and args.cache_bw * GB,
        ).items()
        if v is not None
    }
    train_kw: dict = {
        k: v
        for k, v in dict(
            epochs=args.epochs,
            batch_size=args.batch_size,
            pipe_len=args.pipe_len,
            dataset_size=args.dataset_size,
            cache_hit_rate=args.cache_hit_rate,
            partition=args.partition,
            min_active=args.min_active,
        ).items()
        if v is not None
    }
    if args.micro_batches is not None:
        train_kw["micro_batches"] = "auto" if args.micro_batches == "auto" else int(args.micro_batches)
    if args.alpha is not None and args.frozen is not None:
        raise ValueError("Give --alpha or --frozen, not both.")
    if args.alpha is not None:
        train_kw.update(alpha=args.alpha, frozen=None)
    if args.frozen is not None:
        train_kw.update(frozen=tuple(int(x) for x in args.frozen.split(",") if x.strip()), alpha=None)
    return preset.model, replace(preset.cluster, **cluster_kw), replace(preset.train, **train_kw)


def format_table(report: Report) -> str:
    """Speed-ups, total hours and the plan sequence (F/K/M/R per epoch, 'c' = cache on)."""
    lines = [f"{'variant':<20} {'speedup':>7} {'hours':>7}  plan per epoch: F/K/M/R (c = cached), samples/s"]
    for name, v in report.variants.items():
        lines.append(f"{name:<20} {v.speedup:>6.2f}x {v.total_s / 3600:>7.2f}")
        lines.append(
            "    "
            + "  ".join(
                f"{e.frozen}/{e.pipe_len}/{e.micro_batches}/{e.replicas}{'c' if e.cached else ''}:{e.throughput:.0f}"
                for e in v.epochs
            )
        )
    return "\n".join(lines)


def plot_report(report: Report, path: str, title: str = "") -> None:
    """Per-epoch throughput and the speed-up bars, like the paper's Fig. 9."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "--plot needs matplotlib: pip install 'lightning-pipetransformer[plot]' (or pip install matplotlib)."
        ) from err
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, v in report.variants.items():
        a.plot([e.epoch for e in v.epochs], [e.throughput for e in v.epochs], marker="o", label=name)
    a.set_xlabel("epoch")
    a.set_ylabel("samples / s (cluster)")
    a.legend(fontsize=8)
    names = list(report.variants)
    bars = b.bar(names, [report.variants[n].speedup for n in names])
    b.bar_label(bars, fmt="%.2fx")
    b.set_ylabel("speed-up vs baseline")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(title or "predicted")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_presets:
        for name, preset in sorted(PRESETS.items()):
            print(f"{name}: {preset.description}")
        return 0
    try:
        model, cluster, train = _configure(args)
        report = simulate(model, cluster, train)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.plot:
        plot_report(report, args.plot, title=args.preset)
    if args.json:
        print(json.dumps({"preset": args.preset, **report.to_dict()}, indent=2))
    else:
        print(format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
