"""PipeTransformerStrategy: ``strategy="pipetransformer"`` runs the model's block stack as a pipeline.

The user's LightningModule is unchanged. At setup the strategy finds the block stack, asks the
AutoPipe planner for a plan (frozen blocks F, pipe length K, micro-batches M, partition), moves
each block to its stage's device and makes the model's own loop over the stack call the
pipeline executor once (:func:`~lightning_pipetransformer.core.pipeline.install_pipeline`:
state-dict keys stay the plain model's). When :class:`~lightning_pipetransformer.AutoFreeze`
freezes more blocks it calls :meth:`PipeTransformerStrategy.on_autofreeze` at the start of the
epoch, and the strategy re-plans: the pipeline shrinks when the compression rule allows.

Process layout. Lightning starts one process per device. With ``devices=1`` the one process
drives all K stages on its device ("virtual stages": the CPU, or streams of one GPU), which is
how everything is tested on CPU. With ``devices=G > 1`` every process is a data-parallel
replica of a pipeline of length 1 (DDP around the frozen-aware module). Pipelines of length
K > 1 across several processes, where idle processes join as K shrinks, are AutoDP (issue #5)
and are refused with a clear error until they land.

Everything outside the stack (embeddings, head, loss, metrics) stays on the first stage's
device, and the pipeline's output is handed back there, so ``training_step`` needs no change.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from .core.costs import parameter_costs, parameter_count
from .core.discovery import BlockStack
from .core.pipeline import Pipeline, install_pipeline, remove_pipeline
from .core.planner import AutoPipe, Plan
from .auto_chunks import ChunkTuner
from .module_stack import block_stack_of

__all__ = ["PipeTransformerStrategy"]

_CHECKPOINT_KEY = "pipetransformer"


class PipeTransformerStrategy(DDPStrategy):
    """Pipeline-parallel training of a Transformer's block stack, repartitioned as blocks freeze.

    Args:
        pipe_len: initial pipeline length K0 (stages per replica). Default: 1 with several
            processes, else 1 as well; set it to pipeline over virtual stages with ``devices=1``.
        chunks: micro-batches per mini-batch M, an int (default 1) or ``"auto"`` (measured at
            the first batch of every new pipe length over K..6K, as the paper did).
        frozen_cost: weight of a frozen block relative to an active one when partitioning
            (paper: 1/6: a frozen block runs forward only).
        layers: the block container's attribute path relative to the LightningModule. Default:
            AutoFreeze's stack if AutoFreeze is used, else the module's ``configure_block_stack()``,
            else automatic discovery.
        process_group_backend: ``"nccl"``/``"gloo"``; default by device type.
        timeout: seconds before a collective gives up (a dead rank ends the run, not hangs it).
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=float(timeout)),
        )
        self.pipe_len = pipe_len
        self.chunks = chunks
        self.frozen_cost = float(frozen_cost)
        self.layers = layers
        self.stack: BlockStack | None = None
        self.planner: AutoPipe | None = None
        self._plan: Plan | None = None
        self._pipeline: Pipeline | None = None
        self._restored: dict[str, Any] | None = None
        self._auto_chunks: dict[int, int] = {}  # chunks="auto": the measured M per pipe length

    # ------------------------------------------------------------------ what users read

    @property
    def plan(self) -> Plan | None:
        """The plan in force: ``num_frozen``, ``pipe_len``, ``chunks``, ``partition``, ``active_ranks``."""
        return self._plan

    @property
    def stage_devices(self) -> tuple[torch.device, ...]:
        """The devices this process's pipeline stages run on."""
        if self._plan is None:
            return (self.root_device,)
        if self.num_processes == 1:
            return (self.root_device,) * self._plan.pipe_len
        return tuple(torch.device(d) for d in self._plan.devices_for(self.local_rank))

    # ------------------------------------------------------------------ set-up, in loop order

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_supported(trainer)
        if self.world_size == 1:
            # Lightning injects a shuffling DistributedSampler under every DDP-family strategy,
            # even for one process. One process is a single replica: keep the user's sampler, so
            # the strategy is a drop-in for a single-device Trainer (same batches, same order).
            trainer._accelerator_connector.use_distributed_sampler = False
        module = self.lightning_module
        assert module is not None
        autofreeze = _autofreeze_of(trainer)
        if self.layers is None and autofreeze is not None and autofreeze.stack is not None:
            self.stack = autofreeze.stack
        else:
            self.stack = block_stack_of(module, self.layers)
        self.planner = self._make_planner()
        if self._restored is not None:
            self._auto_chunks = {int(k): int(m) for k, m in self._restored.get("auto_chunks", {}).items()}
        num_frozen = autofreeze.num_frozen if autofreeze is not None else 0
        # DDPStrategy.setup: accelerator, precision, model_to_device, DDP (only if > 1 process:
        # see configure_ddp), optimizers, then all optimizer state to the root device.
        super().setup(trainer)
        self._apply_plan(self.planner.plan(num_frozen), announce=True)
        # Each optimizer state tensor belongs with its parameter, which may sit on another
        # stage's device than the root one DDPStrategy.setup moved everything to.
        _optimizer_state_to_param_devices(self.optimizers)

    def _check_supported(self, trainer: pl.Trainer) -> None:
        if self.num_processes > 1 and self.pipe_len > 1:
            raise ValueError(
                f"pipe_len={self.pipe_len} with {self.num_processes} processes per node needs AutoDP (idle processes "
                "that join as the pipeline shrinks), which is not implemented yet (issue #5). Use devices=1 with "
                "pipe_len=K to pipeline over K stages of one device, or pipe_len=1 for data parallelism."
            )
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
        # Everything outside the stack lives on the first stage's device; the stack is placed
        # per stage by _apply_plan.
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def configure_ddp(self) -> None:
        # One process has no gradients to average; a DDP wrapper would only add a reducer that
        # breaks as soon as AutoFreeze turns requires_grad off.
        if self.world_size > 1:
            super().configure_ddp()

    @override
    def determine_ddp_device_ids(self) -> list[int] | None:
        if self.root_device.type == "cpu":
            return None
        return [self.root_device.index]

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.num_processes > 1 and len(self.optimizers) > 1:
            raise ValueError("strategy='pipetransformer' with several processes supports one optimizer only.")

    # ------------------------------------------------------------------ repartitioning

    def on_autofreeze(self, num_frozen: int, callback: Any) -> None:
        """Called by AutoFreeze after it froze more blocks (every rank, at an epoch start)."""
        if self.planner is None:  # before setup (AutoFreeze re-applying a restored prefix)
            return
        self._apply_plan(self.planner.plan(num_frozen), announce=True)
        if self.world_size > 1:
            # DDP's gradient buckets were fixed when it was built: re-wrap so frozen parameters
            # leave the all-reduce.
            self.model = self.lightning_module
            self.configure_ddp()

    def _apply_plan(self, plan: Plan, announce: bool) -> None:
        """Build this process's pipeline for ``plan`` and route the stack through it."""
        assert self.stack is not None
        if self.num_processes == 1:
            # One process cannot add data-parallel replicas: keep its single pipeline.
            plan = dataclasses.replace(plan, devices=plan.devices[:1], active_ranks=(self.global_rank,))
        tune = self.chunks == "auto" and plan.pipe_len not in self._auto_chunks
        if self.chunks == "auto" and not tune:
            plan = dataclasses.replace(plan, chunks=self._auto_chunks[plan.pipe_len])
        self._plan = plan
        remove_pipeline(self.stack.container)
        devices = self.stage_devices
        pipeline = Pipeline(self.stack.blocks, plan.partition, devices, chunks=plan.chunks, num_frozen=plan.num_frozen)
        pipeline.place()
        self._pipeline = pipeline
        runner: Any = pipeline
        if tune:
            runner = ChunkTuner(self.stack.blocks, plan.partition, devices, plan.num_frozen, self._chunks_measured)
        if tune or plan.pipe_len > 1 or plan.chunks > 1:
            install_pipeline(self.stack.container, _ReturnTo(runner, devices[0]))  # type: ignore[arg-type]
        if announce:
            self._log_plan(plan)

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
        if trainer is None or not self.is_global_zero:
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
        _optimizer_state_to_param_devices(self.optimizers)


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
        if self.stack is not None:
            remove_pipeline(self.stack.container)
        self._pipeline = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="PipeTransformer: pipeline the block stack, repartition as AutoFreeze freezes blocks",
        )


class _ReturnTo:
    """Calls the pipeline and hands its output back to the first stage's device."""

    def __init__(self, pipeline: Any, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device
        # install_pipeline checks these against the container's children.
        self.blocks = pipeline.blocks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _to_device(self.pipeline(*args, **kwargs), self.device)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple):
        return type(value)(_to_device(v, device) for v in value) if not hasattr(value, "_fields") else type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


def _optimizer_state_to_param_devices(optimizers: list[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                # 'step' counters stay where the optimizer keeps them (CPU for capturable=False).
                if isinstance(value, torch.Tensor) and key != "step" and value.device != param.device:
                    state[key] = value.to(param.device)


def _autofreeze_of(trainer: pl.Trainer) -> Any:
    from .autofreeze import AutoFreeze

    return next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)


PipeTransformerStrategy.register_strategies(StrategyRegistry)
