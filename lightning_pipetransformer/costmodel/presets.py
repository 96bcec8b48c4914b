"""Built-in cost-model inputs: Transformer block costs from FLOPs, devices, the paper's setting.

Every number here is either taken from a source (cited next to it) or an estimate (marked
"estimate"); docs/cost_model.md lists them all in one table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_pipetransformer.costmodel.model import (
    BlockCost,
    Cluster,
    ModelCost,
    Training,
)

__all__ = ["Device", "RTX_5000", "transformer_costs", "vit_b16_costs", "Preset", "PRESETS", "get_preset"]

GB = 1e9


@dataclass(frozen=True)
class Device:
    """A GPU as the cost model sees it: sustained FLOP rate and per-cell overhead."""

    name: str
    peak_flops: float  # FLOP/s at the training precision
    efficiency: float  # sustained fraction of peak on Transformer blocks (estimate)
    cell_overhead_s: float  # fixed cost per micro-batch per stage, forward + backward (estimate)
    bytes_per_value: int = 4  # fp32

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


# Quadro RTX 5000 (Turing TU104): 11.2 TFLOPS fp32 peak (NVIDIA data sheet). fp32 because the
# paper's code trains in fp32 (no amp in its ViT trainer) and Turing has no TF32.
# efficiency and cell_overhead_s: least-squares fit of this model to the paper's Fig. 11 (K=8
# throughput for 8, 16, 24, 32, 40, 48 micro-batches; residuals <= 4%). 0.65 of peak is
# plausible for fp32 GEMM-heavy blocks; 30 ms per cell is torch Pipe's per-micro-batch cost
# (Python worker threads sharing one GIL, stream events, copy kernels). Not fitted to Fig. 9.
RTX_5000 = Device("Quadro RTX 5000 16GB", peak_flops=11.2e12, efficiency=0.65, cell_overhead_s=0.03)


def transformer_costs(
    device: Device,
    *,
    layers: int,
    hidden: int,
    mlp: int,
    tokens: int,
    embedding_flops: float,
    embedding_params: float,
    head_flops: float,
    head_params: float,
) -> ModelCost:
    """Per-sample block costs of a pre-norm Transformer encoder from its FLOPs.

    Forward FLOPs of one block for one sample: 2 * tokens * (4 h^2 + 2 h m) for the projections
    and MLP, plus 4 * tokens^2 * h for the attention scores and their weighted sum. Backward is
    twice the forward (weights and inputs), the usual rule.
    """
    fwd_flops = 2 * tokens * (4 * hidden * hidden + 2 * hidden * mlp) + 4 * tokens * tokens * hidden
    params = 4 * hidden * hidden + 2 * hidden * mlp + 4 * hidden + mlp + 5 * hidden  # + biases, 2 LayerNorms
    act = tokens * hidden * device.bytes_per_value
    b = device.bytes_per_value
    block = BlockCost(fwd_flops / device.flops, 2 * fwd_flops / device.flops, act, params * b)
    emb = BlockCost(embedding_flops / device.flops, 2 * embedding_flops / device.flops, act, embedding_params * b)
    head = BlockCost(head_flops / device.flops, 2 * head_flops / device.flops, 0.0, head_params * b)
    return ModelCost((block,) * layers, emb, head)


def vit_b16_costs(device: Device = RTX_5000, num_classes: int = 1000, image: int = 224) -> ModelCost:
    """ViT-B/16 (Dosovitskiy et al. 2020): 12 blocks, hidden 768, MLP 3072, 16x16 patches."""
    patches = (image // 16) ** 2
    hidden = 768
    return transformer_costs(
        device,
        layers=12,
        hidden=hidden,
        mlp=3072,
        tokens=patches + 1,  # + [CLS]
        embedding_flops=2 * patches * (16 * 16 * 3) * hidden,
        embedding_params=16 * 16 * 3 * hidden + hidden + (patches + 1) * hidden + hidden,
        head_flops=2 * hidden * num_classes,
        head_params=2 * hidden + hidden * num_classes + num_classes,
    )


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelCost
    cluster: Cluster
    train: Training


def _paper_cluster(device: Device) -> Cluster:
    return Cluster(
        nodes=2,  # paper Sec. 5: 2 machines x 8 GPUs
        gpus_per_node=8,
        intra_node_bw=15.754 * GB,  # paper: PCIe 3.0 x16, 15.754 GB/s
        inter_node_bw=5 * GB,  # paper: InfiniBand CX353A, 5 GB/s
        # estimate: ImageNet's cache (1.28M x 605 KB fp32 = 775 GB) exceeds host memory and spills
        # to disk (official code: cache/disk_memory_manager.py; doc/TODO.md "ImageNet cache OOM");
        # a node's NVMe-class read rate, shared by its pipelines.
        cache_bw=4 * GB,
        # estimate: the official cache is read synchronously, in Python, by each training process:
        # per sample one shared-memory segment is opened, mapped (~150 page faults), deep-copied
        # and copied into the batch, then sent to the GPU from pageable memory: ~0.6 ms per 605 KB.
        cache_read_bw=1 * GB,
        cell_overhead_s=device.cell_overhead_s,
    )


def _paper_training() -> Training:
    return Training(
        dataset_size=1_281_167,  # ImageNet-1k train split
        epochs=10,  # paper Fig. 9 x-axis (epochs 0-9); official CIFAR-100 config: epochs 10
        batch_size=400,  # paper Sec. 5 "around 400"; official sweep_node0_imagenet.py: 400
        pipe_len=8,  # official run_elastic_pipe.sh: pipe_len_at_the_beginning 8
        # official auto_pipe.py _get_optimal_chunk_num_by_pipe_len: 2K, 4K, 8K for K = 8, 4, 2
        # (16 for all three, which is paper Fig. 11's "M = 2, 4, 8" in units of K), 4K for K = 1.
        micro_batches={8: 16, 4: 16, 2: 16, 1: 4},
        alpha=1 / 3,  # paper Sec. 5.2: speed-ups reported with the "conservative" alpha = 1/3
        # official auto_freeze.py: the schedule runs up to all 12 layers (only the head trains)
        min_active=0,
        frozen_cost=1 / 6,  # paper Sec. 3.2 / official load_balance.py
        partition="paper-greedy",
        partition_by="params",  # official load_balance.py balances parameter sizes
        frozen_placement="serial",  # official AutoPipe: frozen layers run on device 0 before the pipe
        cache_policy="min-frozen",
        cache_min_frozen=3,  # paper Sec. 5.3.4 / official auto_cache.py: ViT caches from 3 frozen layers
        cache_hit_rate=1.0,  # sample-index keys: every sample is seen once per epoch
        # official pipe_transformer/log/performance_analysis.log: CPU->GPU moves 4-18 s and DDP
        # rebuild 5-23 s per transition; 30 s total (estimate within that range).
        transition_s=30.0,
        allreduce_overlap=0.0,  # estimate: pipelined DDP + find_unused_parameters, little overlap
    )


def _this_project(base: Preset, hit_rate: float) -> Training:
    return replace(
        base.train,
        micro_batches="auto",  # profiled M
        partition="optimal",  # exact min-max partition (pipe/partition.py)
        partition_by="time",  # profiled per-block time
        frozen_placement="pipelined",  # frozen prefix inside stage 0, weighted frozen_cost
        cache_policy="auto",  # cache only when it is predicted to pay
        cache_hit_rate=hit_rate,
        min_active=1,  # AutoFreeze's default: the last block never freezes
    )


_paper = Preset(
    "paper-vit-b16-imagenet",
    "PipeTransformer paper setting: ViT-B/16 on ImageNet, 2 nodes x 8 Quadro RTX 5000, "
    "PCIe 15.75 GB/s, InfiniBand 5 GB/s, batch 400 per pipeline, K0=8, alpha=1/3, 10 epochs.",
    vit_b16_costs(),
    _paper_cluster(RTX_5000),
    _paper_training(),
)

PRESETS: dict[str, Preset] = {
    _paper.name: _paper,
    "project-vit-b16-imagenet": Preset(
        "project-vit-b16-imagenet",
        "Same hardware and run, this project's choices: optimal partition by time, profiled M, "
        "frozen prefix pipelined, content-keyed cache with deterministic inputs (hit rate 1).",
        _paper.model,
        _paper.cluster,
        _this_project(_paper, 1.0),
    ),
    "project-vit-b16-imagenet-randaug": Preset(
        "project-vit-b16-imagenet-randaug",
        "As project-vit-b16-imagenet, but random augmentation makes content keys miss (hit rate 0).",
        _paper.model,
        _paper.cluster,
        _this_project(_paper, 0.0),
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.") from None
