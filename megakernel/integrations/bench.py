"""Side-by-side decode benchmark: every available backend on one preset, against the read floor.

For each batch size and backend: a `context`-token prompt (prefilled as decode steps), then `steps`
greedy decode steps, each timed with CUDA events; the figure is the median ms per decode step. The read
bandwidth that the floor divides by is measured in the same run (megakernel.integrations.floor).
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from megakernel.integrations import backends as backends_mod
from megakernel.integrations.floor import floor_ms, kv_read_bytes, measure_read_bandwidth
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights

DEFAULT_PRESET = "llama-3.2-1b"
CPU_PRESET = "tiny-llama"
GPU_BACKENDS = ("torch-eager", "torch-graph", "torch-compile", "megakernel")
CPU_BACKENDS = ("reference", "torch-eager")


@dataclass
class BenchRow:
    backend: str
    batch: int
    ms_per_step: float | None = None         # median decode step
    tokens_per_s: float | None = None
    gb_per_s: float | None = None            # floor bytes (weights + KV at the mean context) / ms_per_step
    floor_fraction: float | None = None      # floor ms / ms_per_step
    speedup: dict[str, float] = field(default_factory=dict)   # baseline name -> its ms / this ms
    tokens_agree: float | None = None        # share of generated tokens equal to the first backend's
    error: str | None = None                 # why this backend did not run


@dataclass
class BenchReport:
    preset: str
    device: str
    dtype: str
    context: int
    steps: int
    read_bandwidth: float | None             # bytes/s of a pure device read, this run (None on the CPU)
    floor_ms: dict[int, float]               # batch -> floor ms per step
    rows: list[BenchRow]
    notes: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def time_cuda_graph(fn: Callable[[], object], *, warmup: int = 3, replays: int = 20, repeats: int = 7) -> float:
    """Median milliseconds per call of `fn`, captured once in a CUDA graph and replayed.

    Each of `repeats` samples times `replays` back-to-back replays between two CUDA events.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)


def check_bench_args(config, batches: tuple[int, ...], steps: int, context: int,
                     backend_names: tuple[str, ...] | None) -> None:
    """ValueError for arguments the benchmark cannot run with (checked before any work)."""
    if steps < 1 or context < 1 or not batches or any(b < 1 for b in batches):
        raise ValueError(f"need steps >= 1, context >= 1 and batch sizes >= 1; got steps={steps}, "
                         f"context={context}, batches={batches}")
    if context + steps - 1 > config.max_position_embeddings:
        raise ValueError(f"a {context}-token context plus {steps} steps passes max_seq_len = "
                         f"max_position_embeddings = {config.max_position_embeddings} of {config.name}")
    for name in backend_names or ():
        if name not in backends_mod.BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose from {', '.join(backends_mod.BACKENDS)}")


def run_bench(preset: str | None = None, batches: tuple[int, ...] = (1,), steps: int = 128, context: int = 32,
              backend_names: tuple[str, ...] | None = None, device: str | torch.device | None = None,
              seed: int = 0, compile_mode: str | None = None, megakernel_options: dict | None = None,
              log: Callable[[str], None] = lambda msg: None) -> BenchReport:
    """Run the benchmark; `log` receives progress lines. A backend that cannot run gets a row with `error`.
    megakernel_options: MegakernelEngine keywords for the megakernel backend (parse_engine_options)."""
    notes: list[str] = []
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    device = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
    if preset is None:
        preset = DEFAULT_PRESET if cuda else CPU_PRESET
    config = get_preset(preset)
    if backend_names is None:
        backend_names = GPU_BACKENDS if cuda else CPU_BACKENDS
    if not cuda:
        notes.append(f"no CUDA device: {', '.join(backend_names)} on the {preset} preset in float32 on the CPU "
                     f"(the rows say which ran); no bandwidth floor")
    check_bench_args(config, batches, steps, context, backend_names)
    if megakernel_options:
        notes.append("megakernel backend built with " + ", ".join(f"{k}={v}" for k, v in megakernel_options.items()))
    dtype = torch.bfloat16 if cuda else torch.float32
    dtype_bytes = torch.empty((), dtype=dtype).element_size()

    bandwidth = None
    if cuda:
        log("measuring the device read bandwidth (sum over 2 GiB of bf16)...")
        bandwidth = measure_read_bandwidth(device=device)
        log(f"read bandwidth: {bandwidth / 1e12:.2f} TB/s")
    log(f"building seeded random weights for {preset} ({config.weight_bytes(dtype_bytes) / 1e9:.2f} GB, {dtype})")
    weights = random_weights(config, seed=seed, dtype=dtype, device=device)

    gen = torch.Generator().manual_seed(seed)
    rows: list[BenchRow] = []
    floors: dict[int, float] = {}
    mean_context = context + (steps - 1) / 2          # KV length averaged over the decode steps
    for batch in batches:
        floor_bytes = (config.weight_bytes(dtype_bytes)
                       + kv_read_bytes(config, batch, round(mean_context), dtype_bytes))
        if bandwidth is not None:
            floors[batch] = floor_ms(config, batch, bandwidth, round(mean_context), dtype_bytes)
        prompts = torch.randint(0, config.vocab_size, (batch, context), generator=gen).tolist()
        first_tokens = None
        batch_rows = []
        for name in backend_names:
            row = BenchRow(backend=name, batch=batch)
            batch_rows.append(row)
            try:
                kw = {"compile_mode": compile_mode} if name == "torch-compile" and compile_mode else {}
                if name == "megakernel" and megakernel_options:
                    kw = dict(megakernel_options)
                log(f"{name}, batch {batch}: building" + (" (compiling, can take minutes)"
                                                          if name == "torch-compile" else ""))
                backend = backends_mod.get_backend(name, weights, device, **kw)
                log(f"{name}, batch {batch}: {context}-token context, then {steps} decode steps")
                out = backends_mod.generate(backend, prompts, steps)
            except (RuntimeError, ValueError) as exc:   # BackendUnavailable, OOM, a batch the backend refuses
                row.error = f"{type(exc).__name__}: {exc}"
                log(f"{name}, batch {batch}: did not run: {row.error}")
                continue
            finally:
                backend = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            row.ms_per_step = out.median_decode_ms
            row.tokens_per_s = out.tokens_per_s
            row.gb_per_s = floor_bytes / (row.ms_per_step * 1e-3) / 1e9
            if batch in floors:
                row.floor_fraction = floors[batch] / row.ms_per_step
            flat = [t for seq in out.tokens for t in seq]
            if first_tokens is None:
                first_tokens = flat
            row.tokens_agree = sum(a == b for a, b in zip(flat, first_tokens)) / len(flat)
        for row in batch_rows:
            if row.ms_per_step is None:
                continue
            for base in batch_rows:
                if base.backend in backends_mod.TORCH_BASELINES and base.ms_per_step and base is not row:
                    row.speedup[base.backend] = base.ms_per_step / row.ms_per_step
        rows.extend(batch_rows)
    ran = [r for r in rows if r.error is None]
    if ran:
        notes.append(f"tokens_agree compares each backend's greedy tokens with those of {ran[0].backend}; "
                     f"random-weight models have near-ties, so bf16 runs may part ways")
    return BenchReport(preset=preset, device=_device_name(device), dtype=str(dtype).replace("torch.", ""),
                       context=context, steps=steps, read_bandwidth=bandwidth, floor_ms=floors, rows=rows,
                       notes=notes)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def format_table(report: BenchReport) -> str:
    """The report as a fixed-width text table, with its header and notes."""
    bases = [b for b in backends_mod.TORCH_BASELINES if any(r.backend == b and r.error is None for r in report.rows)]
    lines = [f"preset {report.preset}, {report.dtype}, device {report.device}: {report.context}-token context, "
             f"then {report.steps} decode steps (median ms/step)"]
    if report.read_bandwidth is not None:
        floors = ", ".join(f"batch {b}: {ms:.3f} ms" for b, ms in report.floor_ms.items())
        lines.append(f"read bandwidth {report.read_bandwidth / 1e12:.2f} TB/s measured in this run; "
                     f"read floor {floors}")
    header = ["backend", "batch", "ms/step", "tok/s", "GB/s", "% floor", "agree"] + [f"vs {b}" for b in bases]
    table = [header]
    for r in report.rows:
        if r.error is not None:
            table.append([r.backend, str(r.batch), "-", "-", "-", "-", "-"] + ["-"] * len(bases))
            continue
        cells = [r.backend, str(r.batch), f"{r.ms_per_step:.3f}", f"{r.tokens_per_s:,.0f}", f"{r.gb_per_s:,.0f}",
                 "-" if r.floor_fraction is None else f"{100 * r.floor_fraction:.0f}%",
                 f"{100 * r.tokens_agree:.0f}%"]
        cells += [f"{r.speedup[b]:.2f}x" if b in r.speedup else "-" for b in bases]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in report.rows:
        if r.error is not None:
            lines.append(f"{r.backend} (batch {r.batch}) did not run: {r.error}")
    lines.extend(report.notes)
    return "\n".join(lines)
