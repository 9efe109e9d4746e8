"""Batch 16-64: matvec stages split over K (docs/batch_path.md), and MV_REDUCE, which closes them.

Past SPLIT_BATCH a tile over the whole of K stages B x K of input for few rows (the
input bytes grow with the batch, the weight bytes do not), so `k_splits` may split QKV, O_PROJ and DOWN into E
ranges of K: each tile multiplies E times the rows of an unsplit one over 1/E of the columns and stores a
float32 partial (matvec_stages: part_<stage>[l, e]). The E ranges' tiles of a layer's stage signal the stage's
*_PARTS counter; for O_PROJ and DOWN, MV_REDUCE instructions wait for all of them and run the stage's epilogue
(the residual add) on rows [a0, a0 + a1):

    y = partial[0] + partial[1] + ... + partial[E - 1]      (in range order, whatever order the tiles ran in)

so the result is the same bits every run. Operands: a0 = first row, a1 = row count, a2 = the split stage's opcode,
a3 = E. QKV's partials are summed by the attention that reads them (qkv_reduce_folded), with the same additions,
times the RMS scale (which needs all of a row's K; on the device it is taken from the sums of squares per 8
columns that the input's producing stage wrote beside it, StepBuffers.x_ssq, added in column order).
LM_HEAD is never split (its (max, argmax) per tile needs whole logits), nor GATE_UP (its reduce would be the
chain's longest: the RMS scale of h, gate and up partials, SiLU; whole, its tiles gave steps 0.9-7.8% shorter at
the seven batch 16-64 shapes measured where the bytes alone would split it: profiles/RESULTS.md, 2026-12-07,
forty-sixth session), nor any stage at batches up to SPLIT_BATCH.
"""

from __future__ import annotations

import math

from .context import StageContext
from .layout import ROW_GROUP, SPLIT_BATCH, tile_rows
from .matvec_stages import PART_BUFFERS, output_regions, part_regions, residual_reads, store_output, weight_rows
from .opcodes import Opcode, Stage
from .record import Instruction

OPCODE = Opcode.MV_REDUCE
SPLIT_STAGES = tuple(PART_BUFFERS)
REDUCED_STAGES = (Opcode.O_PROJ, Opcode.DOWN)   # the split stages MV_REDUCE closes
PARTS_STAGE = {Opcode.QKV: Stage.QKV_PARTS, Opcode.O_PROJ: Stage.O_PROJ_PARTS, Opcode.DOWN: Stage.DOWN_PARTS}
SPLIT_COLUMNS = 256        # K ranges are whole multiples of the kernel's 256-column unit
ACCUMULATORS = 64 * 480    # float32 accumulators the consumer warps hold (64 registers x 480 threads): a tile's
                           # rows x B beyond it go in row chunks, each reading the input again


def row_group(op: Opcode) -> int:
    """Rows a tile of the stage holds a multiple of (GATE_UP: whole gate/up pairs)."""
    return 2 * ROW_GROUP if op == Opcode.GATE_UP else ROW_GROUP


def split_tile_rows(layout, op: Opcode, e: int) -> int:
    """Rows per tile of a stage split into e K ranges: e times as many tiles as rows allow, about SMs in all
    (e = 1: an unsplit stage's tiles, and MV_REDUCE's)."""
    rows, _ = weight_rows(op, layout)
    return tile_rows(rows, max(1, layout.num_sms // e), row_group(op))


def k_splits(layout, op: Opcode) -> int:
    """The number of K ranges E a stage is split into: 1 for LM_HEAD and GATE_UP and at the megakernel's batches;
    else the divisor of K / 256 that minimises a cost model of the stage's time in bytes per SM: ceil(tiles / SMs)
    x a tile's bytes (weights, input once per row chunk as bf16, its float32 partial) + a reduce tile's partial
    reads.
    (docs/batch_path.md has the table this gives on the presets.)"""
    if op not in PARTS_STAGE or layout.batch <= SPLIT_BATCH:
        return 1
    rows, k = weight_rows(op, layout)
    nb, sms = layout.batch, layout.num_sms
    units = k // SPLIT_COLUMNS if k % SPLIT_COLUMNS == 0 else 1      # (ranges of whole 256-column units)
    reduce_rows = split_tile_rows(layout, op, 1)
    best, best_cost = 1, None
    for e in (d for d in range(1, units + 1) if units % d == 0):
        per = split_tile_rows(layout, op, e)
        tiles = e * math.ceil(rows / per)
        chunks = math.ceil(per * nb / ACCUMULATORS)
        tile_bytes = per * (k // e) * 2 + chunks * nb * (k // e) * 2
        cost = math.ceil(tiles / sms) * tile_bytes
        if e > 1:
            cost += per * nb * 4 + e * reduce_rows * nb * 4
        if best_cost is None or cost < best_cost:
            best, best_cost = e, cost
    return best


def qkv_reduce_folded(layout) -> bool:
    """Whether QKV is split over K, and so its reduce folded into the attention: QKV has no MV_REDUCE; each
    ATTN_PARTIAL waits for every QKV K-range tile of its layer and sums its own q, k and v rows' partials in range
    order, times its sequence's RMS scale (the additions an MV_REDUCE would make), instead of reading qkv. A reduce
    stage and a global hop fewer per layer than closing QKV with MV_REDUCE: at batch 64 on the H200 1.697 -> 1.606 ms
    per step on llama-3.2-1b, 2.036 -> 1.833 on qwen3-0.6b (profiles/RESULTS.md, 2026-12-04)."""
    return k_splits(layout, Opcode.QKV) > 1


def _stage(ins: Instruction) -> Opcode:
    op = Opcode(ins.a2)
    if op not in REDUCED_STAGES:
        raise ValueError(f"MV_REDUCE #{ins.index} a2={ins.a2} names no stage that it closes "
                         f"({', '.join(o.name for o in REDUCED_STAGES)})")
    return op


def reads(ins: Instruction, layout) -> list:
    op, lo, hi = _stage(ins), ins.a0, ins.a0 + ins.a1
    out = []
    for e in range(ins.a3):
        out += part_regions(op, ins.layer, e, lo, hi, layout)
    return out + residual_reads(op, ins.layer, lo, hi, layout)


def writes(ins: Instruction, layout) -> list:
    return output_regions(_stage(ins), ins.layer, ins.a0, ins.a0 + ins.a1, 0, layout)


def sum_ranges(parts, layer: int, num_ranges: int, seqs: slice, rows: slice):
    """The partials of a stage's K ranges 0 .. num_ranges - 1 for sequences `seqs` and rows `rows`, added in range
    order (the reduce's order, wherever it runs: MV_REDUCE, or the attention that QKV's is folded into)."""
    y = parts[layer, 0, seqs, rows].clone()
    for e in range(1, num_ranges):
        y += parts[layer, e, seqs, rows]
    return y


def reference(ins: Instruction, ctx: StageContext) -> None:
    op, l, lo, hi = _stage(ins), ins.layer, ins.a0, ins.a0 + ins.a1
    y = sum_ranges(getattr(ctx.bufs, PART_BUFFERS[op]), l, ins.a3, slice(None), slice(lo, hi))
    store_output(op, l, lo, hi, 0, y, ctx)
