"""The CUDA/NCCL faults of a multi-device run, made to fail on CPU (devices.VirtualDevices), and their fixes.

On CPU a move between devices is a no-op, so a DDP wrapper bound before the blocks were placed,
optimizer state left behind by a move, or a collective on a tensor off the process's device pass
silently. Under ``VirtualDevices`` they raise; the 4-process AutoDP run under it
(tests/integration/distributed/test_autodp.py, ``virtual``) passes only with the fixes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.devices import VirtualDeviceError, VirtualDevices, optimizer_state_to_param_devices
from lightning_pipetransformer.devices.handover import _Hop
from lightning_pipetransformer.dp import pieces

CPU0, CPU1, CPU2 = (torch.device("cpu", i) for i in range(3))


def test_a_block_moved_after_ddp_wrapped_it_fails():
    block = nn.Linear(4, 4)
    with VirtualDevices():
        dev.place_module(block, CPU0)
        dev.before_wrap(list(block.parameters()), CPU0)
        with pytest.raises(VirtualDeviceError, match="after DDP wrapped it"):
            dev.place_module(block, CPU1)
        dev.after_unwrap()
        dev.place_module(block, CPU1)  # once the wrapper is dropped, blocks may move


def test_ddp_over_parameters_of_several_devices_fails():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    with VirtualDevices():
        dev.place_module(first, CPU0)
        dev.place_module(second, CPU1)
        with pytest.raises(VirtualDeviceError, match="DDP wraps a parameter on cpu:1"):
            dev.before_wrap([*first.parameters(), *second.parameters()], CPU0)


@pytest.mark.parametrize("options", [{}, {"fused": True}])
def test_optimizer_state_follows_its_parameter(options):
    block = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(block.parameters(), lr=0.1, **options)
    with VirtualDevices() as virtual:
        dev.place_module(block, CPU2)
        block(torch.randn(2, 4)).sum().backward()
        dev.check_optimizer(optimizer)
        optimizer.step()
        dev.check_optimizer(optimizer)  # the state was made next to its parameter: tagged cpu:2
        dev.place_module(block, CPU1)  # K 4 -> 2: the block moves to another device
        with pytest.raises(VirtualDeviceError, match="Optimizer state .* is on cpu:2 but its parameter on cpu:1"):
            dev.check_optimizer(optimizer)
        optimizer_state_to_param_devices([optimizer])
        dev.check_optimizer(optimizer)
        step = optimizer.state[block.weight]["step"]
        # 'step' goes with the parameter only where the optimizer computes it there (fused, capturable).
        assert (virtual.device_of(step) == CPU1) == bool(options)


def test_a_dead_tensors_tag_never_speaks_for_a_new_tensor_at_its_address():
    # CPython reuses a dead object's id: a tag (or DDP's record) keyed by id alone made a new momentum
    # buffer at a reused address look "tagged on cpu" and failed the 4-process virtual run at random.
    param = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    with VirtualDevices() as virtual:
        virtual.tag(param, CPU0)
        for _ in range(1000):
            dead = torch.zeros(3)
            virtual.tag(dead, CPU1)
            virtual.wrapped[id(dead)] = (lambda: None, CPU1)  # as DDP's record of a parameter now dead
            address = id(dead)
            del dead
            buffer = torch.zeros(3)
            if id(buffer) == address:
                break
        else:
            pytest.fail("CPython gave no dead tensor's address to a new one in 1000 tries")
        assert virtual.device_of(buffer) == buffer.device and not virtual.tagged(buffer)
        optimizer.state[param]["momentum_buffer"] = buffer
        dev.check_optimizer(optimizer)  # made next to its parameter: tagged there, not refused
        assert virtual.device_of(buffer) == CPU0
        assert virtual._live(virtual.wrapped, buffer) is None  # DDP's dead record: no refusal of a move of the new one


def test_a_collective_on_a_tensor_off_the_process_device_fails_and_staging_avoids_it():
    on_stage = torch.randn(300_000)  # > COALESCE_BYTES: sent straight from its own memory when it may be
    with VirtualDevices():
        dev.bind_process_device(CPU0)
        dev.tag_as(on_stage, CPU1)  # a tensor of a pipeline stage on another device
        with pytest.raises(VirtualDeviceError, match="bound to cpu:0"):
            dev.check_collective(on_stage, "test")
        direct = list(pieces.pieces([on_stage], pieces.CHUNK_BYTES))  # without via: straight from cpu:1
        with pytest.raises(VirtualDeviceError):
            dev.check_collective(direct[0].direct, "test")
        ring = pieces.StagingRing(1)
        for piece in pieces.pieces([on_stage], pieces.CHUNK_BYTES, via=CPU0):
            assert piece.direct is None and piece.device == CPU0
            _, message = ring.take(piece)
            dev.check_collective(message, "test")  # staged through a buffer on the process's device
            assert message.numel() == sum(t.numel() for t in piece.targets)


def test_same_device_hop_returns_a_tensor_an_in_place_op_may_change():
    # A stage's input handed over on one device (the CUDA path's autograd function, run on CPU).
    x = torch.randn(3, 2, requires_grad=True)
    y = _Hop.apply(None, None, torch.device("cpu"), x * 1)
    assert not y._is_view()
    y.relu_().sum().backward()  # raised "a view created inside a custom Function" before
    torch.testing.assert_close(x.grad, (x > 0).float())


def test_joining_replicas_get_the_loss_scale():
    from lightning_pipetransformer.dp.loop_state import load_replica_state, replica_state

    def scaler_with(scale: float) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=scale)

    rank0, joining = scaler_with(1024.0), scaler_with(65536.0)
    sent = replica_state([], [], rank0, frozen=[])
    load_replica_state(sent, [], [], joining)
    assert joining.get_scale() == 1024.0  # replicas unscale by the same factor


def test_the_first_hit_check_allows_what_a_lower_precision_rounds():
    from lightning_pipetransformer.stack.tolerance import verification_tolerance

    assert verification_tolerance(torch.float32, torch.float32, None) == (1e-3, 1e-4)
    bf16 = verification_tolerance(torch.float32, torch.float32, torch.bfloat16)  # bf16-mixed: autocast
    fp16 = verification_tolerance(torch.float16, torch.float16, None)  # 16-true
    assert bf16 == (4 * 2**-7, 4 * 2**-7) and fp16 == (4 * 2**-10, 4 * 2**-10)
    # Two bf16 results of one computation at other batch shapes differ by a few ulps: allowed;
    # a stale entry (another input) differs by far more: still caught.
    x = torch.randn(64, 32)
    a = (x @ torch.randn(32, 32)).to(torch.bfloat16).float()
    b = a + a.abs() * 2**-7  # one ulp off everywhere
    assert torch.allclose(a, b, rtol=bf16[0], atol=bf16[1]) and not torch.allclose(a, b, rtol=1e-3, atol=1e-4)
    assert not torch.allclose(a, a.flip(0), rtol=bf16[0], atol=bf16[1])


def test_the_first_hit_tolerance_follows_cudnn_tf32_only_for_a_prefix_with_convolutions(monkeypatch):
    """cuDNN's TF32 switch (True by default) governs convolutions; Transformer blocks run matmuls
    only, so it must not loosen their fp32 check ~40x; matmul TF32 always counts."""
    from lightning_pipetransformer.stack.tolerance import TF32, convolves, fp32_math_dtype

    cuda = torch.device("cuda", 0)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
        assert fp32_math_dtype(cuda) is None  # matmuls only
        assert fp32_math_dtype(cuda, convolutions=True) is TF32
        assert fp32_math_dtype(torch.device("cpu"), convolutions=True) is None
        torch.set_float32_matmul_precision("high")
        assert fp32_math_dtype(cuda) is TF32  # TF32 matmuls count whatever the prefix runs
    finally:
        torch.set_float32_matmul_precision(before)

    # AutoCache passes the frozen blocks (those before the boundary, here 1).
    assert not convolves([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)][:1])  # the convolution is past the boundary
    assert convolves([nn.Sequential(nn.Conv1d(2, 2, 1)), nn.Linear(2, 2)][:1])


def test_the_first_hit_check_allows_tf32_matmuls():
    """Lightning suggests set_float32_matmul_precision("high") on Ampere/Hopper: fp32 matmuls then run in TF32."""
    from lightning_pipetransformer.stack.tolerance import fp32_math_dtype, verification_tolerance

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fp32_math_dtype(torch.device("cpu")) is None
        torch.set_float32_matmul_precision("high")
        tf32 = verification_tolerance(torch.float32, torch.float32, None, fp32_math_dtype(torch.device("cpu")))
        torch.set_float32_matmul_precision("medium")
        assert fp32_math_dtype(torch.device("cpu")) is torch.bfloat16
    finally:
        torch.set_float32_matmul_precision(before)
    assert tf32 == (4 * 2**-10, 4 * 2**-10)
    # A matmul with TF32 inputs (10-bit mantissas) against the fp32 one: off by more than fp32's
    # tolerance, within TF32's; a stale entry is still caught.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g)

    def to_tf32(t):
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)  # drop the 13 low mantissa bits

    exact, rounded = x @ w, to_tf32(x) @ to_tf32(w)
    assert not torch.allclose(exact, rounded, rtol=1e-3, atol=1e-4)
    assert torch.allclose(exact, rounded, rtol=tf32[0], atol=tf32[1])
    assert not torch.allclose(exact, exact.flip(0), rtol=tf32[0], atol=tf32[1])


def test_blocks_moved_between_gpus_release_cublas_workspaces_then_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    dev.release_cached_memory([torch.device("cpu")])
    dev.release_cached_memory([])  # no block left a device
    assert calls == []
    dev.release_cached_memory([torch.device("cpu"), torch.device("cuda", 0)])  # one of them a GPU
    assert calls == ["workspaces", "empty_cache"]  # the workspaces go back to the allocator first, then to the driver
