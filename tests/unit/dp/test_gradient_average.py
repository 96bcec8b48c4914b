"""K > 1 replicas averaged by hand (dp/ddp.py, dp/averaging.py) follow DDP's rules.

Two gloo processes, each a replica of a model whose stages span two (virtual) devices, train
three AdamW steps (weight decay on) on their halves of a batch; one process trains the same
model on the whole batch. A pooler no replica uses must keep ``grad = None`` (DDP's rule: with a
zero gradient AdamW's decoupled weight decay would still shrink it, and its momentum would
be made), and a layer only one replica uses gets the replicas' mean (the other counts as zero).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.devices import VirtualDevices
from lightning_pipetransformer.dp import averaging
from lightning_pipetransformer.dp.ddp import GradientSync
from tests.helpers.spawn import spawn_gloo

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)
STEPS = 3


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)  # stage 0
        self.late = nn.Linear(8, 8)  # stage 1 (on another device: its gradients are staged on cpu:0)
        self.branch = nn.Linear(8, 8)  # used only by rows whose first feature is positive (rank 0's half)
        self.pooler = nn.Linear(8, 8)  # never used, as BERT's pooler under a token-level head
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.late(torch.tanh(self.block(self.embed(x)))))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h).square().mean()


def _halves(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 6, generator=g) for _ in range(2)]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)


def _one_process() -> nn.Module:
    model = _Model()
    optimizer = _optimizer(model)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        first, second = _halves(step)
        ((model(first, True) + model(second, False)) / 2).backward()  # the mean over the whole batch
        assert model.pooler.weight.grad is None
        optimizer.step()
    return model


def _replicas(rank: int, world: int) -> None:
    reference = _one_process()
    for sum_then_divide in (False, True):  # the average op, and the sum + division of older gloo
        if sum_then_divide:
            averaging.average_op = lambda group: (dist.ReduceOp.SUM, True)
        model = _Model()
        optimizer = _optimizer(model)
        with VirtualDevices():
            dev.bind_process_device(CPU0)
            for module in (model.embed, model.block):
                dev.place_module(module, CPU0)
            for module in (model.late, model.branch, model.pooler, model.head):
                dev.place_module(module, CPU1)
            sync = GradientSync()
            wrapped = sync.wrap(
                model, group=dist.group.WORLD, host_group=dist.group.WORLD, world_size=world, active=True, pipe_len=2, num_replicas=world,
                root_device=CPU0, stage_devices=(CPU0, CPU1), init_sync=False,
            )
            assert wrapped is model and sync.by_hand  # K = 2: averaged by hand, not DDP
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                wrapped(_halves(step)[rank], rank == 0).backward()
                assert (model.branch.weight.grad is None) == (rank == 1)
                sync.average(model.parameters(), CPU0)
                # The rule itself: no replica used the pooler, so no gradient (DDP leaves it None);
                # the branch was used on rank 0 only, so rank 1 gets the mean too.
                assert model.pooler.weight.grad is None and model.pooler.bias.grad is None
                assert model.branch.weight.grad is not None
                optimizer.step()
        assert not optimizer.state.get(model.pooler.weight)  # no momentum made for it
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} (sum then divide: {sum_then_divide})")
        torch.testing.assert_close(model.pooler.weight, _Model().pooler.weight, rtol=0, atol=0)  # never moved


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_k2_replicas_average_like_ddp_and_equal_one_process_with_adamw():
    spawn_gloo(_replicas, 2)


def test_average_op_is_the_backends_average_where_it_has_one(monkeypatch):
    monkeypatch.setattr(averaging.dist, "get_backend", lambda group: group)
    assert averaging.average_op("nccl") == (dist.ReduceOp.AVG, False)
    monkeypatch.setattr(averaging, "_torch_version", lambda: (2, 13))
    assert averaging.average_op("gloo") == (dist.ReduceOp.AVG, False)
    monkeypatch.setattr(averaging, "_torch_version", lambda: (2, 7))  # before gloo had AVG
    assert averaging.average_op("gloo") == (dist.ReduceOp.SUM, True)
