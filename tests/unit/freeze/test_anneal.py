"""Smooth freezing's mechanics without a Trainer (``freeze/anneal.py``).

The update of an annealed parameter is scaled after the optimizer's step. These tests hold that
this equals a plain reference that puts the annealed blocks in their own parameter group at the
scaled learning rate (SGD with momentum and weight decay, AdamW with decoupled decay), under the
user's learning-rate schedulers (LambdaLR, OneCycleLR, one lambda per group), and that it leaves
alone what a real step does not touch: a step AMP's scaler skips, parameters without a gradient,
parameters of another optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pipetransformer.freeze.anneal import Annealer, AnnealPlan, anneal_curve, annealed_parameters
from lightning_pipetransformer.stack.discovery import find_block_stack
from tests.helpers.models import TextClassifier, text_dataset

PLAN = AnnealPlan(source=0, target=2, start=2, end=8)  # blocks 0-1 (and the embeddings) over steps 2..7
STEPS = 10


def cosine_factor(step: int, plan: AnnealPlan = PLAN) -> float:
    """The reference's own formula (not the module's): FreezeOut's cosine, 0 from the freeze point on."""
    if step < plan.start:
        return 1.0
    if step >= plan.end:
        return 0.0
    return 0.5 * (1 + math.cos(math.pi * (step - plan.start) / (plan.end - plan.start)))


def model_and_batches(seed: int = 0):
    module = TextClassifier(num_layers=4, seed=seed)
    module.train()
    # Attention's key bias has a zero gradient up to rounding (softmax ignores a shift of every score):
    # Adam normalises that rounding noise into steps of size lr, whose signs then differ between two
    # equal computations done in another order. It is not what these tests compare.
    for name, p in module.named_parameters():
        if name.endswith("attention.self.key.bias"):
            p.requires_grad_(False)
    data = text_dataset(8 * STEPS, seed=1)
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 8 * STEPS, 8)]
    return module, batches


def loss_of(module, batch):
    ids, labels = batch
    return nn.functional.cross_entropy(module(ids), labels)


def annealed_ids(module) -> set[int]:
    return {id(p) for p in annealed_parameters(find_block_stack(module), PLAN.source, PLAN.target, include_pre=True)}


def make_optimizer(kind: str, groups, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=0.01)
    if kind == "sgd-nesterov":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    if kind == "adamw-fused":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1, fused=True)
    raise AssertionError(kind)


LR = {"sgd": 0.05, "sgd-nesterov": 0.05, "adamw": 1e-3, "adamw-fused": 1e-3}


def assert_states_close(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-7, msg=key)


def run_annealed(kind: str, spec="cosine", plan: AnnealPlan | None = PLAN, scheduler=None):
    """The user's optimizer (decay / no-decay groups) untouched; the annealer on top."""
    module, batches = model_and_batches()
    groups = user_groups(module)
    optimizer = make_optimizer(kind, groups, LR[kind])
    sched = scheduler(optimizer) if scheduler else None
    annealer = Annealer(spec)
    annealer.bind(find_block_stack(module), include_pre=True)
    if plan is not None:
        annealer.begin(plan)
    for step, batch in enumerate(batches):
        annealer.at_step(step, [optimizer])
        optimizer.zero_grad(set_to_none=True)
        loss_of(module, batch).backward()
        optimizer.step()
        if sched is not None:
            sched.step()
    return module


def user_groups(module):
    named = list(module.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def run_reference(kind: str, factor=cosine_factor, scheduler=None):
    """The annealed blocks really in their own parameter groups, at the scheduled lr times the factor."""
    module, batches = model_and_batches()
    annealed = annealed_ids(module)
    groups = []
    for group in user_groups(module):
        for mine in (True, False):
            params = [p for p in group["params"] if (id(p) in annealed) == mine]
            groups.append({"params": params, "weight_decay": group["weight_decay"], "annealed": mine})
    optimizer = make_optimizer(kind, groups, LR[kind])
    sched = scheduler(optimizer) if scheduler else None
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss_of(module, batch).backward()
        scheduled = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            if g["annealed"]:
                g["lr"] = g["lr"] * factor(step)
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, scheduled):
            g["lr"] = lr  # the scheduler's value again: it owns the lr, the factor is on top
        if sched is not None:
            sched.step()
    return module


def test_curves_start_at_one_and_reach_zero_at_the_freeze():
    for spec in ("linear", "cosine"):
        curve = anneal_curve(spec)
        assert curve(0.0) == 1.0
        assert curve(1.0) == pytest.approx(0.0, abs=1e-12)
        values = [curve(t / 10) for t in range(11)]
        assert values == sorted(values, reverse=True)
    assert anneal_curve("linear")(0.25) == 0.75
    assert anneal_curve("cosine")(0.5) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", ["exp", 0.5, "Cosine"])
def test_an_unknown_curve_is_refused(bad):
    with pytest.raises(ValueError, match="anneal must be"):
        anneal_curve(bad)


def test_a_curve_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        anneal_curve(lambda t: 2.0 - t)


def test_the_factor_before_inside_and_after_the_interval():
    annealer = Annealer("linear")
    assert annealer.factor(5) == 1.0  # no plan
    annealer.begin(PLAN)
    assert [annealer.factor(s) for s in range(10)] == pytest.approx([1.0, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0, 0.0])
    with pytest.raises(ValueError):
        AnnealPlan(source=2, target=2, start=0, end=4)
    with pytest.raises(ValueError):
        AnnealPlan(source=0, target=1, start=4, end=4)


def test_the_annealed_parameters_are_what_the_freeze_adds():
    module = TextClassifier(num_layers=4)
    stack = find_block_stack(module)
    first = annealed_parameters(stack, 0, 2, include_pre=True)
    expected = [p for _, m in stack.pre for p in m.parameters()] + [p for b in stack.blocks[:2] for p in b.parameters()]
    assert {id(p) for p in first} == {id(p) for p in expected} and len(first) == len(expected)
    later = annealed_parameters(stack, 2, 3, include_pre=True)  # the embeddings went with block 0
    assert {id(p) for p in later} == {id(p) for p in stack.blocks[2].parameters()}
    # Blocks frozen before fit (no trainable parameter) with the embeddings still training: the
    # embeddings anneal with the next freeze, which takes them too.
    pre = {id(p) for _, m in stack.pre for p in m.parameters()}
    untrained = annealed_parameters(stack, 2, 3, include_pre=True, pre_frozen=False)
    assert {id(p) for p in untrained} == pre | {id(p) for p in stack.blocks[2].parameters()}
    assert not pre & {id(p) for p in annealed_parameters(stack, 0, 2, include_pre=False)}


@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "adamw", "adamw-fused"])
def test_scaling_the_update_equals_a_scaled_lr_in_its_own_param_group(kind):
    annealed, reference = run_annealed(kind), run_reference(kind)
    assert_states_close(annealed, reference)
    # The annealing did something: without it the weights differ.
    plain = run_annealed(kind, plan=None)
    assert not torch.allclose(plain.model.bert.encoder.layer[0].output.dense.weight, annealed.model.bert.encoder.layer[0].output.dense.weight)


def lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / 12))


def one_cycle(optimizer):  # cycles SGD's momentum and AdamW's beta1 too (cycle_momentum): lr-independent state
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=STEPS, pct_start=0.3)


def per_group_lambdas(optimizer):
    """One lambda per parameter group; the reference has twice the groups (annealed or not): each half its own."""
    decay, no_decay = (lambda s: 1.0 / (1 + s)), (lambda s: 0.5 ** (s / 4))
    flags = [g.get("weight_decay", 0.0) > 0 for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [decay if f else no_decay for f in flags])


@pytest.mark.parametrize("scheduler", [lambda_lr, one_cycle, per_group_lambdas], ids=["LambdaLR", "OneCycleLR", "lambda-per-group"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_equivalence_holds_under_the_users_lr_schedulers(kind, scheduler):
    annealed, reference = run_annealed(kind, scheduler=scheduler), run_reference(kind, scheduler=scheduler)
    assert_states_close(annealed, reference)


def test_a_factor_of_one_is_no_anneal():
    # (A plan past the run's end: from its end on the factor is 0 whatever the curve, as a freeze.)
    annealed = run_annealed("adamw", spec=lambda t: 1.0, plan=AnnealPlan(0, 2, 0, STEPS + 1))
    plain = run_annealed("adamw", plan=None)
    for (name, a), b in zip(annealed.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_after_the_interval_the_annealed_blocks_do_not_move():
    module, batches = model_and_batches()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    annealer = Annealer("cosine")
    annealer.bind(find_block_stack(module), include_pre=True)
    annealer.begin(PLAN)
    annealed = annealed_ids(module)
    seen = {}
    for step, batch in enumerate(batches):
        if step == PLAN.end:
            seen = {n: p.detach().clone() for n, p in module.named_parameters()}
        annealer.at_step(step, [optimizer])
        optimizer.zero_grad(set_to_none=True)
        loss_of(module, batch).backward()
        optimizer.step()
    for name, p in module.named_parameters():
        if id(p) in annealed:
            assert torch.equal(p, seen[name]), name  # a zero rate: what a frozen block does
        elif p.requires_grad:
            assert not torch.equal(p, seen[name]), name


@pytest.mark.parametrize("kind", ["sgd", "adamw-fused"])
def test_a_step_the_amp_scaler_skips_changes_nothing(kind):
    # An unfused optimizer's step is not called at all; a fused one is called with found_inf and
    # updates nothing: the scaled update of no change is no change.
    module, batches = model_and_batches()
    optimizer = make_optimizer(kind, module.parameters(), LR[kind])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    annealer = Annealer("cosine")
    annealer.bind(find_block_stack(module), include_pre=True)
    annealer.begin(AnnealPlan(0, 2, 0, 4))
    annealer.at_step(1, [optimizer])
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss_of(module, batches[0])).backward()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    next(module.model.bert.encoder.layer[0].parameters()).grad.view(-1)[0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name
    # The next, finite step anneals as usual (the skipped step left nothing behind).
    annealer.at_step(2, [optimizer])
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss_of(module, batches[1])).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(module.model.bert.encoder.layer[0].output.dense.weight, before["model.bert.encoder.layer.0.output.dense.weight"])


def test_parameters_without_a_gradient_stay_put():
    module, batches = model_and_batches()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    annealer = Annealer("linear")
    annealer.bind(find_block_stack(module), include_pre=True)
    annealer.begin(AnnealPlan(0, 2, 0, 4))
    untouched = module.model.bert.encoder.layer[1].output.dense.weight
    kept = untouched.detach().clone()
    for step, batch in enumerate(batches[:3]):
        annealer.at_step(step, [optimizer])
        optimizer.zero_grad(set_to_none=True)
        loss_of(module, batch).backward()
        untouched.grad = None  # e.g. a parameter the forward did not use
        optimizer.step()
    assert torch.equal(untouched, kept)


def test_with_two_optimizers_each_step_anneals_its_own_update():
    # One optimizer over the first two blocks and the embeddings, one over the rest: the annealed
    # update is the first one's, and the second one's step (hooked too) leaves it as it is.
    def run(anneal: bool):
        module, batches = model_and_batches()
        annealed = annealed_ids(module)
        first = torch.optim.SGD([p for p in module.parameters() if id(p) in annealed], lr=0.05, momentum=0.9)
        second = torch.optim.SGD([p for p in module.parameters() if id(p) not in annealed], lr=0.05, momentum=0.9)
        annealer = Annealer("cosine")
        annealer.bind(find_block_stack(module), include_pre=True)
        if anneal:
            annealer.begin(PLAN)
        for step, batch in enumerate(batches):
            annealer.at_step(step, [first, second])
            for opt in (first, second):
                opt.zero_grad(set_to_none=True)
            loss_of(module, batch).backward()
            for g in first.param_groups:
                g["lr"] = 0.05 * (1.0 if anneal else cosine_factor(step))  # the reference: the lr itself
            first.step()
            second.step()
        return module

    assert_states_close(run(anneal=True), run(anneal=False))


def test_the_plan_goes_through_a_state_dict_and_detach_removes_the_hooks():
    annealer = Annealer("cosine")
    annealer.begin(PLAN)
    restored = Annealer("cosine")
    restored.load_state_dict(annealer.state_dict())
    assert restored.plan == PLAN
    restored.load_state_dict(None)
    assert restored.plan is None
    # begin() keeps a plan for the same blocks (a hook called again for the same point after resume).
    assert annealer.begin(AnnealPlan(0, 2, 5, 9)) is False and annealer.plan == PLAN

    module, batches = model_and_batches()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    annealer.bind(find_block_stack(module), include_pre=True)
    annealer.at_step(PLAN.end, [optimizer])  # factor 0: the annealed blocks would not move
    annealer.detach()
    weight = module.model.bert.encoder.layer[0].output.dense.weight
    kept = weight.detach().clone()
    loss_of(module, batches[0]).backward()
    optimizer.step()
    assert not torch.equal(weight, kept)  # the hooks are gone: a plain step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on CPU every parameter is on the one device")
def test_blocks_on_several_devices_anneal_each_on_its_own_device():
    # The pipeline's stages: the embeddings and block 0 on the GPU, block 1 on another GPU or the
    # CPU. Gradients are set by hand (no forward across devices needed).
    second = torch.device("cuda", 1) if torch.cuda.device_count() > 1 else torch.device("cpu")

    def run(annealed: bool):
        module = TextClassifier(num_layers=4)
        stack = find_block_stack(module)
        for _, m in stack.pre:
            m.to("cuda")
        stack.blocks[0].to("cuda")
        stack.blocks[1].to(second)
        ids = annealed_ids(module)
        if annealed:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            annealer = Annealer("cosine")
            annealer.bind(stack, include_pre=True)
            annealer.begin(PLAN)
        else:
            groups = [{"params": [p for p in module.parameters() if (id(p) in ids) == mine], "mine": mine} for mine in (True, False)]
            optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
        gen = torch.Generator().manual_seed(0)
        for step in range(STEPS):
            for p in module.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(p.device)
            if annealed:
                annealer.at_step(step, [optimizer])
            else:
                for g in optimizer.param_groups:
                    g["lr"] = 0.05 * (cosine_factor(step) if g["mine"] else 1.0)
            optimizer.step()
        return module

    a, b = run(True), run(False)
    assert a.model.bert.encoder.layer[1].output.dense.weight.device == second
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=name)
