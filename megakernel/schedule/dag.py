"""The instruction DAG of one decode step: instructions in a global topological order, each waiting
on one counter (the stage it reads from) and signalling the counter of its own stage.

Every edge is a (layer, stage) counter: a consumer waits until all instructions of the producing
stage have signalled. Release/acquire chains make that transitive, so an instruction sees every
store that happened before the stage it waits on (e.g. O_PROJ reads x[l], written by DOWN of layer
l-1, two stages before the ATTN_REDUCE it waits for). Where the layout stages matvec inputs in shared
memory, O_PROJ waits on ATTN_PARTIAL directly and merges the splits itself (`StepLayout.fused_reduce`). Past
SPLIT_BATCH, where attention.warp_attention says, an ATTN_PARTIAL takes several sequences (sequence_groups).
Past the megakernel's batch, a matvec stage may be split over K (instructions/split_k.py): its K ranges' tiles
signal the stage's *_PARTS counter, and MV_REDUCE tiles, which wait for all of them, signal the stage's counter;
QKV's have no MV_REDUCE: the ATTN_PARTIALs wait for them and sum the partials themselves (qkv_reduce_folded).

`build_program(layout, lm_head=False)` is the same program without its last two stages (LM_HEAD,
ARGMAX): the step ends when the last layer's DOWN has written x[L], and nothing advances tokens or
positions (ARGMAX does that), so the caller writes both before every launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..instructions.attention import sequence_groups, split_range  # noqa: F401  (split_range re-exported)
from ..instructions.embed import embed_ranges
from ..instructions.layout import StepLayout, tile_rows  # noqa: F401  (tile_rows re-exported)
from ..instructions.matvec_stages import weight_rows
from ..instructions.opcodes import (Opcode, Stage, argmax_counter, counter_id, embed_counter,
                                    lm_head_counter, num_counters)
from ..instructions.record import NO_COUNTER, Instruction
from ..instructions.split_k import PARTS_STAGE, REDUCED_STAGES, k_splits, qkv_reduce_folded, split_tile_rows

# Cost model: bytes a stage reads from HBM plus a fixed cost per instruction (in bytes of time).
FIXED_COST_BYTES = 16 * 1024


@dataclass(frozen=True)
class StepProgram:
    """The DAG of a step: instructions in global topological order, plus counter bookkeeping."""

    layout: StepLayout
    instructions: tuple[Instruction, ...]
    num_counters: int
    lm_tiles: int           # LM_HEAD tiles; 0 for a program without the LM head (and ARGMAX)

    @property
    def has_lm_head(self) -> bool:
        """Whether the step ends with LM_HEAD + ARGMAX (next tokens) or at x[L] (lm_head=False)."""
        return self.lm_tiles > 0


def _tiles(rows: int, per_tile: int) -> list[tuple[int, int]]:
    return [(lo, min(per_tile, rows - lo)) for lo in range(0, rows, per_tile)]


def build_program(layout: StepLayout, tile_rows_override: dict | None = None, *,
                  lm_head: bool = True) -> StepProgram:
    """The step's DAG. lm_head=False leaves out LM_HEAD and ARGMAX: the same instructions (same
    indices, waits and signals) up to the last layer's DOWN, which writes x[L]; lm_tiles is then 0."""
    layout.validate()
    c = layout.config
    L, B, S = c.num_layers, layout.batch, layout.kv_splits
    out: list[Instruction] = []
    elem = 2  # bf16 weights

    def rows_per_tile(op: Opcode) -> int:
        if tile_rows_override and op in tile_rows_override:
            return tile_rows_override[op]
        return split_tile_rows(layout, op, 1)

    def add(**kw) -> None:
        out.append(Instruction(index=len(out), **kw))

    def matvec_stage(op: Opcode, layer: int, wait: tuple[int, int], signal: int, a3: int = 0) -> int:
        rows, k = weight_rows(op, layout)
        e = k_splits(layout, op)
        if e == 1:
            tiles = _tiles(rows, rows_per_tile(op))
            for t, (lo, n) in enumerate(tiles):
                add(opcode=op, layer=layer, a0=lo, a1=n, a2=t, a3=a3, wait_id=wait[0], wait_count=wait[1],
                    signal_id=signal, cost=n * k * elem + FIXED_COST_BYTES)
            return len(tiles)
        # split over K (split_k.py): E ranges' tiles of partials, then MV_REDUCE tiles that close the stage (QKV:
        # none, the attention sums the partials)
        parts = counter_id(layer, PARTS_STAGE[op])
        tiles = _tiles(rows, split_tile_rows(layout, op, e))
        for part in range(e):
            for t, (lo, n) in enumerate(tiles):
                add(opcode=op, layer=layer, a0=lo, a1=n, a2=t, a3=a3, wait_id=wait[0], wait_count=wait[1],
                    signal_id=parts, k_part=part, k_parts=e,
                    cost=n * (k // e) * elem + n * B * 4 + FIXED_COST_BYTES)
        if op not in REDUCED_STAGES:
            return e * len(tiles)         # (the signals on the stage's *_PARTS counter)
        reduces = _tiles(rows, split_tile_rows(layout, op, 1))
        for lo, n in reduces:
            add(opcode=Opcode.MV_REDUCE, layer=layer, a0=lo, a1=n, a2=int(op), a3=e, wait_id=parts,
                wait_count=e * len(tiles), signal_id=signal, cost=e * n * B * 4 + FIXED_COST_BYTES)
        return len(reduces)

    folded = layout.embed_folded
    # folded: EMBED is one more producer of layer 0's QKV counter (x[0] is layer 0's residual); the layout folds
    # only up to SPLIT_BATCH, where one EMBED takes the whole batch
    embeds = embed_ranges(B)
    for lo, n in embeds:
        add(opcode=Opcode.EMBED, a0=lo, a1=n, signal_id=counter_id(0, Stage.QKV) if folded else embed_counter(L),
            cost=n * c.hidden_size * elem + FIXED_COST_BYTES)
    prev = (embed_counter(L), len(embeds))
    kv_bytes_per_split = 2 * c.head_dim * elem * max(1, layout.max_seq_len // S)
    groups = sequence_groups(layout)        # (first sequence, sequences) of the ATTN_PARTIALs of a kv head
    qkv_folded = qkv_reduce_folded(layout)  # ATTN_PARTIAL sums QKV's K-range partials
    for l in range(L):
        if folded and l == 0:
            # layer 0's QKV stages embed[token] itself: no wait; a3 = 1 marks the embedding input
            n = matvec_stage(Opcode.QKV, l, (NO_COUNTER, 0), counter_id(l, Stage.QKV), a3=1) + 1
        else:
            n = matvec_stage(Opcode.QKV, l, prev, counter_id(l, Stage.QKV))
        qkv_done = counter_id(l, PARTS_STAGE[Opcode.QKV] if qkv_folded else Stage.QKV)
        for b, seqs in groups:
            for kvh in range(c.num_kv_heads):
                for s in range(S):
                    add(opcode=Opcode.ATTN_PARTIAL, layer=l, a0=b, a1=kvh, a2=s, a3=S, seqs=seqs,
                        wait_id=qkv_done, wait_count=n,
                        signal_id=counter_id(l, Stage.ATTN_PARTIAL),
                        cost=seqs * (kv_bytes_per_split + FIXED_COST_BYTES))
        n_attn = len(groups) * c.num_kv_heads * S
        if layout.fused_reduce:
            # O_PROJ merges the splits while staging its input: one dependency hop less per layer
            n = matvec_stage(Opcode.O_PROJ, l, (counter_id(l, Stage.ATTN_PARTIAL), n_attn),
                             counter_id(l, Stage.O_PROJ), a3=S)
        else:
            for b in range(B):
                for kvh in range(c.num_kv_heads):
                    add(opcode=Opcode.ATTN_REDUCE, layer=l, a0=b, a1=kvh, a3=S,
                        wait_id=counter_id(l, Stage.ATTN_PARTIAL), wait_count=n_attn,
                        signal_id=counter_id(l, Stage.ATTN_REDUCE), cost=FIXED_COST_BYTES)
            n_red = B * c.num_kv_heads
            n = matvec_stage(Opcode.O_PROJ, l, (counter_id(l, Stage.ATTN_REDUCE), n_red),
                             counter_id(l, Stage.O_PROJ))
        n = matvec_stage(Opcode.GATE_UP, l, (counter_id(l, Stage.O_PROJ), n), counter_id(l, Stage.GATE_UP))
        n = matvec_stage(Opcode.DOWN, l, (counter_id(l, Stage.GATE_UP), n), counter_id(l, Stage.DOWN))
        prev = (counter_id(l, Stage.DOWN), n)
    if not lm_head:
        return StepProgram(layout=layout, instructions=tuple(out), num_counters=num_counters(L), lm_tiles=0)
    lm_tiles = matvec_stage(Opcode.LM_HEAD, 0, prev, lm_head_counter(L))
    add(opcode=Opcode.ARGMAX, a0=lm_tiles, wait_id=lm_head_counter(L), wait_count=lm_tiles,
        signal_id=argmax_counter(L), cost=FIXED_COST_BYTES)
    return StepProgram(layout=layout, instructions=tuple(out), num_counters=num_counters(L), lm_tiles=lm_tiles)


def producers(program: StepProgram) -> dict[int, list[int]]:
    """counter id -> indices of the instructions that signal it."""
    out: dict[int, list[int]] = {}
    for ins in program.instructions:
        if ins.signal_id != NO_COUNTER:
            out.setdefault(ins.signal_id, []).append(ins.index)
    return out


def dependency_closure(program: StepProgram) -> list[set[int]]:
    """For each instruction, every instruction that must have finished before it may start."""
    prod = producers(program)
    closure: list[set[int]] = []
    for ins in program.instructions:   # global order is topological, so predecessors are done
        deps: set[int] = set()
        if ins.wait_id != NO_COUNTER:
            for p in prod.get(ins.wait_id, []):
                deps.add(p)
                deps |= closure[p]
        closure.append(deps)
    return closure
