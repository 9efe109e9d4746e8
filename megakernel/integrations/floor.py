"""The read-bandwidth floor of a decode step: every weight must be read once per step.

floor(ms/step) = (weight bytes + KV-cache bytes read) / bandwidth. The divisor is a pure device read
measured in the same run as the kernel it judges (BASELINES.md: "Measure it in the same run").
"""

from __future__ import annotations

import statistics
import time

import torch

from megakernel.model.config import ModelConfig

GIB = 1 << 30


def measure_read_bandwidth(nbytes: int = 2 * GIB, device: torch.device | str = "cuda",
                           repeats: int = 20, warmup: int = 3) -> float:
    """Bytes per second of a pure read: `torch.sum` over an `nbytes` bfloat16 buffer, median of `repeats`.

    On CUDA each read is timed with CUDA events; on the CPU (only useful for tests) with a wall clock.
    """
    if nbytes < 2 or repeats < 1 or warmup < 0:
        raise ValueError(f"need nbytes >= 2, repeats >= 1, warmup >= 0; got {nbytes}, {repeats}, {warmup}")
    device = torch.device(device)
    # Random data, so the read cannot be elided or compressed; sum accumulates in float32.
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    out = torch.empty((), dtype=torch.float32, device=device)
    for _ in range(warmup):
        torch.sum(buf, dim=0, dtype=torch.float32, out=out)
    times_s: list[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends):
            start.record()
            torch.sum(buf, dim=0, dtype=torch.float32, out=out)
            end.record()
        torch.cuda.synchronize(device)
        times_s = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.sum(buf, dim=0, dtype=torch.float32, out=out)
            times_s.append(time.perf_counter() - t0)
    del buf
    return (nbytes // 2) * 2 / statistics.median(times_s)


def kv_read_bytes(config: ModelConfig, batch: int, context_len: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that attention must read for `batch` sequences of `context_len` tokens each."""
    return batch * context_len * config.num_layers * 2 * config.kv_size * dtype_bytes


def floor_ms(config: ModelConfig, batch: int, bandwidth: float, context_len: int = 0,
             dtype_bytes: int = 2) -> float:
    """Milliseconds one decode step needs at least: weights once (whatever the batch) + KV at `context_len`."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive bytes/s, got {bandwidth}")
    if batch < 1 or context_len < 0:
        raise ValueError(f"need batch >= 1 and context_len >= 0, got batch={batch}, context_len={context_len}")
    nbytes = config.weight_bytes(dtype_bytes) + kv_read_bytes(config, batch, context_len, dtype_bytes)
    return nbytes / bandwidth * 1e3
