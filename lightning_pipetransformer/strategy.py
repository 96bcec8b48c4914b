"""PipeTransformerStrategy: ``strategy="pipetransformer"`` runs the model's block stack as a pipeline.

The user's LightningModule is unchanged. At setup the strategy finds the block stack, asks the
AutoPipe planner for a plan (frozen blocks F, pipe length K, micro-batches M, partition), moves
each block to its stage's device and makes the model's own loop over the stack call the
pipeline executor once (:func:`~lightning_pipetransformer.pipe.pipeline.install_pipeline`:
state-dict keys stay the plain model's). When :class:`~lightning_pipetransformer.AutoFreeze`
freezes more blocks it calls :meth:`PipeTransformerStrategy.on_autofreeze` at the start of the
epoch, and the strategy re-plans: the pipeline shrinks when the compression rule allows.

Process layout. Lightning starts one process per device. With ``devices=1`` the one process
drives all K stages on its device ("virtual stages": the CPU, or streams of one GPU), which is
how everything is tested on CPU. With ``devices=G > 1`` (AutoDP) local rank ``j*K`` drives a
pipeline replica over devices ``[j*K, (j+1)*K)`` (so each replica's first stage is its own
process's device and nothing outside the stack moves when K shrinks) and the other processes
are shadow ranks that follow the loop without model work; as K shrinks they become replicas
(see :mod:`~lightning_pipetransformer.dp`, :mod:`~lightning_pipetransformer.dp.idle_hooks`
and :meth:`PipeTransformerStrategy._transition`).

Everything outside the stack (embeddings, head, loss, metrics) stays on the first stage's
device, and the pipeline's output is handed back there, so ``training_step`` needs no change.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import uuid
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import lightning_internals
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.store import probe_cache_dir
from lightning_pipetransformer.dp import (
    faults,
    groups,
    idle,
    idle_hooks,
    state_transfer,
)
from lightning_pipetransformer.dp.replicas import Elastic, OneProcess, Replicas
from lightning_pipetransformer.freeze.apply import untrainable_prefix
from lightning_pipetransformer.pipe.costs import parameter_costs, parameter_count
from lightning_pipetransformer.pipe.planner import AutoPipe, Plan
from lightning_pipetransformer.runners import cached_runner, pipeline_runner
from lightning_pipetransformer.stack.declared import block_stack_of
from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.stack.input_grad import FrozenOutputs
from lightning_pipetransformer.stack.interception import (
    InterceptionStats,
    install_pipeline,
    installed_pipeline,
    interception_stats,
    remove_pipeline,
)

__all__ = ["PipeTransformerStrategy"]

_CHECKPOINT_KEY = "pipetransformer"


class PipeTransformerStrategy(ParallelStrategy):
    """Pipeline-parallel training of a Transformer's block stack, repartitioned as blocks freeze.

    Args:
        pipe_len: initial pipeline length K0 (stages per replica), default 1. With ``devices=1``
            the K stages are virtual (all on the one device); with ``devices=G`` K must divide G,
            and G/K processes per node start as replicas while the others wait (AutoDP).
        chunks: micro-batches per mini-batch M, an int (default 1) or ``"auto"`` (measured at
            the first batch of every new pipe length over K..6K, as the paper did).
        frozen_cost: weight of a frozen block relative to an active one when partitioning
            (paper: 1/6: a frozen block runs forward only).
        layers: the block container's attribute path relative to the LightningModule. Default:
            AutoFreeze's stack if AutoFreeze is used, else the module's ``configure_block_stack()``,
            else automatic discovery.
        process_group_backend: ``"nccl"``/``"gloo"``; default by device type.
        timeout: seconds before a collective gives up (a dead rank ends the run, not hangs it).
            Every process group the strategy makes (the active group at each transition) gets it.
        batch_policy: with several processes, what stays fixed as replicas are added.
            ``"replica"`` (default, the paper's): each replica keeps the DataLoader's batch size,
            so the global batch grows with the replicas (more samples per step, fewer steps per
            epoch). ``"global"``: the DataLoader's batch size is the global batch; each of R
            replicas gets ``batch_size / R`` (it must divide by the number of processes), so
            training is the same optimisation as on one device, only faster.
        cache: AutoCache. ``True`` serves the frozen prefix's output from an activation cache
            whenever blocks are frozen; ``"auto"`` only while a lookup is measured faster than
            the prefix; ``False`` (default) never. See docs/cache.md.
        cache_key: ``"content"`` (default): a fingerprint of each sample's input to the frozen
            prefix, exact even with random augmentation (it just misses). ``"index"``: the
            ``"index"`` entry of a dict batch, the paper's choice: it reuses the first augmented
            view it saw, which changes training when augmentation is random (the blocks'
            per-sample arguments, such as the attention mask, are still hashed into the key).
        cache_dir: node-local directory for entries beyond ``cache_memory``; default
            ``<default_root_dir>/pipetransformer_cache``.
        cache_memory: host bytes for cached entries in memory, for the whole node: each of its
            processes keeps ``cache_memory / processes per node`` (their memory is not shared); the
            rest spills to ``cache_dir``, which the node's processes share.
        cache_skip_embeddings: also skip the embeddings on batches the cache serves (default).
            Checked for safety at run time (their output must reach the blocks unchanged); turn
            it off only if that check raises for your model.
    """

    strategy_name = "pipetransformer"

    def __init__(
        self,
        pipe_len: int = 1,
        chunks: int | Literal["auto"] = 1,
        frozen_cost: float = 1 / 6,
        layers: str | None = None,
        process_group_backend: str | None = None,
        timeout: float = 1800.0,
        batch_policy: Literal["replica", "global"] = "replica",
        cache: bool | Literal["auto"] = False,
        cache_key: Literal["content", "index"] = "content",
        cache_dir: str | None = None,
        cache_memory: int = 4 * 2**30,
        cache_skip_embeddings: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if isinstance(pipe_len, bool) or not isinstance(pipe_len, int) or pipe_len < 1:
            raise ValueError(f"pipe_len must be a positive int (stages per pipeline), got {pipe_len!r}.")
        if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks must be a positive int or 'auto', got {chunks!r}.")
        if not 0.0 <= float(frozen_cost) <= 1.0:
            raise ValueError(f"frozen_cost must be in [0, 1] (paper: 1/6), got {frozen_cost!r}.")
        if not float(timeout) > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        if batch_policy not in ("replica", "global"):
            raise ValueError(f"batch_policy must be 'replica' or 'global', got {batch_policy!r}.")
        if cache not in (False, True, "auto"):
            raise ValueError(f"cache must be False, True or 'auto', got {cache!r}.")
        if cache_key not in ("content", "index"):
            raise ValueError(f"cache_key must be 'content' or 'index', got {cache_key!r}.")
        if isinstance(cache_memory, bool) or not isinstance(cache_memory, int) or cache_memory < 0:
            raise ValueError(f"cache_memory must be a number of bytes >= 0 (0: everything on disk), got {cache_memory!r}.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend: str | None = process_group_backend
        self._timeout = timedelta(seconds=float(timeout))
        self._ddp_kwargs: dict[str, Any] = {}
        self.pipe_len = pipe_len
        self.chunks = chunks
        self.frozen_cost = float(frozen_cost)
        self.layers = layers
        self.batch_policy = batch_policy
        self.cache = cache
        self.cache_key = cache_key
        self.cache_dir = cache_dir
        self.cache_memory = cache_memory
        self.cache_skip_embeddings = bool(cache_skip_embeddings)
        self._autocache: AutoCache | None = None
        self._cache_include_pre = True
        self.stack: BlockStack | None = None
        self.planner: AutoPipe | None = None
        self._plan: Plan | None = None
        self._restored: dict[str, Any] | None = None
        self._auto_chunks: dict[int, int] = {}  # chunks="auto": the measured M per pipe length
        # One process, or several (AutoDP): picked at setup_environment, asked instead of the world size.
        self._replicas: Replicas = OneProcess(self)
        self._ddp_init_sync = True
        self._average_by_hand = False  # replicas of several stages: gradients averaged after backward
        #: Seconds per phase of the last AutoDP transition on this rank (for logs and benchmarks).
        self.last_transition: dict[str, float] = {}
        # Engagement reporting: the counts already reported, and at which step.
        self._engagement_seen = InterceptionStats()
        self._engagement_step = 0
        self._warned_disengaged = False
        self._runner_installed = False
        self._kv_cache_configs: list[Any] = []  # configs whose use_cache this fit turned off
        self._frozen_outputs: FrozenOutputs | None = None

    # ------------------------------------------------------------------ one process, or several
    #
    # Lightning gives the strategy its devices after construction (the accelerator connector
    # sets parallel_devices and num_nodes, then calls _configure_launcher). With one process in
    # all, there is nothing to distribute: no launcher (notebooks and `python -i` work), no
    # process group (validation honours inference_mode), no re-seeding (the same seed gives the
    # run strategy="auto" gives), and `is_distributed` is False (the batch-size finder works,
    # the user's sampler is kept). With several, it behaves like DDPStrategy, whose set-up it
    # follows below.

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part (Lightning's connector reads this)."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # One process is rank 0 of 1, whatever the cluster environment says (as under the single-device
    # strategy, which asks it nothing): a SLURM or torchelastic job of one task must not need more.
    @property
    @override
    def global_rank(self) -> int:
        return super().global_rank if self.is_distributed else 0

    @property
    @override
    def local_rank(self) -> int:
        return super().local_rank if self.is_distributed else 0

    @property
    @override
    def node_rank(self) -> int:
        return super().node_rank if self.is_distributed else 0

    @property
    @override
    def world_size(self) -> int:
        return super().world_size if self.is_distributed else 1

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this when the Trainer is built, once the devices are known: refuse a pipe length
        # that cannot tile them now, not in every process after they started.
        if self.num_processes > 1 and self.num_processes % self.pipe_len:
            divisors = [k for k in range(1, self.num_processes + 1) if self.num_processes % k == 0]
            raise ValueError(
                f"pipe_len={self.pipe_len} must divide the {self.num_processes} devices per node (each pipeline replica "
                f"spans pipe_len of them, and the freed ones become replicas): use pipe_len in {divisors}, or "
                f"Trainer(devices=...) a multiple of {self.pipe_len}."
            )
        self._launcher = (
            lightning_internals.SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            if self.is_distributed
            else None
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        dev.bind_process_device(self.root_device)
        self._replicas = Elastic(self) if self.is_distributed else OneProcess(self)
        if self.is_distributed:
            self._setup_distributed()

    def _setup_distributed(self) -> None:
        """DDPStrategy.setup_distributed: the seed, the ranks, the world process group."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        lightning_internals.init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None and self.is_distributed:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or lightning_internals.default_process_group_backend(self.root_device)

    # ------------------------------------------------------------------ what users read

    @property
    def plan(self) -> Plan | None:
        """The plan in force: ``num_frozen``, ``pipe_len``, ``chunks``, ``partition``, ``active_ranks``."""
        return self._plan

    @property
    def stage_devices(self) -> tuple[torch.device, ...]:
        """The devices this process's pipeline stages run on (none on a shadow rank)."""
        if self._plan is None:
            return (self.root_device,)
        if self.num_processes == 1:
            return (self.root_device,) * self._plan.pipe_len
        if not self.is_active:
            return ()
        return tuple(torch.device(d) for d in self._plan.devices_for(self.local_rank))

    @property
    def is_active(self) -> bool:
        """Whether this process drives a pipeline replica now (False: a shadow rank, idle until K shrinks)."""
        return self._replicas.is_active(self._plan)

    @property
    def control_group(self) -> Any | None:
        """The group of every rank (plan broadcast, barriers, decisions); None with one process."""
        return self._replicas.control_group

    @property
    def gradient_group(self) -> Any | None:
        """The process group this replica's gradients are averaged over, or None when nothing is.

        DDP's group for a one-stage replica, the same group averaged by hand after backward for a
        replica of several stages (see :meth:`configure_ddp`); None with one process, on a shadow
        rank, or when this is the only active replica.
        """
        if isinstance(self.model, DistributedDataParallel):
            return self.model.process_group
        return self._replicas.active_group if self._average_by_hand else None

    @property
    def autofreeze_decides_here(self) -> bool:
        """Whether AutoFreeze's rule decides on this process: with several, only on global rank 0
        (see :attr:`Elastic.decides_here <lightning_pipetransformer.dp.replicas.Elastic.decides_here>`)."""
        return self._replicas.decides_here

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._replicas.sampler_kwargs(self._plan)

    # ------------------------------------------------------------------ set-up, in loop order

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_supported(trainer)
        module = self.lightning_module
        assert module is not None
        autofreeze = _autofreeze_of(trainer)
        self.stack = self._find_stack(module, autofreeze)
        if self.stack is None:  # nothing to freeze or pipeline: plain single-device / DDP training
            self.planner, self._plan = None, None
            self._setup_model_and_optimizers(trainer, None)
            return
        # Which inputs of the stack require grad only because a hook marked them (gradient checkpointing, PEFT).
        self._frozen_outputs = FrozenOutputs(m for _, m in self.stack.pre)
        self.planner = self._make_planner()
        self._check_layer_outputs(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._turn_off_kv_cache(module)
        if self._restored is not None:
            self._auto_chunks = {int(k): int(m) for k, m in self._restored.get("auto_chunks", {}).items()}
        # Blocks without a trainable parameter (frozen before fit, adapters on upper layers only) count as frozen.
        num_frozen = max(autofreeze.num_frozen if autofreeze is not None else 0, untrainable_prefix(self.stack))
        if self.cache:
            self._setup_cache(trainer, autofreeze)
        self._ddp_init_sync = True
        # One process: the planner's plan. Several: rank 0's, agreed on, with the groups made.
        self._setup_model_and_optimizers(trainer, self._replicas.first_plan(trainer, autofreeze, num_frozen))

    def _find_stack(self, module: pl.LightningModule, autofreeze: Any) -> BlockStack | None:
        """The block stack to plan over; ``None`` (with a warning) when the model has none and
        nothing asks for one, so that any LightningModule trains as under the plain strategy."""
        if self.layers is None and autofreeze is not None:
            if module.trainer.state.fn == TrainerFn.FITTING:
                # AutoFreeze's stack; a model built in setup() / configure_model() exists only now.
                return autofreeze.find_stack(module, module.trainer)
            if autofreeze.stack is not None:
                return autofreeze.stack
        try:
            return block_stack_of(module, self.layers)
        except BlockStackError as err:
            wanted = [
                what for what, asked in (
                    (f"pipe_len={self.pipe_len}", self.pipe_len > 1), (f"chunks={self.chunks!r}", self.chunks != 1),
                    (f"cache={self.cache!r}", bool(self.cache)), (f"layers={self.layers!r}", self.layers is not None),
                ) if asked
            ]
            if wanted:
                raise BlockStackError(f"{', '.join(wanted)} needs a block stack to pipeline or cache. {err}") from None
        rank_zero_warn(
            f"PipeTransformer: {type(module).__name__} has no stack of repeated blocks, so there is nothing to freeze, "
            "pipeline or cache: it trains as under the plain strategy. To use the pipeline, name the block container "
            "with PipeTransformerStrategy(layers='model.encoder.layer') or define configure_block_stack() on the module."
        )
        return None

    def _setup_model_and_optimizers(self, trainer: pl.Trainer, plan: Plan | None) -> None:
        """DDPStrategy.setup, with the blocks placed on their stages' devices *before* DDP wraps the
        model: DDP binds its hooks to the parameters it sees, and moving a block afterwards swaps
        their storage under it."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if plan is not None:
            self._apply_plan(plan, announce=True)
        if fitting:
            self.configure_ddp()  # DDP over the active replicas (several processes only)
            if self._average_by_hand:  # no DDP wrapper to sync the replicas' first weights
                state_transfer.broadcast_module_state(self.lightning_module, src=0, group=self._replicas.active_group, via=self.root_device)
            self.setup_optimizers(trainer)
        elif self.is_distributed and self.is_active:
            # As DDPStrategy does without a wrapper, but over the replicas and through buffers on each
            # one's own device: a shadow rank holds its blocks on the CPU and a replica's blocks sit
            # on several devices, which a broadcast over the world group (NCCL) would refuse.
            state_transfer.broadcast_module_state(self.lightning_module, src=0, group=self._replicas.active_group, via=self.root_device)
        self.setup_precision_plugin()
        if fitting:
            # Each optimizer state tensor belongs with its parameter, which may sit on another
            # stage's device than the root one (a checkpoint's state arrives on the CPU).
            dev.optimizer_state_to_param_devices(self.optimizers)

    def _setup_cache(self, trainer: pl.Trainer, autofreeze: Any) -> None:
        """AutoCache: check the directory now (before training) and key on the right inputs."""
        assert self.stack is not None
        directory = self.cache_dir or os.path.join(trainer.default_root_dir, "pipetransformer_cache")
        probe_cache_dir(directory)
        self._autocache = AutoCache(
            # The node's budget, split over its processes: 8 replicas must not hold 8 x cache_memory.
            self.cache, directory, self.cache_memory // max(1, self.num_processes), write_through=self.num_processes > 1,
            key=self.cache_key, skip_embeddings=self.cache_skip_embeddings,
        )
        # Entries computed at another precision must never be returned; index keys are only
        # unique within this set-up (this run, these loaders; several processes take rank 0's).
        self._autocache.fingerprint_extra = f"precision={trainer.precision}"
        self._autocache.parameter_names = {id(p): name for name, p in self.lightning_module.named_parameters()}
        self._autocache.namespace = uuid.uuid4().hex[:12] + "-"
        # Entries advanced at a boundary move must equal what a forward computes (bf16-mixed: autocast).
        self._autocache.forward_context = self.precision_plugin.forward_context
        # With trainable embeddings the boundary depends on more than their inputs: key on the
        # hidden state itself (exact, a little dearer) instead of the embeddings' inputs.
        self._cache_include_pre = bool(autofreeze is None or autofreeze.freeze_embeddings)
        if self._cache_include_pre:
            self._autocache.attach(self.stack, self.lightning_module)
        self._autocache.watch_batch_bytes(self.stack.blocks[0])  # checked at the first training step
        if self.world_size > 1:
            from lightning_pipetransformer.cache.sync import BoundarySync

            # After each transition, on every rank: open the new boundary's store and advance the
            # old entries together (appended last: after the TransitionCallback setup inserts).
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, BoundarySync)]
            trainer.callbacks.append(
                BoundarySync(
                    self._autocache, lambda: self._plan.num_frozen if self._plan is not None else None,
                    lambda: self._replicas.control_group, node=self.node_rank,
                )
            )

    @property
    def cache_stats(self) -> dict[str, float] | None:
        """AutoCache hits, misses and bytes of the current boundary (``None`` without a cache)."""
        return self._autocache.stats() if self._autocache is not None else None

    def _check_layer_outputs(self, module: torch.nn.Module) -> None:
        """Per-layer outputs cannot come out of one pipeline call (or a cache): refuse them up front."""
        if self.pipe_len == 1 and self.chunks == 1 and not self.cache:
            return
        for name, sub in module.named_modules():
            config = getattr(sub, "config", None)
            asked = [flag for flag in ("output_hidden_states", "output_attentions") if getattr(config, flag, False)]
            if asked:
                raise ValueError(
                    f"{name or type(module).__name__}.config.{asked[0]}=True asks for every layer's output, which a "
                    "pipelined or cached block stack does not produce. Set it to False, or use pipe_len=1, chunks=1, "
                    "cache=False."
                )

    def _turn_off_kv_cache(self, module: torch.nn.Module) -> None:
        """Fit with ``use_cache=False``: one key-value cache object shared by a pass's micro-batches
        would be updated once per micro-batch. Restored at teardown."""
        if self.pipe_len == 1 and self.chunks == 1 and not self.cache:
            return
        configs = {id(c): c for m in module.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
        for config in configs.values():
            config.use_cache = False
        self._kv_cache_configs = list(configs.values())
        if configs:
            rank_zero_info(
                "PipeTransformer: use_cache=False while fitting (a key-value cache is for generation; shared by "
                "micro-batches it would be updated once per micro-batch). It is restored after fit."
            )

    def _check_supported(self, trainer: pl.Trainer) -> None:
        if self.num_processes > 1 and trainer.lightning_module is not None and not trainer.lightning_module.automatic_optimization:
            raise ValueError("strategy='pipetransformer' with several processes supports automatic optimization only.")

    def _make_planner(self) -> AutoPipe:
        assert self.stack is not None
        costs = parameter_costs(self.stack.blocks)
        if self.pipe_len > len(costs):
            raise ValueError(
                f"pipe_len={self.pipe_len} is more stages than the {len(costs)} blocks of '{self.stack.path}': "
                f"use pipe_len <= {len(costs)}."
            )
        # With one process the K stages are virtual (all on this process's device), so plan as if
        # the node had K devices; with several processes each one is a pipeline of its own.
        per_node = self.pipe_len if self.num_processes == 1 else self.num_processes
        return AutoPipe(
            costs,
            devices_per_node=per_node,
            num_nodes=self.num_nodes,
            pipe_len=self.pipe_len,
            frozen_cost=self.frozen_cost,
            # "auto" is measured on the first real batch of each K (see ChunkTuner); plan with 1.
            chunks=1 if self.chunks == "auto" else self.chunks,
            pre_cost=float(sum(parameter_count(m) for _, m in self.stack.pre)),
            post_cost=float(sum(parameter_count(m) for _, m in self.stack.post)),
            node_devices=[str(self.root_device)] * per_node if self.num_processes == 1 else [str(d) for d in self.parallel_devices],
        )

    @override
    def model_to_device(self) -> None:
        """Everything outside the stack to the first stage's device; the blocks go straight to
        their own stage's device in _apply_plan (never all of them to this one first: a model
        that does not fit one device must still start, and a shadow rank holds no block at all).

        Through ``Module._apply``, as ``Module.to`` moves them: torchmetrics keeps its states as plain
        attributes that only its own ``_apply`` moves, and a module may keep a device of its own there.
        """
        assert self.model is not None
        if self.stack is None:
            dev.place_module(self.model, self.root_device)
            return
        dev.place_outside(self.model, self.stack.blocks, self.root_device)

    def _drop_ddp(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            dev.after_unwrap()
        self.model = self.lightning_module

    def configure_ddp(self) -> None:
        """Gradient averaging over the active replicas, for the current plan.

        One process has no gradients to average (a wrapper would only add a reducer that breaks
        when AutoFreeze turns requires_grad off); a shadow rank has none either. A replica of one
        stage is wrapped in DDP (gradients all-reduced while backward runs). A replica whose
        stages span several devices is not: DDP would all-reduce buckets on every device, but the
        process's groups are bound to its own device (NCCL refuses the others), so its gradients
        are averaged after backward through buffers on that device (:func:`state_transfer.average_gradients`).
        """
        self._drop_ddp()
        self._average_by_hand = False
        if self.world_size == 1 or not self.is_active:
            return
        if self._plan is not None and self._plan.pipe_len > 1:
            self._average_by_hand = self._plan.num_replicas > 1
            return
        self.model = self._setup_model(self.model)

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        dev.before_wrap([p for p in model.parameters() if p.requires_grad], self.root_device)
        return self._wrap_ddp(model)

    def _wrap_ddp(self, model: torch.nn.Module) -> DistributedDataParallel:
        # DDP over the active replicas only. The first wrapper of a fit syncs the replicas'
        # weights itself; at a transition Elastic.send_state already did, so the copy is skipped.
        return DistributedDataParallel(
            module=model,
            device_ids=self.determine_ddp_device_ids(),
            process_group=self._replicas.active_group,
            init_sync=self._ddp_init_sync,
            **self._ddp_kwargs,
        )

    def determine_ddp_device_ids(self) -> list[int] | None:
        # A replica whose stages span several devices is a multi-device module: DDP wants None.
        if self.root_device.type == "cpu" or len(set(self.stage_devices)) > 1:
            return None
        return [self.root_device.index]

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.num_processes > 1 and len(self.optimizers) > 1:
            raise ValueError("strategy='pipetransformer' with several processes supports one optimizer only.")

    # ------------------------------------------------------------------ data (AutoDP: shares and stand-ins)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self.world_size == 1 or self._plan is None:
            return dataloader
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        training = trainer is not None and trainer.state.stage == RunningStage.TRAINING
        if training:
            self._check_train_loader(dataloader)
            self._check_val_check_interval(trainer, dataloader)
            if self.batch_policy == "global":
                dataloader = self._per_replica_loader(dataloader)  # type: ignore[arg-type]
        if self.is_active:
            return dataloader
        if not hasattr(dataloader, "__len__"):
            raise ValueError(
                "strategy='pipetransformer' with several processes needs loaders with a length (a map-style "
                "dataset): idle processes stand in with the same number of batches. Got "
                f"{type(dataloader).__name__} without len()."
            )
        # A shadow rank loads nothing: same length as an active replica's share, placeholder batches.
        return idle.IdleLoader(len(dataloader))  # type: ignore[arg-type]

    def _check_train_loader(self, dataloader: object) -> None:
        assert self._plan is not None
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(sampler, DistributedSampler) or sampler.num_replicas != self._plan.num_replicas:
            raise ValueError(
                "strategy='pipetransformer' with several processes splits the training data over the active replicas, "
                "which change as the pipeline shrinks: it needs a DataLoader over a map-style dataset and Lightning's "
                "distributed sampler (Trainer(use_distributed_sampler=True), the default, and no DistributedSampler of "
                f"your own). Got sampler {type(sampler).__name__}."
            )

    def _check_val_check_interval(self, trainer: pl.Trainer, dataloader: Any) -> None:
        """batch_policy='replica' shortens the epoch as replicas join: an int ``val_check_interval``
        must fit the shortest epoch the planner can reach, or Lightning refuses it epochs later."""
        interval = trainer.val_check_interval
        autofreeze = _autofreeze_of(trainer)
        if (
            self.batch_policy != "replica" or isinstance(interval, bool) or not isinstance(interval, int)
            or trainer.check_val_every_n_epoch is None or not trainer.limit_val_batches or autofreeze is None
            or self.planner is None or autofreeze.stack is None
        ):
            return
        most_frozen = autofreeze.max_frozen
        if autofreeze.schedule is not None and trainer.max_epochs is not None and trainer.max_epochs > 0:
            most_frozen = min(most_frozen, max(autofreeze.schedule(e) for e in range(trainer.max_epochs)))
        most_frozen = max(most_frozen, autofreeze.num_frozen)
        replicas = copy.deepcopy(self.planner).plan(most_frozen).num_replicas  # the most replicas reachable
        sampler, batch_size = dataloader.sampler, dataloader.batch_size
        if batch_size is None:
            return
        samples = len(sampler.dataset) // replicas if sampler.drop_last else -(-len(sampler.dataset) // replicas)
        batches = samples // batch_size if dataloader.drop_last else -(-samples // batch_size)
        limit = trainer.limit_train_batches
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        if interval > batches:
            raise ValueError(
                f"val_check_interval={interval} batches, but with batch_policy='replica' an epoch shrinks as replicas "
                f"join: with the {replicas} replicas AutoFreeze can reach it has {batches} batches, and Lightning "
                f"would refuse the interval then. Use val_check_interval <= {batches}, a float (a fraction of each "
                "epoch), or batch_policy='global' (epochs keep their length)."
            )

    def _per_replica_loader(self, dataloader: DataLoader) -> DataLoader:
        """batch_policy='global': the loader's batch size is the global batch, split over the replicas."""
        assert self._plan is not None
        batch, replicas = dataloader.batch_size, self._plan.num_replicas
        if batch is None or batch % self.world_size:
            raise ValueError(
                f"batch_policy='global' splits the DataLoader's batch_size over up to {self.world_size} replicas: it must "
                f"be a multiple of {self.world_size} (got {batch}; a custom batch_sampler cannot be split). Change the "
                "batch size, or use batch_policy='replica'."
            )
        return lightning_internals.loader_with_batch_size(dataloader, batch // replicas)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if idle.is_idle_batch(batch):
            return batch  # nothing to move, and the user's transfer hooks must not see a placeholder
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ steps (a shadow rank does no model work)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = super().training_step
        output = self._step_together("training_step", lambda: idle.idle_loss(self.root_device), step, "train", args, kwargs)
        self._check_cache_budget()
        return output

    def _step_together(self, where: str, idle_output: Any, step: Any, stage: str, args: Any, kwargs: Any) -> Any:
        """A step on this rank (a shadow rank's stand-in); with the cache and several processes, ranks stop together.

        AutoCache decides per rank (the first-hit check, a repeated index): a verdict one replica
        alone reaches must end every rank within seconds, not leave them in DDP until the timeout.
        """
        def run() -> Any:
            if not self.is_active:
                return idle_output()
            self._index_keys_from(args, kwargs, stage)
            return step(*args, **kwargs)

        group = self._replicas.control_group
        if self._autocache is None or group is None:
            return run()
        self._autocache.defer_verdicts = True
        error: BaseException | None = None
        output = None
        try:
            output = run()
        except Exception as err:  # noqa: BLE001 - raised below, on every rank together
            error = err
        faults.raise_together(error or self._autocache.take_verdict(), group, where)
        return output

    def _check_cache_budget(self) -> None:
        """Once, after the first training forward (before any update): a ``cache_memory`` too small
        for one batch fails now, not at the first store, which may come epochs later. Every rank
        takes part (an idle rank measured nothing), so all of them raise together."""
        needed = self._autocache.measured_batch_bytes() if self._autocache is not None else None
        if needed is None:  # no cache, or checked already (every rank measured since the same set-up)
            return
        if self._replicas.control_group is not None:
            largest = torch.tensor(needed, dtype=torch.int64)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self._replicas.control_group)
            needed = int(largest)
        self._autocache.check_budget(needed)

    def _index_keys_from(self, args: tuple[Any, ...], kwargs: dict[str, Any], stage: str) -> None:
        """cache_key='index': hand the batch's sample indices to AutoCache before the forward."""
        if self._autocache is None or self.cache_key != "index":
            return
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        loader = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        # Checked from the first batch on, not only once blocks are frozen: a wrong batch type, or an
        # index repeated within a pass over the loader, must fail in the first step, not at the first freeze.
        self._autocache.set_batch(batch, f"{stage}{loader}", batch_idx if isinstance(batch_idx, int) else None)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if not self.is_active:
            # Lightning's closure must run (it checks its result was consumed); the step must not:
            # global_step counts these calls, so shadow ranks stay in step with the replicas.
            closure()
            return None
        if self._average_by_hand:
            step_closure = closure

            def closure() -> Any:  # the last micro-batch's backward, then the replicas' average
                result = step_closure()
                params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
                state_transfer.average_gradients(params, self._replicas.active_group, self.root_device)
                return result

        dev.check_optimizer(optimizer)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step_together("validation_step", lambda: None, super().validation_step, "val", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step_together("test_step", lambda: None, super().test_step, "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step_together("predict_step", lambda: None, super().predict_step, "predict", args, kwargs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            self._report_engagement()
        self._show_in_progress_bar()

    def _show_in_progress_bar(self) -> None:
        """What changes during a run, in the progress bar (``prog_bar=True``, not sent to the loggers)."""
        module, plan = self.lightning_module, self._plan
        if module is None or plan is None:
            return
        shown = {"pt/frozen": plan.num_frozen}
        if self.pipe_len > 1 or self.chunks != 1:
            shown["pt/pipe"] = plan.pipe_len
        if self.world_size > 1:
            shown["pt/replicas"] = plan.num_replicas
        if self._autocache is not None and self._autocache.store is not None:
            shown["pt/cache_hits"] = round(self._autocache.store.stats().hit_rate, 3)
        module.log_dict({k: float(v) for k, v in shown.items()}, prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        stats = interception_stats(self.stack.container) if self.stack is not None else None
        self._engagement_seen = copy.copy(stats) if stats is not None else InterceptionStats()
        self._engagement_step = self.lightning_module.trainer.global_step if self.lightning_module is not None else 0
        self._runner_installed = self.stack is not None and installed_pipeline(self.stack.container) is not None

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._report_engagement()

    def _report_engagement(self) -> None:
        """Once per epoch: whether the pipeline / cache ran the stack, and AutoCache's counters, to the loggers.

        ``pipetransformer/engaged`` is the share of the model's passes over the stack that the
        installed runner ran; ``pipetransformer/microbatches`` the micro-batches per such pass.
        A runner that saw no pass in an epoch with training steps warns once: the model's forward
        never called the stack's last block (``layers=`` names the wrong container?).
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self.stack is None:
            return
        metrics: dict[str, float] = {}
        stats = interception_stats(self.stack.container)
        if stats is not None and self.is_active:
            since = stats.since(self._engagement_seen)
            self._engagement_seen = copy.copy(stats)
            steps = trainer.global_step - self._engagement_step
            self._engagement_step = trainer.global_step
            # Plans change at epoch starts, before this report: what was installed after the last
            # report is what ran in the period reported now.
            ran, self._runner_installed = self._runner_installed, installed_pipeline(self.stack.container) is not None
            if (ran and steps > 0) or since.deferred:
                metrics.update(since.as_metrics("pipetransformer/"))
                if steps > 0 and since.deferred == 0 and not self._warned_disengaged:
                    self._warned_disengaged = True
                    rank_zero_warn(
                        f"PipeTransformer: {steps} training steps ran but the model never called the last block of "
                        f"'{self.stack.path}', so the pipeline / cache did not run at all. Check that this is the "
                        "block stack the model's forward loops over (layers=, configure_block_stack)."
                    )
        if self._autocache is not None:
            metrics.update(self._autocache.stats())
            rate = self._autocache.period_hit_rate()
            if rate is not None:
                metrics["autocache/period_hit_rate"] = rate
        if metrics and self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ collectives: data on the active group, control on all

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Metric syncs (self.log(sync_dist=True)) run where the metric was logged: on the active
        # ranks. A shadow rank logs nothing, and must not join (it would hang the replicas).
        if self.world_size > 1 and isinstance(tensor, Tensor) and group is None:
            if not self.is_active:
                return tensor
            group = self._replicas.active_group
        if isinstance(tensor, Tensor):
            return lightning_internals.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)  # the tensor itself without a process group
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # LightningModule.all_gather runs in steps and module hooks: on the active ranks only
        # (idle ranks skip those hooks and get their input back, stacked as a group of one).
        if group is None and self._replicas.active_group is not None:
            if not self.is_active:
                return tensor.unsqueeze(0)
            group = self._replicas.active_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        # Every rank, over the gloo control group (no device ids, whatever the data backend).
        if self._replicas.control_group is not None:
            dist.barrier(group=self._replicas.control_group)
        elif lightning_internals.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # Callbacks' broadcasts (ModelCheckpoint paths, times) are control messages: all ranks.
        if self._replicas.control_group is not None:
            return groups.broadcast_object(obj, src=src, group=self._replicas.control_group)
        if not lightning_internals.distributed_is_initialized():
            return obj
        return groups.broadcast_object(obj, src=src, group=None)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Control flow (should_stop, checkpoint decisions) must agree on every rank: over all of them.
        if self._replicas.control_group is None:
            return super().reduce_boolean_decision(decision, all=all)
        votes = torch.tensor(int(decision))
        dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=self._replicas.control_group)
        return bool(votes == self.world_size) if all else bool(votes)

    # ------------------------------------------------------------------ repartitioning

    def on_autofreeze(self, num_frozen: int, callback: Any) -> None:
        """Called by AutoFreeze after it froze more blocks: one process re-plans now; several wait
        for the transition at the next train-epoch start, on every rank (:mod:`lightning_pipetransformer.dp.replicas`)."""
        if self.planner is None:  # before setup (AutoFreeze re-applying a restored prefix)
            return
        self._replicas.on_freeze(num_frozen)

    def _transition(self, trainer: pl.Trainer) -> None:
        """The AutoDP transition at a train-epoch start (called by TransitionCallback on every rank)."""
        self._replicas.transition(trainer, _autofreeze_of(trainer))

    def _apply_plan(self, plan: Plan, announce: bool) -> None:
        """Build this process's pipeline for ``plan`` and route the stack through it."""
        assert self.stack is not None
        plan = self._replicas.localize(plan)
        tune = self.chunks == "auto" and plan.pipe_len not in self._auto_chunks
        if self.chunks == "auto" and not tune:
            plan = dataclasses.replace(plan, chunks=self._auto_chunks[plan.pipe_len])
        self._plan = plan
        if not self.is_active:
            install_pipeline(self.stack.container, None)  # a shadow rank runs no model work
            if announce:
                self._log_plan(plan)
            return
        devices = self.stage_devices
        if self._autocache is None or not self._install_cached_runner(plan, devices):
            runner = pipeline_runner(self.stack.blocks, plan, devices, self._chunks_measured if tune else None)
            install_pipeline(self.stack.container, runner)  # None: the model's loop runs as written
        # Blocks may have moved between devices (K 4 -> 2 moves the tail from device 3 to 1): their
        # optimizer state follows, and the devices left keep no cached blocks for the replica that
        # takes them over.
        dev.optimizer_state_to_param_devices(self.optimizers)
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()
        if announce:
            self._log_plan(plan)

    def _install_cached_runner(self, plan: Plan, devices: tuple[torch.device, ...]) -> bool:
        """Install the AutoCache runner for ``plan``; False when nothing is cached at this boundary."""
        cache, stack = self._autocache, self.stack
        assert cache is not None and stack is not None
        if not cache.serves(plan.num_frozen):
            self._replicas.open_boundary(cache, stack, plan.num_frozen, self._cache_include_pre, devices[0])
        if not cache.serves(plan.num_frozen):
            return False
        # chunks="auto": the M measured for the active blocks' pipe length (no tuning under a cache).
        def chunks_for(pipe_len: int) -> int:
            return plan.chunks if self.chunks != "auto" else self._auto_chunks.get(pipe_len, 1)

        install_pipeline(stack.container, cached_runner(cache, stack.blocks, plan, devices, chunks_for))
        return True

    def _chunks_measured(self, pipe_len: int, chunks: int) -> None:
        self._auto_chunks[pipe_len] = chunks
        if self._plan is not None and self._plan.pipe_len == pipe_len:
            self._plan = dataclasses.replace(self._plan, chunks=chunks)
        rank_zero_info(f"PipeTransformer: chunks='auto' measured M={chunks} for pipe length {pipe_len}.")

    def _log_plan(self, plan: Plan) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        rank_zero_info(
            f"PipeTransformer: {plan.num_frozen} frozen, pipe length {plan.pipe_len}, {plan.chunks} micro-batch(es), "
            f"partition {plan.partition}, {plan.num_replicas} replica(s)."
        )
        # Like Lightning's own metrics: to the loggers while fitting only, never at validate/test/predict.
        if trainer is None or not self.is_global_zero or trainer.state.fn != TrainerFn.FITTING:
            return
        metrics = {
            "pipetransformer/num_frozen": float(plan.num_frozen),
            "pipetransformer/pipe_len": float(plan.pipe_len),
            "pipetransformer/chunks": float(plan.chunks),
            "pipetransformer/replicas": float(plan.num_replicas),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ optimizer state per device

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
        dev.optimizer_state_to_param_devices(self.optimizers)


    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.planner is not None:
            checkpoint[_CHECKPOINT_KEY] = {
                "auto_chunks": {str(k): m for k, m in self._auto_chunks.items()},
                "plan": self._plan.to_dict() if self._plan is not None else None,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get(_CHECKPOINT_KEY)
        return checkpoint

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            idle_hooks.restore_module_hooks(self.lightning_module)
        if self.stack is not None:
            remove_pipeline(self.stack.container)
        if self._frozen_outputs is not None:
            self._frozen_outputs.remove()
            self._frozen_outputs = None
        if self._autocache is not None:
            self._autocache.detach()
            self._autocache.close()
        for config in self._kv_cache_configs:
            config.use_cache = True
        self._kv_cache_configs = []
        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            dev.after_unwrap()
            self.model = module  # unwrap, as DDPStrategy does
        if module is not None and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        peers = self._replicas.peers
        gone = faults.dead_peers(peers) if peers else []
        if gone and exception.args and isinstance(exception.args[0], str):
            named = ", ".join(f"rank {r} (pid {peers[r][1]})" for r in gone)
            exception.args = (
                f"{exception.args[0]}\n[pipetransformer] {named} on this host is gone (it died or was killed): "
                f"rank {self.global_rank}'s collective failed because of it. Look at that rank's log for the cause.",
                *exception.args[1:],
            )
        lightning_internals.augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                "A parameter that requires grad did not take part in producing the loss on one replica. "
                "strategy='pipetransformer' builds DDP without find_unused_parameters: freeze such parameters "
                "(requires_grad=False) or use them in every step."
            ),
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="PipeTransformer: pipeline the block stack, repartition as AutoFreeze freezes blocks",
        )


def _autofreeze_of(trainer: pl.Trainer) -> Any:
    from lightning_pipetransformer.freeze.callback import AutoFreeze

    return next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)


PipeTransformerStrategy.register_strategies(StrategyRegistry)
