"""State transfer for AutoDP transitions (lightning_pipetransformer.dp.state_transfer), on gloo CPU processes.

The functions move model weights and optimizer state from global rank 0 to the ranks that join
the replicas, point to point along a binomial tree, in pieces. These tests check, with a few
processes and small tensors: bit-exact copies, that only the named receivers are touched (except
buffers), chunking and coalescing across dtypes, an optimizer state without the frozen
parameters' entries that ``load_state_dict`` accepts, and that a missing sender ends in an error
within the group's timeout rather than a hang. Every run has a hard deadline.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetransformer.dp import state_transfer
from tests.helpers.spawn import spawn_gloo


def test_transfer_tree_is_a_binomial_tree_over_src_and_receivers():
    for receivers in ([], [1], [1, 2, 3], [2, 3], [5, 1, 7, 3, 2, 6, 4], list(range(1, 16))):
        tree = state_transfer.transfer_tree(0, receivers)
        assert set(tree) == {0, *receivers}
        assert tree[0][0] is None
        rounds = math.ceil(math.log2(len(receivers) + 1))
        assert len(tree[0][1]) == rounds  # src sends at most log2 copies
        order = [0, *receivers]
        for position, rank in enumerate(order[1:], start=1):
            parent = tree[rank][0]
            assert order.index(parent) < position  # data flows from ranks that already have it
            assert rank in tree[parent][1]
    assert state_transfer.transfer_tree(2, [0, 2, 1])[2] == (None, [0, 1])  # src is the root, listed once


# ------------------------------------------------------------- staging memory, in one process


class _FakeDist:
    """``torch.distributed`` for one rank of a tree: sends are kept, receives replay a parent's sends.

    Every call samples the staging bytes alive on the process's device (``VirtualDevices``), so
    the test sees the peak however the transfer orders its allocations.
    """

    def __init__(self, rank, virtual, via, inbox=()):
        self.rank, self.virtual, self.via = rank, virtual, via
        self.inbox = list(inbox)  # what the parent sent this rank, in order
        self.sent: dict[int, list[torch.Tensor]] = {}
        self.peak = 0

    def _sample(self):
        self.peak = max(self.peak, self.virtual.live_bytes(self.via))

    def get_rank(self):
        return self.rank

    def isend(self, message, dst, group):
        self._sample()
        self.sent.setdefault(dst, []).append(message.clone())
        return _FakeWork(self)

    def irecv(self, message, src, group):
        self._sample()
        return _FakeWork(self, message, self.inbox.pop(0))


class _FakeWork:
    """A request; a receive's data lands at ``wait``. No cycles: freed as soon as it is dropped."""

    def __init__(self, fake, into=None, data=None):
        self.fake, self.into, self.data = fake, into, data

    def wait(self):
        if self.into is not None:
            self.into.copy_(self.data)
        self.fake._sample()


CHUNK = 64 << 10


def _send_and_relay(monkeypatch, fake_dist, streams: bool = False):
    """Rank 0 (children 1, 2) and rank 1 (parent 0, child 3) of a tree over 0..3 send a stage's tensors
    (on cpu:1) in ``CHUNK`` pieces, each through its own ``fake_dist(rank, virtual, cpu0, inbox=)``,
    with ``fake_dist`` as the streams when ``streams``; returns ``(sender, receiver, root, relay, total bytes)``."""
    from lightning_pipetransformer import devices as dev
    from lightning_pipetransformer.devices import VirtualDevices

    cpu0, cpu1 = torch.device("cpu", 0), torch.device("cpu", 1)

    def send(fake, tensors):
        monkeypatch.setattr(state_transfer, "dist", fake)
        with dev.stand_in_streams(fake) if streams else contextlib.nullcontext():
            state_transfer.send_tensors(tensors, src=0, receivers=[1, 2, 3], group=None, chunk_bytes=CHUNK, via=cpu0)

    with VirtualDevices() as virtual:
        dev.bind_process_device(cpu0)
        sender = _tensors(seed=0)
        for t in sender:
            dev.tag_as(t, cpu1)
        total = sum(t.numel() * t.element_size() for t in sender)
        root = fake_dist(0, virtual, cpu0)
        send(root, sender)
        # Contiguous where the sender's (600, 700).t() is not, as broadcast_state's torch.empty: the
        # pieces must still match (they once depended on the strides).
        receiver = [torch.zeros(t.shape, dtype=t.dtype) for t in _tensors(seed=0)]
        for t in receiver:
            dev.tag_as(t, cpu1)
        relay = fake_dist(1, virtual, cpu0, inbox=root.sent[1])
        send(relay, receiver)
    return sender, receiver, root, relay, total


def test_staging_on_the_process_device_stays_within_a_window_of_pieces(monkeypatch):
    sender, receiver, root, relay, total = _send_and_relay(monkeypatch, _FakeDist)
    pieces = len(root.sent[1])
    assert pieces > 4 * state_transfer.IN_FLIGHT and total > 20 * state_transfer.IN_FLIGHT * CHUNK
    assert [len(root.sent[2]), len(relay.sent[3])] == [pieces, pieces]
    for got, want in zip(receiver, sender):
        assert torch.equal(got, want)  # still bit-exact
    for sent, forwarded in zip(root.sent[1], relay.sent[3]):
        assert torch.equal(sent, forwarded)
    # Everything was staged at once before (about 'total' on each side); now the ring's buffers.
    bound = state_transfer.IN_FLIGHT * CHUNK
    assert 0 < root.peak <= bound and 0 < relay.peak <= bound, (root.peak, relay.peak, bound, total)


class _NcclLikeStream:
    def __init__(self):
        self.waited = []  # requests this stream was made to wait on (Work.wait under NCCL)


class _NcclLikeEvent:
    def __init__(self):
        self.works = []

    def record(self, stream):
        self.works = list(stream.waited)

    def synchronize(self):  # the host blocks until the stream has passed every request it waited on
        for work in self.works:
            work.finish()


class _NcclLike:
    """NCCL's rules for one rank, on CPU: ``Work.wait()`` returns at once and only makes the current
    stream wait; a request keeps its buffer (as the caching allocator does for the NCCL stream)
    until the host has synchronised with a stream that waited on it. Also the stream backend
    :func:`devices.stand_in_streams` takes, so :func:`devices.until_done` synchronises here."""

    def __init__(self, rank, virtual, via, inbox=()):
        self.rank, self.virtual, self.via = rank, virtual, via
        self.inbox = list(inbox)
        self.sent: dict[int, list[torch.Tensor]] = {}
        self.stream = _NcclLikeStream()
        self.unfinished: list[_NcclLikeWork] = []
        self.peak = 0

    # torch.distributed
    def get_rank(self):
        return self.rank

    def _post(self, message, work):
        storage = message.untyped_storage().data_ptr()
        for other in self.unfinished:
            if other.storage == storage and other.message is not message:
                raise AssertionError("a staging buffer was reused while a transfer still used it")
        self.unfinished.append(work)
        self.peak = max(self.peak, self.virtual.live_bytes(self.via))
        return work

    def isend(self, message, dst, group):
        self.sent.setdefault(dst, []).append(message.clone())
        return self._post(message, _NcclLikeWork(self, message))

    def irecv(self, message, src, group):
        return self._post(message, _NcclLikeWork(self, message, self.inbox.pop(0)))

    # the stream backend
    def new_stream(self, device):
        return self.stream

    def current_stream(self, device):
        return self.stream

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def new_event(self):
        return _NcclLikeEvent()

    def record_stream(self, tensor, stream):
        pass


class _NcclLikeWork:
    def __init__(self, fake, message, data=None):
        self.fake, self.message, self.data = fake, message, data
        self.storage = message.untyped_storage().data_ptr()

    def wait(self):  # returns at once; what runs next on the stream sees the received data
        if self.data is not None:
            self.message.copy_(self.data)
            self.data = None
        self.fake.stream.waited.append(self)

    def finish(self):
        if self in self.fake.unfinished:
            self.fake.unfinished.remove(self)
            self.message = None  # the buffer is free for the allocator only now


def test_staging_is_bounded_by_the_ring_when_wait_does_not_block_the_host(monkeypatch):
    """Under NCCL ``Work.wait()`` returns at once and a point-to-point buffer stays in use until the
    NCCL stream is past it: dropping a piece after ``wait`` frees nothing, so a loop that
    allocates a buffer per piece stages everything at once. The ring reuses its buffers, each
    only after the host has synchronised with the transfers that used it."""
    sender, receiver, root, relay, total = _send_and_relay(monkeypatch, _NcclLike, streams=True)
    for got, want in zip(receiver, sender):
        assert torch.equal(got, want)
    for sent, forwarded in zip(root.sent[1], relay.sent[3]):
        assert torch.equal(sent, forwarded)
    assert len(root.sent[1]) > 4 * state_transfer.IN_FLIGHT and total > 20 * state_transfer.IN_FLIGHT * CHUNK
    bound = state_transfer.IN_FLIGHT * CHUNK
    assert 0 < root.peak <= bound and 0 < relay.peak <= bound, (root.peak, relay.peak, bound, total)
    # Nothing is left in use when the transfer returns: the next one starts from an empty ring.
    assert not root.unfinished and not relay.unfinished


# ---------------------------------------------------------------------------------- multi-process



def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(700_000, generator=g),  # > COALESCE_BYTES: sent straight, in several chunks
        torch.randn(3, 5, generator=g),  # small float32 ...
        torch.randn(4, generator=g).to(torch.float16),  # ... another dtype: its own staging buffer
        torch.randint(0, 1000, (7,), generator=g),  # int64
        torch.randn(600, 700, generator=g).t(),  # large but not contiguous: staged
        torch.randn(0, generator=g),  # empty: skipped
        torch.randn(300_000, generator=g).to(torch.float64),  # large float64
        torch.rand(9, generator=g) > 0.5,  # bool
    ]


def _send_tensors_to_some(rank: int, world: int) -> None:
    tensors = _tensors(seed=rank)  # different on every rank before the transfer
    before = [t.clone() for t in tensors]
    # Rank 1 is an already-active replica: not a receiver, never touched. Small chunks: many pieces.
    state_transfer.send_tensors(tensors, src=0, receivers=[2, 3], group=dist.group.WORLD, chunk_bytes=1 << 20)
    expected = _tensors(seed=0) if rank in (0, 2, 3) else before
    for got, want in zip(tensors, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), rank
    dist.barrier()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3000, 128)  # 1.5 MB: sent straight
        self.block = nn.Linear(128, 128)
        self.norm = nn.BatchNorm1d(128)  # buffers
        self.head = nn.Linear(128, 4)
        self.tied = nn.Linear(128, 128, bias=False)
        self.tied.weight = self.block.weight  # tied weights: sent once


def _module_state(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    net = _Net()
    with torch.no_grad():
        net.norm.running_mean.fill_(float(rank))  # replicas' buffers differ
    mine = {k: v.clone() for k, v in net.state_dict().items()}
    torch.manual_seed(0)
    src = _Net()
    with torch.no_grad():
        src.norm.running_mean.fill_(0.0)
    state_transfer.broadcast_module_state(net, src=0, group=dist.group.WORLD, receivers=[2])
    buffers = {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    for key, value in net.state_dict().items():
        if rank in (0, 2) or key in buffers:
            assert torch.equal(value, src.state_dict()[key]), (rank, key)  # params to 2, buffers to all
        else:
            assert torch.equal(value, mine[key]), (rank, key)  # rank 1 keeps its own parameters
    dist.barrier()


def _optimizer_state(rank: int, world: int) -> None:
    torch.manual_seed(0)
    net = _Net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    if rank == 0:  # the only replica so far: it has trained
        for _ in range(3):
            _step(net, (sgd, adam))
            scheduler.step()
    frozen = list(net.embed.parameters())  # "frozen by AutoFreeze": their state is not sent
    for p in frozen:
        p.requires_grad_(False)
    state = None
    if rank == 0:
        state = {
            "optimizers": [state_transfer.without_state_of(o.state_dict(), o, frozen) for o in (sgd, adam)],
            "schedulers": [scheduler.state_dict()],
        }
    state = state_transfer.broadcast_state(state, src=0, group=dist.group.WORLD, receivers=[1, 2, 3])
    # Reference: what rank 0 has, sent as a (small) pickled object.
    reference = [None]
    if rank == 0:
        reference = [{"sgd": sgd.state_dict(), "adam": adam.state_dict(), "sched": scheduler.state_dict(),
                      "params": {k: v.clone() for k, v in net.state_dict().items()}}]
    dist.broadcast_object_list(reference, src=0)
    reference = reference[0]
    if rank != 0:
        sgd.load_state_dict(state["optimizers"][0])
        adam.load_state_dict(state["optimizers"][1])
        scheduler.load_state_dict(state["schedulers"][0])
        assert scheduler.state_dict() == reference["sched"]
        ids = {id(p): i for i, p in enumerate(net.parameters())}
        frozen_ids = {ids[id(p)] for p in frozen}
        for name, optimizer in (("sgd", sgd), ("adam", adam)):
            got = optimizer.state_dict()
            want = reference[name]
            assert got["param_groups"] == want["param_groups"]
            assert set(got["state"]) == set(want["state"]) - frozen_ids  # frozen entries left out
            for index, entry in got["state"].items():
                for key, value in entry.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(want["state"][index][key])), (name, index, key)
        net.load_state_dict(reference["params"])
    # One more step everywhere from the same state: the trainable parameters stay bit-identical.
    _step(net, (sgd, adam))
    params = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]
    gathered = [torch.empty_like(params[0]) for _ in range(world)]
    dist.all_gather(gathered, params[0])
    for other in gathered[1:]:
        assert torch.equal(other, gathered[0])


def _missing_sender(rank: int, world: int) -> None:
    group = dist.new_group(ranks=[0, 1], backend="gloo", timeout=timedelta(seconds=3))
    if rank == 1:  # rank 0 never sends: the receive must give up within the group's timeout
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            state_transfer.send_tensors([torch.empty(10)], src=0, receivers=[1], group=group)
        assert time.monotonic() - start < 15
    dist.barrier(group=dist.group.WORLD)


def _all(rank: int, world: int) -> None:
    # One set of processes for every check: starting processes dominates the cost here.
    for check in (_send_tensors_to_some, _module_state, _optimizer_state, _missing_sender):
        check(rank, world)
        dist.barrier()


@pytest.mark.distributed
def test_state_transfer_on_four_processes():
    """send_tensors reaches exactly the receivers (rank 1: an already-active replica, untouched),
    bit-exact over chunks, staging buffers and dtypes; module state: parameters to the receivers,
    buffers to all; an optimizer state without the frozen parameters' entries loads and the next
    step is identical everywhere; a receive whose sender never comes fails within the timeout."""
    spawn_gloo(_all, 4)


def _step(net: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """One training step of the toy net with every optimizer (the same on every rank)."""
    loss = net.head(net.norm(net.block(net.embed(torch.arange(16))))).square().mean()
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
