"""Ranks of a process group as threads of one process, for the CPU tests of what tensor-parallel ranks agree on
(runtime.collective, runtime.tensor_parallel.TensorParallelRank's setup, the vLLM adapter's decisions): each
thread is a rank, and the group's collectives meet at a barrier, as torch.distributed's do across processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

# A rank that never reaches a collective makes the others fail after this many seconds instead of hanging a test.
TIMEOUT_S = 30.0


class ThreadGroup:
    """world_size ranks as threads: gather_object(rank)(obj) -> every rank's obj in rank order; gather_rows(rank)(t)
    -> every rank's t concatenated along dim 0 (what all_gather_object over a CPU group and all_gather over a device
    group return). Every rank must call the same collectives in the same order; `calls` counts them per rank."""

    def __init__(self, world_size: int, timeout: float = TIMEOUT_S):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size
        self.calls = [0] * world_size

    def _exchange(self, rank: int, obj: Any) -> list:
        self.calls[rank] += 1
        self._slots[rank] = obj
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()          # every rank has read this round before the next one writes
        return everyone

    def gather_object(self, rank: int) -> Callable[[Any], list]:
        return lambda obj: self._exchange(rank, obj)

    def gather_rows(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.cat(self._exchange(rank, t.clone()), dim=0)


def run_rank_threads(world_size: int, fn: Callable[[int, ThreadGroup], Any], timeout: float = TIMEOUT_S) -> list:
    """fn(rank, group) on world_size threads -> every rank's result, or the exception it raised, in rank order."""
    group = ThreadGroup(world_size, timeout)
    out: list[Any] = [None] * world_size

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank, group)
        except BaseException as exc:   # noqa: BLE001 (returned to the test, which asserts on it)
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish")
    return out
