"""Per-SM streaming speeds: a schedule whose tiles follow them (MegakernelEngine(sm_speeds=...)), and their
measurement from a traced step.

Every matvec stage ends when its slowest SM is done. With tiles of equal bytes that is the SM that streams the
slowest, and the SMs of a GPU do not stream alike under a full-chip load: on the H200 a trace's LM head tiles (equal
bytes, pure streaming) took 110 to 126 us by CTA, in groups of neighbouring CTAs (profiles/RESULTS.md, 2026-12-04,
sixteenth session). Given each SM's relative speed, the schedule sizes an unsplit stage's tiles in proportion
(schedule.dag.speed_tiles) and the balanced assignment puts each where it finishes first.
"""

from __future__ import annotations

import statistics

import torch

from ..instructions.layout import StepLayout
from ..instructions.matvec_stages import MATVEC_OPCODES, weight_rows
from ..instructions.opcodes import Opcode
from ..instructions.split_k import split_tile_rows
from ..kernel.interpreter import KernelOptions
from ..kernel.stream import StreamPlan, wide

# speeds measured in this process, by (device, SM count): a property of the GPU, measured once
_MEASURED: dict[tuple[str, int], tuple[float, ...]] = {}


def speed_row_caps(layout: StepLayout) -> dict[Opcode, int]:
    """Per unsplit matvec stage, the rows a speed-sized tile may take: as many as the uniform tile's chunks hold
    (the kernel runs a tile in chunks of rows, an epilogue each; a tile a chunk longer than the uniform one would
    pay one more). Past SPLIT_BATCH none (the uniform tile's rows are the cap)."""
    if wide(layout.batch):
        return {}
    plan = StreamPlan.for_config(layout.config, layout.batch)
    caps = {}
    for op in MATVEC_OPCODES:          # (up to SPLIT_BATCH no stage splits over K)
        chunk = plan.geometry(weight_rows(op, layout)[1]).chunk_rows
        caps[op] = -(-split_tile_rows(layout, op, 1) // chunk) * chunk
    return caps


def measure_sm_speeds(records: list[dict], program) -> tuple[float, ...]:
    """Each CTA's relative streaming speed (mean 1) from a traced step's LM head (MegakernelEngine.trace_records of a
    program with an LM head): its tile's weight bytes over the time from its counter ready to its last slot landed.
    A CTA without an LM head tile gets the median. ValueError where the records hold no LM head."""
    k = program.layout.config.hidden_size
    rates = {}
    for r in records:
        if r["opcode"] != Opcode.LM_HEAD.name or "landed_last" not in r:
            continue
        ns = r["landed_last"] - r["ready"]
        if ns > 0:
            rates[r["sm"]] = program.instructions[r["index"]].a1 * k * 2 / ns
    if not rates:
        raise ValueError("the trace holds no LM head tile with its slots' landing stamps (trace a step with the "
                         "LM head, KernelOptions(trace=True))")
    median = statistics.median(rates.values())
    speeds = [rates.get(sm, median) for sm in range(program.layout.num_sms)]
    mean = statistics.fmean(speeds)
    return tuple(v / mean for v in speeds)


def speed_runs(engine, runs: int) -> list[tuple[tuple[float, ...], dict[int, int]]]:
    """`runs` times, three steps of a trace-mode engine from position 0 (token 0, counters reset), then from the last
    one's trace each CTA's relative speed (measure_sm_speeds) and the physical SM it ran on (CTA -> %smid)."""
    out = []
    for _ in range(runs):
        engine.reset_sync()
        engine.bufs.tokens.zero_()
        engine.bufs.positions.zero_()
        for _ in range(3):
            engine.launch()
        torch.cuda.synchronize(engine.device)
        engine.check()
        records = engine.trace_records()
        out.append((measure_sm_speeds(records, engine.program),
                    {r["sm"]: r["smid"] for r in records}))
    return out


def measured_sm_speeds(engine_cls, weights, packed, max_seq_len: int, device: torch.device, num_sms: int,
                       steps: int = 2, **layout_kw) -> tuple[float, ...]:
    """Each CTA's relative streaming speed on this GPU (MegakernelEngine(sm_speeds="measure")): a trace-mode
    engine_cls of batch 1 over the same packed weights, the mean of `steps` speed_runs. Measured once per (device,
    SM count) in a process."""
    key = (str(device), num_sms)
    if key not in _MEASURED:
        twin = engine_cls(weights, 1, max_seq_len, num_sms=num_sms, options=KernelOptions(trace=True),
                          device=device, packed_weights=packed, **layout_kw)
        _MEASURED[key] = tuple(statistics.fmean(v) for v in zip(*(sp for sp, _ in speed_runs(twin, steps))))
    return _MEASURED[key]
