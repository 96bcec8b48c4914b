"""PipeTransformerStrategy: ``strategy="pipetransformer"`` runs the model's block stack as a pipeline.

The user's LightningModule is unchanged. At setup the strategy finds the block stack and builds
the :class:`~lightning_pipetransformer.engine.Engine`, the one owner of the plan in force (frozen
blocks F, pipe length K, micro-batches M, partition): it installs the runner through which the
model's own loop over the stack calls the pipeline or the cache once per pass (state-dict keys
stay the plain model's). :class:`~lightning_pipetransformer.AutoFreeze` calls
:meth:`PipeTransformerStrategy.on_freeze_point` at every freeze point: one process re-plans at
once; several run the transition at the epoch start, on every rank, which the
:class:`~lightning_pipetransformer.coordinator.Coordinator` choreographs.

Process layout. Lightning starts one process per device. With ``devices=1`` the one process
drives all K stages on its device ("virtual stages": the CPU, or streams of one GPU), which is
how everything is tested on CPU. With ``devices=G > 1`` (AutoDP) local rank ``j*K`` drives a
pipeline replica over devices ``[j*K, (j+1)*K)`` and the other processes are shadow ranks that
follow the loop without model work; as K shrinks they become replicas (:mod:`~lightning_pipetransformer.dp`).

This class holds Lightning's hooks, in the order the loop calls them; each calls free functions
and parts that take data and return data (the coordinator, engine, dp/, cache/hooks, report, config). Everything
outside the stack (embeddings, head, loss, metrics) stays on the first stage's device, so
``training_step`` needs no change.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import lightning_internals, report, trainer_side
from lightning_pipetransformer.cache import hooks as cache_hooks
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.config import PipeTransformerConfig, argument_docstring, check_lightning_arguments, strategy_arguments
from lightning_pipetransformer.coordinator import Coordinator, LoopSide
from lightning_pipetransformer.dp import data, faults, groups, idle, idle_hooks, state_transfer
from lightning_pipetransformer.dp.ddp import UNUSED_PARAMETER_ERROR, UNUSED_PARAMETER_HINT, GradientSync
from lightning_pipetransformer.dp.replicas import Elastic
from lightning_pipetransformer.engine import Engine, make_planner
from lightning_pipetransformer.freeze.apply import in_frozen_prefix
from lightning_pipetransformer.freeze.seam import FreezeSource
from lightning_pipetransformer.pipe.planner import AutoPipe
from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.processes import ProcessLayout
from lightning_pipetransformer.stack.declared import refuse_uncalled_blocks, stack_for_strategy
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.execution import OrderWatch
from lightning_pipetransformer.stack.input_grad import FrozenOutputs
from lightning_pipetransformer.stack.interception import remove_pipeline
from lightning_pipetransformer.stack.kv_cache import off_while_fitting
from lightning_pipetransformer.stack.model_flags import check_model_flags

__all__ = ["PipeTransformerStrategy"]

_CHECKPOINT_KEY = "pipetransformer"


class PipeTransformerStrategy(ProcessLayout):
    """Pipeline-parallel training of a Transformer's block stack, repartitioned as blocks freeze.

    ``strategy="pipetransformer"`` (or this class with arguments). The arguments are validated into
    :attr:`config` when the strategy is built, before any process starts; docs/configuration.md
    lists them with their defaults, and the entries below the ``Args`` header are written from the
    same field docstrings when this module is imported (:func:`~lightning_pipetransformer.config.argument_docstring`).

    Args:
        **lightning: ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin``: set by the Trainer; pass them only to override it (as for DDPStrategy).
    """

    strategy_name = "pipetransformer"

    def __init__(
        self,
        pipe_len: int = 1,
        chunks: int | Literal["auto"] = 1,
        frozen_cost: float = 1 / 6,
        layers: str | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        batch_policy: Literal["replica", "global"] = "replica",
        cache: bool | Literal["auto"] = False,
        cache_key: Literal["content", "index"] = "content",
        cache_dir: str | None = None,
        cache_memory: int = 4 * 2**30,
        cache_skip_embeddings: bool = True,
        cache_frozen_eval: bool = False,
        cache_keep: bool = False,
        cache_keep_bytes: int = 32 * 2**30,
        self_check: bool = True,
        **lightning: Any,
    ) -> None:
        arguments = locals()  # first: exactly the arguments (tests/unit/test_config.py holds the signature to the config)
        #: The validated arguments (frozen): the parts below read their settings from here.
        self.config = PipeTransformerConfig.from_arguments({name: arguments[name] for name in strategy_arguments()})
        # Lightning's own arguments through **lightning: the Trainer sets them, and LightningCLI's help
        # then lists only this strategy's arguments.
        parallel = check_lightning_arguments(lightning)
        super().__init__(pipe_len=self.config.pipe_len, process_group_backend=process_group_backend, timeout=self.config.timeout, **parallel)
        #: The plan's owner (None before setup, or when the model has no block stack).
        self.engine: Engine | None = None
        #: AutoCache of this fit (None without ``cache``).
        self.autocache: AutoCache | None = None
        self._stack: BlockStack | None = None
        #: What the ranks do together around the plan (None before setup, or without a block stack).
        self._coordinator: Coordinator | None = None
        self._gradients = GradientSync()
        self._report: report.EngagementReport | None = None
        self._restored: dict[str, Any] | None = None
        self._kv_cache_configs: list[Any] = []  # configs whose use_cache this fit turned off
        self._frozen_outputs: FrozenOutputs | None = None
        self._signals = faults.SignalNotice()  # SIGTERM noted by the handler, acted on at the next step
        self._order_watch: OrderWatch | None = None
        self._cache_stats = report.CacheStatsByCall()  # cache_stats_by_stage

    # ------------------------------------------------------------------ what users read

    @property
    @override
    def plan(self) -> Plan | None:
        """The plan in force: ``num_frozen``, ``pipe_len``, ``chunks``, ``partition``, ``active_ranks``."""
        return self.engine.plan if self.engine is not None else None

    @property
    def stack(self) -> BlockStack | None:
        """The block stack the plans are over (None when the model has none)."""
        return self._stack

    @property
    def planner(self) -> AutoPipe | None:
        return self.engine.planner if self.engine is not None else None

    @property
    def last_transition(self) -> dict[str, float]:
        """Seconds per phase of the last AutoDP transition on this rank (for logs and benchmarks)."""
        return self._coordinator.last_transition if self._coordinator is not None else {}

    @property
    def gradient_group(self) -> Any | None:
        """The group this replica's gradients are averaged over (DDP's, or by hand after backward), or None."""
        return self._gradients.gradient_group(self.model)

    @property
    def autofreeze_decides_here(self) -> bool:
        """Whether AutoFreeze's rule decides on this process: with several, only on global rank 0."""
        return self._replicas.decides_here

    @property
    def cache_stats(self) -> dict[str, float] | None:
        """AutoCache hits, misses and bytes of the current boundary (``None`` without a cache); after ``fit`` they go on
        counting what validate, test and predict look up (each call's own counts: :attr:`cache_stats_by_stage`)."""
        return self.autocache.stats() if self.autocache is not None else None

    @property
    def cache_stats_by_stage(self) -> dict[str, dict[str, float]]:
        """AutoCache's counters per trainer call of this strategy: ``"fit"`` as at the fit's end, and ``"validate"``,
        ``"test"``, ``"predict"`` as what each such call after it counted (hits, misses ... of that call alone; sizes
        and the boundary as at its end). The last call of each kind."""
        return dict(self._cache_stats.by_call)

    # ------------------------------------------------------------------ set-up, in loop order

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.num_processes > 1 and trainer.lightning_module is not None and not trainer.lightning_module.automatic_optimization:
            raise ValueError("strategy='pipetransformer' with several processes supports automatic optimization only.")
        module = self.lightning_module
        assert module is not None
        autofreeze = trainer_side.autofreeze_of(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        previous_stack = self._stack
        self._stack = self._find_stack(module, autofreeze, fitting)
        # chunks="auto" measured in an earlier fit of this strategy still holds (validate after fit).
        measured = dict(self.engine.auto_chunks) if self.engine is not None else {}
        self.engine, self._report, self._coordinator = None, None, None
        if self._stack is None:  # nothing to freeze or pipeline: plain single-device / DDP training (Lightning's SIGTERM handling)
            self._setup_model_and_optimizers(trainer, None)
            return
        if self.is_distributed:  # Lightning's handler would run collectives inside the signal handler; the coordinator reads ours
            self._signals.reset()
            lightning_internals.replace_sigterm_notifier(trainer, self._signals)
        stack = self._stack
        # Which inputs of the stack require grad only because a hook marked them (gradient checkpointing, PEFT).
        self._frozen_outputs = FrozenOutputs(m for _, m in stack.pre)
        planner = make_planner(
            stack, self.config, num_processes=self.num_processes, num_nodes=self.num_nodes,
            root_device=self.root_device, parallel_devices=self.parallel_devices or [self.root_device],
        )  # fmt: skip
        if self.config.pipelines_or_caches:
            refuse_uncalled_blocks(stack, [a for a in self.config.asks_for_a_stack() if not a.startswith("layers=")])
            check_model_flags(module, fitting)
            if fitting:  # restored at teardown
                self._kv_cache_configs = off_while_fitting(module, announce=rank_zero_info)
        # With trainable embeddings the boundary depends on more than their inputs: key on the hidden state.
        include_pre = bool(autofreeze is None or autofreeze.freeze_embeddings)
        # validate/test/predict after fit: the fit's cache, its entries and counters, when the stack is the same.
        previous = self.autocache
        reuse = not fitting and previous is not None and previous_stack is not None and previous_stack.container is stack.container
        self.autocache = None
        if self.config.cache.enabled and reuse:
            assert previous is not None
            self.autocache = cache_hooks.reuse_autocache(previous, stack=stack, module=module, include_pre=include_pre)
        elif self.config.cache.enabled:
            self.autocache = cache_hooks.make_autocache(
                self.config.cache, stack=stack, module=module, default_root_dir=trainer.default_root_dir,
                processes_per_node=self.num_processes, precision=str(trainer.precision),
                forward_context=self.precision_plugin.forward_context, include_pre=include_pre,
                can_freeze=autofreeze is not None, pre_freezes_first=cache_hooks.pre_freezes_first(autofreeze, stack),
                announce=rank_zero_info,
            )  # fmt: skip
        if self.autocache is not None:
            self._cache_stats.begin(self.autocache.stats(), reused=reuse)
        self.engine = Engine(stack, planner, self.config.chunks, self.autocache, include_pre, announce=rank_zero_info)
        self.engine.auto_chunks = measured
        if self._restored is not None:
            self.engine.load_state_dict(self._restored)
        self._report = report.EngagementReport(stack, rank_zero_warn)
        if fitting:  # frozen blocks are in eval mode on purpose (restored from a checkpoint, before the first batch)
            lightning_internals.exclude_from_eval_mode_warning(trainer, lambda m: in_frozen_prefix(stack, m))
        # Unless AutoFreeze watches this very stack, what runs before it is read from the first training forward here.
        watched = autofreeze is not None and autofreeze.stack is stack
        self._order_watch = OrderWatch(module, stack, announce=rank_zero_info) if not watched and stack.provisional else None
        self._coordinator = Coordinator(
            self.engine, self._replicas, _loop_side(self, trainer), stack=stack, cache=self.autocache, ranks=self.ranks,
            signals=self._signals, self_check=self.config.self_check, announce=rank_zero_info,
        )  # fmt: skip
        if isinstance(self._replicas, Elastic):  # the coordinator's step agreement carries a SIGTERM: no per-step broadcast of Lightning's
            lightning_internals.replace_sigterm_broadcast(trainer)
        plan = self._coordinator.first_plan(autofreeze)
        if isinstance(self._replicas, Elastic):
            idle_hooks.prepare_idle_ranks(trainer, module, lambda: self.is_active, self._replicas.control_group)
            if self._replicas.is_active(plan):  # torchmetrics sync over the replicas, not WORLD (idle ranks never compute)
                groups.point_metrics_at(module, self._replicas.active_group)
        self._setup_model_and_optimizers(trainer, plan)

    def _find_stack(self, module: pl.LightningModule, autofreeze: FreezeSource | None, fitting: bool) -> BlockStack | None:
        """The block stack to plan over; ``None`` (with a warning) when the model has none and
        nothing asks for one, so that any LightningModule trains as under the plain strategy."""
        if self.config.layers is None and autofreeze is not None:
            if fitting:  # AutoFreeze's stack; a model built in setup() / configure_model() exists only now
                return autofreeze.find_stack(module, module.trainer)
            if autofreeze.stack is not None:
                return autofreeze.stack
        return stack_for_strategy(module, self.config.layers, self.config.asks_for_a_stack(), warn=rank_zero_warn)

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
            assert self._coordinator is not None
            self._coordinator.apply(plan)
        if fitting:
            self.configure_ddp(init_sync=True)  # DDP over the active replicas (several processes only)
        # Rank 0's weights to the replicas where no DDP wrapper copies them (averaged by hand; not fitting, as DDPStrategy
        # does without a wrapper), through buffers on each one's own device: a shadow rank holds its blocks on the CPU,
        # and a replica's blocks may sit on several devices.
        if self._gradients.by_hand if fitting else self.is_distributed and self.is_active:
            state_transfer.broadcast_module_state(self.lightning_module, src=0, group=self._replicas.active_group, via=self.root_device)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:  # each optimizer state tensor belongs with its parameter (a checkpoint's arrives on the CPU)
            dev.optimizer_state_to_param_devices(self.optimizers)

    @override
    def model_to_device(self) -> None:
        """Everything outside the stack to the first stage's device; the blocks go straight to their
        own stage's device when a plan is applied (a shadow rank holds no block at all). Through
        ``Module._apply``, as ``Module.to`` moves them: torchmetrics states move only that way."""
        assert self.model is not None
        if self._stack is None:
            dev.place_module(self.model, self.root_device)
            return
        dev.place_outside(self.model, self._stack.blocks, self.root_device)

    def configure_ddp(self, init_sync: bool = True) -> None:
        """Gradient averaging over the active replicas for the plan in force (:class:`~lightning_pipetransformer.dp.ddp.GradientSync`)."""
        plan, module = self.plan, self.lightning_module
        assert module is not None
        self.model = self._gradients.unwrap(self.model, module)
        self.model = self._gradients.wrap(
            module, group=self._replicas.active_group, host_group=self._replicas.active_host_group, world_size=self.world_size, active=self.is_active,
            pipe_len=plan.pipe_len if plan is not None else 1, num_replicas=plan.num_replicas if plan is not None else self.world_size,
            root_device=self.root_device, stage_devices=self.stage_devices, init_sync=init_sync,
        )  # fmt: skip

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.num_processes > 1 and len(self.optimizers) > 1:
            raise ValueError("strategy='pipetransformer' with several processes supports one optimizer only.")

    # ------------------------------------------------------------------ data (AutoDP: shares and stand-ins)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        plan = self.plan
        if self.world_size == 1 or plan is None:
            return dataloader
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            data.check_train_loader(dataloader, plan.num_replicas)
            self._check_val_check_interval(trainer, dataloader)
            if self.config.batch_policy == "global":
                size = data.per_replica_batch_size(getattr(dataloader, "batch_size", None), self.world_size, plan.num_replicas)
                dataloader = lightning_internals.loader_with_batch_size(dataloader, size)
        return dataloader if self.is_active else idle.stand_in_loader(dataloader)  # a shadow rank loads nothing

    def _check_val_check_interval(self, trainer: pl.Trainer, dataloader: Any) -> None:
        """An int ``val_check_interval`` must fit the shortest epoch batch_policy='replica' reaches."""
        interval, autofreeze = trainer.val_check_interval, trainer_side.autofreeze_of(trainer)
        if (
            self.config.batch_policy != "replica" or isinstance(interval, bool) or not isinstance(interval, int)
            or trainer.check_val_every_n_epoch is None or not trainer.limit_val_batches or autofreeze is None
            or self.engine is None or autofreeze.stack is None
        ):  # fmt: skip
            return
        most_frozen = autofreeze.most_frozen(trainer.max_epochs)
        data.check_val_check_interval(interval, dataloader, self.engine.most_replicas(most_frozen), trainer.limit_train_batches)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if idle.is_idle_batch(batch):
            return batch  # nothing to move, and the user's transfer hooks must not see a placeholder
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if self.autocache is not None and self.config.cache.key == "index" and trainer_side.moves_batches_as_is(self.lightning_module):
            self.autocache.indices.remember(batch, moved)  # index keys read on the host, without a wait
        return moved

    # ------------------------------------------------------------------ the loop: train start, batches, steps

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._report is not None and trainer is not None:
            self._report.start(trainer.global_step)
            if trainer_side.autofreeze_of(trainer) is None:  # no freeze points: the first boundary opens on every rank here
                with faults.signals_held():
                    assert self._coordinator is not None
                    self._coordinator.sync_cache_boundary()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            self._report_engagement()
        self._show_in_progress_bar()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._new_pass("train", args, kwargs)
        if self._coordinator is not None:
            self._coordinator.follow_the_model(args[1] if len(args) > 1 else kwargs.get("batch_idx", 1), trainer_side.autofreeze_of(self.lightning_module.trainer))
        step = super().training_step
        output = self._watching_order(
            lambda: self._step_together("training_step", lambda: idle.idle_loss(self.root_device), step, "train", args, kwargs)
        )
        if self.autocache is not None:
            cache_hooks.check_budget(self.autocache, self._replicas.control_group)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if not self.is_active:
            # Lightning's closure must run (it checks its result was consumed); the step must not:
            # global_step counts these calls, so shadow ranks stay in step with the replicas.
            closure()
            return None
        if self._gradients.by_hand:
            step_closure = closure

            def closure() -> Any:  # the last micro-batch's backward, then the replicas' average
                result = step_closure()
                self._gradients.average((p for group in optimizer.param_groups for p in group["params"]), self.root_device)
                return result

        dev.check_optimizer(optimizer)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self.autocache is not None:
            self.autocache.after_backward()  # a first step served from kept entries cut only gradients a plain run drops

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._new_pass("val", args, kwargs)
        step = super().validation_step
        return self._watching_order(lambda: self._step_together("validation_step", lambda: None, step, "val", args, kwargs), fit=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._new_pass("test", args, kwargs)
        step = super().test_step
        return self._watching_order(lambda: self._step_together("test_step", lambda: None, step, "test", args, kwargs), fit=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._new_pass("predict", args, kwargs)
        step = super().predict_step
        return self._watching_order(lambda: self._step_together("predict_step", lambda: None, step, "predict", args, kwargs), fit=False)

    def _new_pass(self, stage: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._coordinator is not None:
            self._coordinator.new_pass(stage, args[1] if len(args) > 1 else kwargs.get("batch_idx"))

    def _watching_order(self, step: Any, fit: bool = True) -> Any:
        """Run ``step``, reading what runs before the stack from its forward while that is not known yet
        (training steps; evaluation steps only outside fit, whose order comes from a training step)."""
        watch = self._order_watch
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if watch is None or (not fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING):
            return step()
        watch.start()
        try:
            output = step()
        except BaseException:
            watch.remove()
            raise
        if watch.finish():
            self._order_watch = None
        return output

    def _step_together(self, where: str, idle_output: Any, step: Any, stage: str, args: Any, kwargs: Any) -> Any:
        """A step on this rank (a shadow rank's stand-in), agreed on by every rank (:meth:`Coordinator.step_together`)."""
        cache = self.autocache

        def run() -> Any:
            if not self.is_active:
                return idle_output()
            if cache is not None and self.config.cache.key == "index":
                cache_hooks.index_keys_from(cache, args, kwargs, stage)
            return step(*args, **kwargs)

        return self._coordinator.step_together(where, run) if self._coordinator is not None else run()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._report_engagement()

    def _show_in_progress_bar(self) -> None:
        """What changes during a run, in the progress bar only (counts as integers; not sent to the loggers)."""
        module, plan = self.lightning_module, self.plan
        if module is None or plan is None:
            return
        lightning_internals.show_in_progress_bar(module.trainer, report.progress_values(plan, self.config, self.world_size, self.autocache))

    def _report_engagement(self) -> None:
        """Once per epoch: whether the pipeline / cache ran the stack, and AutoCache's counters (:mod:`~lightning_pipetransformer.report`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self._report is None:
            return
        metrics = {**self._report.metrics(trainer.global_step, self.is_active), **report.cache_metrics(self.autocache)}
        if metrics and self.is_global_zero:
            trainer_side.log_metrics(trainer, metrics)

    # ------------------------------------------------------------------ freeze points and the transition

    def on_freeze_point(self, trainer: pl.Trainer, autofreeze: FreezeSource, epoch_start: bool) -> None:
        """AutoFreeze reached a freeze point (on every rank, decided or not). One process re-plans now,
        also inside an epoch; several change replicas together, at epoch starts only (:meth:`Coordinator.transition`)."""
        if self._coordinator is not None:  # no block stack, or not set up
            self._coordinator.on_freeze_point(autofreeze, epoch_start)

    # ------------------------------------------------------------------ checkpoints

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
        dev.optimizer_state_to_param_devices(self.optimizers)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.engine is not None:
            checkpoint[_CHECKPOINT_KEY] = self.engine.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get(_CHECKPOINT_KEY)
        return checkpoint

    # ------------------------------------------------------------------ teardown

    def _ended_together(self, exception: BaseException) -> bool:
        together = self._coordinator is not None and bool(self._coordinator.stopping_signal or self._coordinator.failing_together)
        return together or super()._ended_together(exception)

    @override
    def teardown(self) -> None:
        if self._order_watch is not None:
            self._order_watch.remove()
            self._order_watch = None
        module = self.lightning_module
        trainer = lightning_internals.attached_trainer(module)
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        self._stop_watch(finished=not interrupted)
        if module is not None:
            idle_hooks.restore_module_hooks(module)
        if self._stack is not None:
            remove_pipeline(self._stack.container)
        if self._frozen_outputs is not None:
            self._frozen_outputs.remove()
            self._frozen_outputs = None
        if self.autocache is not None:
            if trainer is not None:
                self._cache_stats.end(str(trainer.state.fn.value if trainer.state.fn is not None else "fit"), self.autocache.stats())
            cache_hooks.close_autocache(self.autocache, trainer.default_root_dir if trainer is not None else None, self.config.cache.dir)
        for config in self._kv_cache_configs:
            config.use_cache = True
        self._kv_cache_configs = []
        if module is not None:
            self.model = self._gradients.unwrap(self.model, module)  # unwrap, as DDPStrategy does
        if not interrupted:
            # This call's groups are freed (the next trainer call makes its own); after a failure
            # they are left as they are (a collective may still be pending on them, which a destroy
            # could wait for); the process ends soon after.
            self._replicas.close()
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._note_failure(exception)
        stopping = self._coordinator.stopping_signal if self._coordinator is not None else 0
        if isinstance(exception, SystemExit) and stopping:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            faults.exit_for_signal(exception, stopping, self.global_rank, trainer.global_step if trainer is not None else "?")
        else:
            self._name_failed_peers(exception)
        lightning_internals.augment_message(exception, pattern=UNUSED_PARAMETER_ERROR, new_message=UNUSED_PARAMETER_HINT)
        self._end_after_failure(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="PipeTransformer: pipeline the block stack, repartition as AutoFreeze freezes blocks"
        )


def _loop_side(strategy: PipeTransformerStrategy, trainer: pl.Trainer) -> LoopSide:
    """What the coordinator may read of this trainer call's loop and ask of Lightning's side."""
    module = strategy.lightning_module
    assert module is not None

    def drop_gradient_sync() -> None:
        strategy.model = strategy._gradients.unwrap(strategy.model, module)

    return LoopSide(
        position=lambda: (trainer.current_epoch, trainer.global_step), fitting=trainer.state.fn == TrainerFn.FITTING,
        module=module, optimizers=lambda: strategy.optimizers, log_metrics=lambda metrics: trainer_side.log_metrics(trainer, metrics),
        loop_state=lambda: ([c.scheduler for c in trainer.lr_scheduler_configs], getattr(strategy.precision_plugin, "scaler", None)),
        drop_gradient_sync=drop_gradient_sync, sync_gradients=lambda: strategy.configure_ddp(init_sync=False),
        restart_metric_order=lambda: idle_hooks.restart_metric_order(trainer),
        rebuild_train_loader=lambda: lightning_internals.rebuild_train_loader(trainer),
        stop_after_this_batch=lambda: lightning_internals.mark_sigterm_received(trainer),
    )  # fmt: skip


# The Args of the class docstring, from the config's field docstrings (one text for the docs, the help and the errors).
PipeTransformerStrategy.__doc__ = (PipeTransformerStrategy.__doc__ or "").replace("    Args:\n", f"    Args:\n{argument_docstring()}\n", 1)
PipeTransformerStrategy.register_strategies(StrategyRegistry)
