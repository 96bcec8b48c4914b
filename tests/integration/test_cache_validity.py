"""The cache checks what it serves: whoever freezes, unfreezes, edits or swaps the prefix, cache on == cache off.

Each test fits a tiny model of the BERT family and of a decoder (Llama) with the cache and the same fit
under a plain Trainer (``strategy="auto"``), with the same callbacks, and checks the weights and the
validation losses; beside each, the engagement: the cache served hits, saw the change
(``prefix_changes``), and the block that was changed really trained or ran.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, EMAWeightAveraging

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.cache.validity import NondeterministicPrefixError
from lightning_pipetransformer.stack.discovery import find_block_stack
from tests.helpers.block_runs import ForwardRunsPerEpoch
from tests.helpers.compare import assert_state_close
from tests.helpers.families import FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer

FAMILIES = ("bert", "llama")
SCHEDULE = {1: 1, 2: 3}  # 4 blocks: block 0 frozen at epoch 1, blocks 1..2 at epoch 2


class ValLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def blocks_of(pl_module) -> list[torch.nn.Module]:
    return find_block_stack(pl_module.model).blocks


def run(family, strategy, callbacks, *, epochs=5, freeze=True, module=None, train_size=18, **trainer_kwargs):
    """``(module, trainer, validation losses)`` of one fit with ``callbacks`` (after AutoFreeze(SCHEDULE) if ``freeze``)."""
    module = module or FamilyModule(family)
    losses = ValLosses()
    found = [AutoFreeze(schedule=SCHEDULE)] if freeze else []
    trainer = cpu_trainer(strategy, [*found, *callbacks, losses], max_epochs=epochs, **trainer_kwargs)
    trainer.fit(module, family_data(family, n=train_size), family_data(family, n=12, seed=5))
    return module, trainer, losses.losses


def cached(tmp_path, pipe_len=1, **kwargs) -> PipeTransformerStrategy:
    return PipeTransformerStrategy(pipe_len=pipe_len, cache=True, cache_dir=str(tmp_path / "cache"), **kwargs)


def assert_same(a, b) -> None:
    assert_state_close(a[0].state_dict(), b[0].state_dict(), rtol=1e-4, atol=1e-5)
    assert a[2] == pytest.approx(b[2], rel=1e-5, abs=1e-6)


def stats(trainer) -> dict[str, float]:
    found = trainer.strategy.cache_stats
    assert found is not None
    return found


# ---------------------------------------------------------------------------- unfreezing


class Unfreeze(Callback):
    """``requires_grad_(True)`` on block 2 (frozen by AutoFreeze at epoch 2) at the start of ``epoch``; records block 2's
    weights then and at that epoch's end, and the cache's counters then (the schedule freezes it again at the next
    epoch start: AutoFreeze counts it active from the unfreeze on, and its plan says 3 frozen from epoch 2)."""

    def __init__(self, epoch: int = 3) -> None:
        self.epoch = epoch
        self.before: dict[str, torch.Tensor] = {}
        self.moved = 0.0
        self.stats: dict[str, float] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            block = blocks_of(pl_module)[2]
            block.requires_grad_(True)
            self.before = {k: v.clone() for k, v in block.state_dict().items()}

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            after = blocks_of(pl_module)[2].state_dict()
            self.moved = max(float((after[k] - v).abs().max()) for k, v in self.before.items())
            self.stats = dict(getattr(trainer.strategy, "cache_stats", None) or {})


@pytest.mark.parametrize("pipe_len", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_block_unfrozen_by_a_callback_trains_as_without_the_cache(tmp_path, family, pipe_len):
    unfreeze, plain_unfreeze = Unfreeze(), Unfreeze()
    cached_run = run(family, cached(tmp_path, pipe_len), [unfreeze])
    plain = run(family, "auto", [plain_unfreeze])
    assert_same(cached_run, plain)
    # The unfrozen block trains in epoch 3 (under a plan of 2 frozen blocks, a store opened at boundary 2) ...
    assert unfreeze.moved > 1e-6 and unfreeze.moved == pytest.approx(plain_unfreeze.moved, rel=1e-3)
    assert unfreeze.stats["autocache/boundary"] == 2 and unfreeze.stats["autocache/prefix_changes"] >= 1
    # ... and the schedule freezes it again at epoch 4, served from the boundary-2 entries advanced through it.
    found = stats(cached_run[1])
    assert found["autocache/boundary"] == 3 and found["autocache/hits"] > 0 and cached_run[1].strategy.plan.num_frozen == 3


class UnfreezeWithParamGroup(BaseFinetuning):
    """Lightning's standard unfreeze pattern (``BackboneFinetuning`` uses it): block 2 at epoch 3, its own group."""

    def freeze_before_training(self, pl_module):
        pass  # AutoFreeze freezes

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 3:
            self.unfreeze_and_add_param_group(blocks_of(pl_module)[2], optimizer, lr=0.05)


@pytest.mark.parametrize("family", FAMILIES)
def test_unfreeze_and_add_param_group_trains_the_block_as_without_the_cache(tmp_path, family):
    runs = ForwardRunsPerEpoch(module := FamilyModule(family))
    cached_run = run(family, cached(tmp_path), [UnfreezeWithParamGroup(), runs], module=module)
    plain = run(family, "auto", [UnfreezeWithParamGroup()])
    assert_same(cached_run, plain)
    # In epoch 3 block 2 trains and runs for every batch (3 training, 2 validation); at epoch 4 the schedule freezes it
    # again: blocks 0..1 are served from the entries the thaw's store took in epoch 3, advanced through block 2 on read.
    # (Epoch 3's store is new, on the model as it is then: blocks 0..1 run for every batch there, and are stored.)
    assert runs.epochs[3][2] == runs.epochs[4][2] == 3 + 2 and runs.epochs[3][0] == 3 + 2 and runs.epochs[4][0] == 0
    assert stats(cached_run[1])["autocache/prefix_changes"] >= 1


# ---------------------------------------------------------------------------- edits and weight swaps


class EditFrozen(Callback):
    """At the start of ``epoch``, block 0's first weight scaled in place, the way ``how`` says."""

    def __init__(self, how: str, epoch: int = 3) -> None:
        self.how, self.epoch = how, epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != self.epoch:
            return
        weight = next(p for p in blocks_of(pl_module)[0].parameters() if p.dim() == 2)
        if self.how == "no_grad":
            with torch.no_grad():
                weight.mul_(1.05)
        elif self.how == "data":  # unseen by version counters: found by the pass start's fingerprint
            weight.data.copy_(weight.data * 1.05)
        else:  # load_state_dict of an edited copy
            state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            name = next(k for k, v in pl_module.named_parameters() if v is weight)
            state[name] *= 1.05
            pl_module.load_state_dict(state)


@pytest.mark.parametrize("how", ["no_grad", "data", "load_state_dict"])
@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_weights_edited_in_place_are_not_served_stale(tmp_path, family, how):
    cached_run = run(family, cached(tmp_path), [EditFrozen(how)])
    assert_same(cached_run, run(family, "auto", [EditFrozen(how)]))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1
    assert found["autocache/boundary"] == 3 and found["autocache/hits"] > 0  # re-opened on the edited weights, served again


class EditBuffer(Callback):
    """Inside epoch 3, before its second step: a buffer of the frozen embeddings written in place (BERT's position ids
    reversed, as a callback editing a frozen BatchNorm's running statistics would)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 3 and batch_idx == 1:
            embeddings = find_block_stack(pl_module.model).pre[0][1]
            with torch.no_grad():
                embeddings.position_ids.copy_(embeddings.position_ids.flip(-1))


def test_a_frozen_buffer_written_in_place_inside_an_epoch_is_not_served_stale(tmp_path):
    # Before: the walk compared buffers by identity and address only; the epoch's last two steps were served the
    # entries computed with the old position ids (seen only at the next pass start).
    cached_run = run("bert", cached(tmp_path), [EditBuffer()])
    assert_same(cached_run, run("bert", "auto", [EditBuffer()]))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1
    assert found["autocache/boundary"] == 3 and found["autocache/hits"] > 0  # re-opened on the new buffer, served again


class ReplaceFrozenBlock(Callback):
    """At the start of epoch 3, frozen block 0 replaced by a copy of itself (another module object), then edited."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 3:
            layers = find_block_stack(pl_module.model).container
            layers[0] = copy.deepcopy(layers[0])
            with torch.no_grad():
                next(p for p in layers[0].parameters() if p.dim() == 2).mul_(1.05)


@pytest.mark.parametrize("pipe_len", [1, 2])
def test_a_frozen_block_replaced_by_another_module_is_followed(tmp_path, pipe_len):
    # Before: the runner and the interception kept the old block objects, and the model's loop called the new one:
    # InterceptionError "the model called block 1 of its stack where block 0 was next" at the next step (a plain run
    # trains on).
    cached_run = run("bert", cached(tmp_path, pipe_len), [ReplaceFrozenBlock()])
    assert_same(cached_run, run("bert", "auto", [ReplaceFrozenBlock()]))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1
    assert found["autocache/boundary"] == 3 and found["autocache/hits"] > 0  # re-opened on the new block, served again


@pytest.mark.parametrize("family", FAMILIES)
def test_ema_weights_in_validation_are_not_served_the_training_weights_entries(tmp_path, family):
    def ema():
        return EMAWeightAveraging(decay=0.5)

    cached_run = run(family, cached(tmp_path), [ema()])
    assert_same(cached_run, run(family, "auto", [ema()]))
    found = stats(cached_run[1])
    # Validation runs on the averaged weights (the cache stands aside); training is served again after each swap back.
    assert found["autocache/prefix_changes"] >= 1 and found["autocache/hits"] > 0
    assert found["autocache/boundary"] == 3


# ---------------------------------------------------------------------------- modes and hooks that come and go


class HookForTwoSteps(Callback):
    """A forward hook on frozen block 0 for the first two steps of epoch 3 (a callback recording its output now and
    then), taken off after each."""

    def __init__(self) -> None:
        self.handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 3 and batch_idx < 2:
            self.handle = blocks_of(pl_module)[0].register_forward_hook(lambda module, args, output: None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_a_hook_that_comes_and_goes_keeps_the_entries(tmp_path):
    # Before: each step that began with other hooks than the store's (the hook on, then off again) retired the store,
    # deleting every entry, and opened it anew: epoch 4 started cold, its frozen blocks ran for every batch.
    runs = ForwardRunsPerEpoch(module := FamilyModule("bert"))
    cached_run = run("bert", cached(tmp_path), [HookForTwoSteps(), runs], module=module)
    assert_same(cached_run, run("bert", "auto", [HookForTwoSteps()]))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1 and found["autocache/boundary"] == 3
    # The hooked steps run the frozen blocks (observed), the first of them twice (the self-check armed by epoch 2's plan
    # waits for a pass that does not skip the embeddings); the third step and the validation are served, so is epoch 4.
    assert runs.epochs[3][0] == 2 + 1 and runs.epochs[4][:3] == [0, 0, 0]


class TrainModeForOneStep(Callback):
    """The whole model put in train mode by a callback before the second step of epoch 3 (after AutoFreeze, which puts
    the frozen prefix back in eval mode at the next batch start)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 3 and batch_idx == 1:
            pl_module.train()


def test_a_frozen_prefix_put_in_train_mode_for_a_step_runs_it_and_is_served_again(tmp_path):
    # Before: the step began with a frozen prefix in train mode with dropout: the store was retired and the boundary
    # opened again on it, which raised NondeterministicPrefixError in epoch 3.
    runs = ForwardRunsPerEpoch(module := WithDropout("bert"))
    torch.manual_seed(1)
    cached_run = run("bert", cached(tmp_path), [TrainModeForOneStep(), runs], module=module)
    plain_module = WithDropout("bert")
    torch.manual_seed(1)  # the same random numbers for the dropout as the cached run's
    assert_same(cached_run, run("bert", "auto", [TrainModeForOneStep()], module=plain_module))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1 and found["autocache/hits"] > 0
    # That step ran the frozen blocks, with dropout (twice: the self-check armed by epoch 2's plan waits for a pass that
    # does not skip the embeddings); the rest of epoch 3 and epoch 4 are served.
    assert runs.epochs[3][0] == 1 + 1 and runs.epochs[4][:3] == [0, 0, 0]


class LoraEverywhere(FamilyModule):
    """BERT with LoRA on every block, trained in full (AutoFreeze freezes the lower blocks, their adapters with them);
    validation runs the base model, PEFT's adapters disabled (``disable_adapter()``, as a DPO reference does)."""

    def __init__(self) -> None:
        import peft

        super().__init__("bert")
        config = peft.LoraConfig(r=4, target_modules=["query", "value"], lora_dropout=0.0, init_lora_weights=False)
        self.model = peft.get_peft_model(self.model, config)
        self.model.requires_grad_(True)

    def validation_step(self, batch, batch_idx):
        with self.model.disable_adapter():
            self.log("val_loss", self.loss(batch))


def test_peft_adapters_disabled_in_frozen_blocks_are_not_served_the_entries_computed_with_them(tmp_path):
    # Before: disable_adapter() flips PEFT's private flag (_disable_adapters) on the frozen blocks' LoRA layers, which
    # neither the watch nor the fingerprint read: validation on the training samples was served the activations
    # computed with the adapters, silently (val loss 0.96124 against 0.96133).
    pytest.importorskip("peft")

    def fit(strategy):
        module, losses = LoraEverywhere(), ValLosses()
        trainer = cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}), losses], max_epochs=4, check_val_every_n_epoch=3)
        trainer.fit(module, family_data("bert"), family_data("bert"))  # validation on the training samples
        return module, trainer, losses.losses

    cached_run = fit(cached(tmp_path))
    assert_same(cached_run, fit("auto"))
    found = stats(cached_run[1])
    assert found["autocache/prefix_changes"] >= 1 and found["autocache/hits"] > 0


# ---------------------------------------------------------------------------- other freezing: BaseFinetuning


class FreezeLower(BaseFinetuning):
    """The embeddings and the lower two blocks frozen from the start, in eval mode or (``eval_mode=False``) in train
    mode, Lightning's default for ``BaseFinetuning``."""

    def __init__(self, eval_mode: bool = True) -> None:
        super().__init__()
        self.eval_mode = eval_mode

    def freeze_before_training(self, pl_module):
        stack = find_block_stack(pl_module.model)
        modules = [m for _, m in stack.pre] + stack.blocks[:2]
        self.freeze(modules, train_bn=False)
        if self.eval_mode:
            for module in modules:
                module.eval()

    def finetune_function(self, pl_module, epoch, optimizer):
        pass


@pytest.mark.parametrize("pipe_len", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_base_finetuning_is_served_from_the_second_epoch(tmp_path, family, pipe_len):
    runs = ForwardRunsPerEpoch(module := FamilyModule(family))
    cached_run = run(family, cached(tmp_path, pipe_len), [FreezeLower(), runs], epochs=3, freeze=False, module=module)
    assert_same(cached_run, run(family, "auto", [FreezeLower()], epochs=3, freeze=False))
    found = stats(cached_run[1])
    assert found["autocache/boundary"] == 2
    # Epoch 0 stores (its first forward, which learns what runs before the stack, computes without the cache); epoch 1
    # runs the frozen blocks twice (that first batch's samples, and the first-hit verification), epoch 2 never.
    assert runs.epochs[1][:2] == [2, 2] and runs.epochs[2][:2] == [0, 0] and runs.epochs[2][2] == 3 + 2
    assert found["autocache/hits"] >= (12 + 12) + (18 + 12)


class WithDropout(FamilyModule):
    """The family model with dropout 0.1 everywhere (the helpers' models have none)."""

    def __init__(self, family: str) -> None:
        super().__init__(family)
        for module in self.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.1
            for name in ("attention_dropout", "dropout"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.1)


class StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1


def test_a_frozen_prefix_left_in_train_mode_with_dropout_is_refused_before_the_first_optimizer_step(tmp_path):
    steps = StepCounter()
    with pytest.raises(NondeterministicPrefixError, match=r"cache_frozen_eval=True.*Dropout|Dropout.*cache_frozen_eval=True"):
        run("bert", cached(tmp_path), [FreezeLower(eval_mode=False), steps], epochs=2, freeze=False, module=WithDropout("bert"))
    assert steps.steps == 0


def test_cache_frozen_eval_serves_a_prefix_frozen_in_train_mode(tmp_path):
    # cache_frozen_eval keeps the frozen prefix in eval mode: the same training as freezing it in eval mode by hand.
    cached_run = run(
        "bert", cached(tmp_path, cache_frozen_eval=True), [FreezeLower(eval_mode=False)], epochs=3, freeze=False,
        module=WithDropout("bert"),
    )
    plain = run("bert", "auto", [FreezeLower(eval_mode=True)], epochs=3, freeze=False, module=WithDropout("bert"))
    assert_same(cached_run, plain)
    assert stats(cached_run[1])["autocache/hits"] >= (12 + 12) + (18 + 12)


# ---------------------------------------------------------------------------- any sequence of changes


class RandomChanges(Callback):
    """Between steps (seeded), once per epoch at a random batch: freeze or unfreeze a leading block (the embeddings with
    block 0), edit a frozen weight (seen by the version counter, or only by the next pass start's fingerprint), flip a
    frozen block to train mode; and at random, weights swapped in for validation. The same sequence with the cache on
    and off; the stretches between changes let the cache serve."""

    def __init__(self, seed: int, steps_per_epoch: int) -> None:
        self.rng = random.Random(seed)
        self.steps = steps_per_epoch
        self.at = 0
        self.swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.at = self.rng.randrange(self.steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.at:
            return
        stack = find_block_stack(pl_module.model)
        blocks, embeddings = stack.blocks, stack.pre[0][1]
        action = self.rng.choice(["freeze", "freeze", "freeze", "unfreeze", "edit", "data_edit", "train_mode"])
        frozen = next((i for i, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())), len(blocks))
        if action == "freeze" and frozen < 3:
            for module in [embeddings, blocks[frozen]] if frozen == 0 else [blocks[frozen]]:  # the embeddings with block 0
                module.requires_grad_(False)
                module.eval()
        elif action == "unfreeze" and frozen > 0:
            for module in [embeddings, blocks[0]] if frozen == 1 else [blocks[frozen - 1]]:
                module.requires_grad_(True)
        elif action in ("edit", "data_edit") and frozen > 0:
            weight = next(p for p in blocks[self.rng.randrange(frozen)].parameters() if p.dim() == 2)
            if action == "edit":
                with torch.no_grad():
                    weight.mul_(1.01)
            else:
                weight.data.mul_(1.01)  # seen at the next pass start
        elif action == "train_mode" and frozen > 0:
            blocks[0].train()  # no dropout in these models: the same function, served on

    def on_validation_epoch_start(self, trainer, pl_module):
        if self.rng.random() < 0.5:
            params = [p for b in blocks_of(pl_module)[:2] for p in b.parameters()]
            self.swapped = [(p, p.data.clone()) for p in params]
            for p in params:
                p.data.mul_(0.99)

    def on_validation_epoch_end(self, trainer, pl_module):
        for p, saved in self.swapped:
            p.data.copy_(saved)
        self.swapped = []


class HitsSeen(Callback):
    """Hits over the whole fit (the store's counters start again with each store)."""

    def __init__(self) -> None:
        self.total, self._last = 0, 0

    def _read(self, trainer) -> None:
        hits = int((trainer.strategy.cache_stats or {}).get("autocache/hits", 0))
        self.total += hits - self._last if hits >= self._last else hits
        self._last = hits

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._read(trainer)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_changes_between_steps_give_the_same_weights_as_cache_off(tmp_path, seed):
    hits = HitsSeen()
    cached_run = run("bert", cached(tmp_path), [RandomChanges(seed, 6), hits], epochs=6, freeze=False, train_size=36)
    assert_same(cached_run, run("bert", "auto", [RandomChanges(seed, 6)], epochs=6, freeze=False, train_size=36))
    assert stats(cached_run[1])["autocache/prefix_changes"] >= 1
    assert hits.total > 0  # what stayed unchanged for a while was served
