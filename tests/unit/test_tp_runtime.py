"""Tensor parallel's runtime on the CPU: what a rank's warm-up launch passes the kernel (the launch itself needs a
GPU: tests/e2e/test_tensor_parallel.py)."""

from __future__ import annotations

import contextlib
import ctypes
import inspect

import torch

from megakernel.kernel.interpreter import ARG_NAMES
from megakernel.runtime.tensor_parallel import TensorParallelEngine, _Rank


class _Stream:
    cuda_stream = 0

    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


class _Bufs:
    sync = torch.full((4,), 7, dtype=torch.int32)


def test_a_tensor_parallel_rank_warms_up_with_no_instruction_and_a_scratch_epoch(monkeypatch):
    """warm_up launches the rank's own compiled kernel once, on its device and stream, with every queue length 0
    and a zeroed scratch epoch in place of the rank's; every other argument is the step's, and it waits for the
    launch."""
    from cutlass import Int64

    current = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: current.append(d) or contextlib.nullcontext())
    rk = _Rank.__new__(_Rank)
    rk.queue_lengths = torch.full((66,), 5, dtype=torch.int32)
    rk.bufs, rk.stream, rk.device = _Bufs(), _Stream(), "cuda:1"
    rk.args = [Int64(1000 + i) for i in range(len(ARG_NAMES))]
    calls = []

    def compiled(*args):
        calls.append([int(a) for a in args[:-1]])
        # (the scratch tensors are alive during the call: read them here, on the CPU)
        lengths = args[ARG_NAMES.index("lengths")]
        sync = args[ARG_NAMES.index("sync")]
        assert list((ctypes.c_int32 * 66).from_address(int(lengths))) == [0] * 66
        assert list((ctypes.c_int32 * 4).from_address(int(sync))) == [0] * 4
    rk.compiled = compiled
    rk.warm_up()
    assert len(calls) == 1 and rk.stream.synced == 1 and current == ["cuda:1"]
    (args,) = calls
    for i, name in enumerate(ARG_NAMES):
        if name in ("lengths", "sync"):
            assert args[i] not in (1000 + i,), name
        else:
            assert args[i] == 1000 + i, name


def test_the_tensor_parallel_engine_warms_every_rank_before_any_step():
    """Loading a rank's module may wait for the kernels running on the device: every rank is warmed up in the
    constructor, after every rank compiled, never in launch()."""
    init = inspect.getsource(TensorParallelEngine.__init__)
    assert init.index("rk.warm_up()") > init.index("rk.compile(")
    assert "warm_up" not in inspect.getsource(TensorParallelEngine.launch)
