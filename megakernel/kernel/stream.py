"""The weight stream: a producer warp per CTA walks the CTA's own queue and bulk-copies the weight tiles
of its matvec instructions into a ring of shared-memory slots, as far ahead as the ring allows.

Weights never depend on activations, so the producer never waits on a step counter: while the consumer
warps wait for the stage they read (a dependency hop, ~5 us), the ring fills with the next instructions'
weights, across instruction and layer boundaries, and HBM stays busy. It keeps max_in_flight slots on their
way, HOP_IN_FLIGHT while the consumers cross a hop (their stores, signal, wait and next input queue behind
fewer copies); either cap waits only for a copy to land, never on the consumers.

A slot is one bulk-copy unit: `rows` consecutive rows of a tile times one column slab of the matrix, in
the fragment order of the packed weights (megakernel.instructions.layout.fragment_pack): per 8-row block,
the slab's 512-byte blocks of 32 columns, row blocks `slab_cols * 16` bytes apart. Each slot has a `full`
mbarrier (the producer arms it with the slot's byte count, the copy engine completes it) and an `empty`
mbarrier (each of the `parts` consumer warps that read the slot arrives once it has read its part: part p of
ring slot r, in every use, is warp (r * parts + p) % readers's, the readers the most consumer warps that divide the
ring's parts: ring_model.ring_readers). Producer and consumers enumerate a tile's
slots in the same order, chunk by chunk (the rows whose partial sums fit shared memory at once), slab by
slab, row group by row group, so slot number k of the CTA is ring slot k % slots in use k // slots by
both sides.

`StreamPlan` is the host-side geometry (pure Python, tested on the CPU); `WeightStream` is the producer's
device code, a mixin of the interpreter (megakernel.kernel.interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64

from ..instructions.layout import (COL_PASS, M_TILE, SPLIT_BATCH, WGMMA_LBO, WGMMA_SBO, WIDE_KS_PAD,  # noqa: F401
                                   m_tiles, wide_ks_bytes, wide_x_byte)
from ..instructions.opcodes import Opcode
from ..instructions.record import W_A0, W_A1, W_K_PART, W_K_PARTS, W_LAYER, W_OPCODE, WORDS
from .ptx import (atomic_cas, bulk_copy_g2s, globaltimer_lo, load_shared_volatile, mbarrier_arrive_expect_tx,
                  mbarrier_try_wait, policy_evict_first, st_i32, store_relaxed)

SLOT_BYTES = 16 * 1024      # one slot: 16 KiB of weights (16 rows x 512 columns: 32 fragment blocks of 512 bytes)
MAX_SLOTS = 12              # ring depth cap: 192 KiB covers a ~6 us hop at the per-SM share of HBM
MIN_SLOTS = 4
PART_FLOATS = 4096          # partial dot products of one chunk kept in shared memory (more where one unit needs it,
                            # or where staging_budget gives more)
X_WHOLE_BYTES = 64 * 1024   # a matvec input (all sequences, bf16) staged whole up to this size, else as many
                            # slabs at a time as fit it

RELEASE_LANES = 32          # arrivals a reader warp makes on a slot's empty barrier: one by each lane, after its own
                            # reads of the slot (a lane-0 arrival behind __syncwarp, which ptxas drops in a
                            # converged warp, leaves the other lanes' reads unordered for compute-sanitizer)
ERR_RING = 4                # error code: a weight-ring wait timed out
# The int32 words of an instruction's trace record (trace mode), as MegakernelEngine.trace_records decodes them:
# index * 256 + opcode, a matvec's input staged, begin, counter ready, end, a matvec's last slot consumed, the
# producer's first and last slot issued, the first and last slot landed (as the warps reading their first parts saw
# them: past their waits); then three
# durations (ns) of a matvec's slots: the producer's waits for a free ring slot (the consumers behind) and for the
# slot the in-flight cap before to land (the copies' latency), and consumer warp 0's waits for its slots to land; last,
# when thread 0 was past a matvec's last epilogue (up to SPLIT_BATCH; the signal's barrier and release follow); in a
# CTA's first record, the physical SM (%smid) it ran on; then when the warp reading the last slot's first part
# reached its wait (before it passed it: TR_LANDED_LAST), which tells a slot that landed late from a reader that came
# late; last, a duration (ns): consumer thread 0's time in the matvec's input staging, every window of it summed
# (from the barrier before a window to the one after it is staged: up to SPLIT_BATCH the consumers' own staging,
# past it the wait for the window's bulk copy)
(TR_OP, TR_STAGED, TR_BEGIN, TR_READY, TR_END, TR_CONSUMED, TR_ISSUED_FIRST, TR_ISSUED_LAST, TR_LANDED_FIRST,
 TR_LANDED_LAST, TR_WAIT_FREE, TR_WAIT_IN_FLIGHT, TR_WAIT_LANDED, TR_EPILOGUE, TR_SM, TR_REACHED_LAST, TR_STAGING,
 TRACE_WORDS) = range(18)

OP_QKV, OP_O_PROJ, OP_DOWN, OP_LM_HEAD = int(Opcode.QKV), int(Opcode.O_PROJ), int(Opcode.DOWN), int(Opcode.LM_HEAD)
OP_ATTN_PARTIAL, OP_ATTN_REDUCE = int(Opcode.ATTN_PARTIAL), int(Opcode.ATTN_REDUCE)


OP_TP_O_PROJ, OP_TP_DOWN = int(Opcode.TP_O_PROJ), int(Opcode.TP_DOWN)
OP_TP_REDUCE, OP_TP_LM_HEAD = int(Opcode.TP_REDUCE), int(Opcode.TP_LM_HEAD)
# the peer table of a tensor-parallel rank (int64 [world_size, PEER_WORDS], rank order): each rank's receive
# buffers, argmax slots and counters, where the exchange stages store and signal
PEER_RECV_O, PEER_RECV_DOWN, PEER_LM_MAX, PEER_LM_IDX, PEER_COUNTERS, PEER_WORDS = range(6)


@cute.jit
def dense_opcode(op: Int32):
    """(the dense stage a record runs as, 1 if it is an exchange stage else 0): TP_O_PROJ, TP_DOWN and TP_LM_HEAD
    stream and multiply as O_PROJ, DOWN and LM_HEAD over the rank's shard; only their stores and signal differ."""
    xch = Int32(0)
    base = op
    if op == OP_TP_O_PROJ:
        base = Int32(OP_O_PROJ)
        xch = Int32(1)
    if op == OP_TP_DOWN:
        base = Int32(OP_DOWN)
        xch = Int32(1)
    if op == OP_TP_LM_HEAD:
        base = Int32(OP_LM_HEAD)
        xch = Int32(1)
    return base, xch


@cute.jit
def is_matvec(op: Int32) -> Boolean:
    """QKV, O_PROJ, GATE_UP, DOWN and LM_HEAD: the opcodes that stream a weight tile."""
    return op >= OP_QKV and op <= OP_LM_HEAD and op != OP_ATTN_PARTIAL and op != OP_ATTN_REDUCE


ITEM_ROWS = 16              # rows of a consumer work item: two 8-row fragment blocks (each its own MMAs)
SLAB_COLS = SLOT_BYTES // (ITEM_ROWS * 2)   # the widest slab: ITEM_ROWS rows of it fill a slot


WIDE_WARPS = 8              # consumer warps past SPLIT_BATCH: each owns wide_groups() row groups of a chunk
                            # (ITEM_ROWS rows x every sequence) across all of the tile's slabs, its accumulators in
                            # registers


def slot_parts(batch: int) -> int:
    """Work items across a slot's slab: part p of ring slot r is read by one consumer warp, which frees it, so a
    slot is freed after `parts` arrivals instead of one per warp. Whole slots (one item of up to 512 columns) at
    batch 2-8, where the consumers' instructions per weight byte bound the step; halves at batch 1, where the
    critical path also waits on each small tile's last slot (llama-3.2-1b, one sweep: halves 0.882 ms/step,
    whole slots 0.891, quarters 0.959; profiles/RESULTS.md, 2026-12-03)."""
    return 2 if batch == 1 else 1


def wide_groups(batch: int, widest_tile: int) -> int:
    """Row groups each consumer warp owns per chunk past SPLIT_BATCH. A tile whose input is staged in windows
    stages it once per chunk, so two groups (chunks of 256 rows) halve that staging for twice the accumulators:
    always up to batch 32 (32 registers a warp); at 33-64 (64 registers) only where a layer's tiles (widest_tile
    rows per SM) outgrow a chunk of one group per warp (on the mma.sync loop: llama-3.1-8b, 435-row tiles, at 64:
    10.81 ms per step against 13.15; llama-3.2-1b, 125-row tiles: 2.81 against 2.66; on wgmma, llama-3.2-1b at 64:
    2.48 against 2.26; profiles/RESULTS.md, 2026-12-03, sixth and seventh sessions)."""
    return 2 if m_tiles(batch) <= 2 or widest_tile > WIDE_WARPS * ITEM_ROWS else 1


def wide(batch: int) -> bool:
    """Past SPLIT_BATCH the consumers own row groups (wide_groups per warp in a chunk) and accumulate across a
    tile's slabs in registers: partial sums per (row, slab, part, sequence) in shared memory would leave chunks
    of a few rows, each staging the input again."""
    return batch > SPLIT_BATCH


# A layer's weight bytes per SM past which their read, not the dependency chain, bounds a step at batch 1-4
# (llama-3.1-8b 3.2 MiB, llama-2-7b 2.9; llama-3.2-1b 0.9, qwen3-0.6b 0.2)
STREAM_BOUND_BYTES = 2 << 20


def max_in_flight(batch: int, layer_bytes_per_sm: int) -> int:
    """Weight slots a producer keeps issued and not yet landed. Two hold an SM's share of the read bandwidth on
    their way; more only lengthen the memory queue that every load and signal of the dependency chain waits in.
    Three where the stream bounds the step: a layer's weights past STREAM_BOUND_BYTES per SM, up to SPLIT_BATCH
    (not wide). Batch 5-8 joined when 15 consumer warps read there (before, 8 warps paced the ring themselves and 3
    lost at batch 8): llama-3.1-8b 5.926 / 5.803 at 8, 5.774 / 5.735 at 5, the same logits bit for bit (H100,
    profiles/RESULTS.md, 2026-12-06, thirty-first session). One H100 sweep of 2 against 3
    (ms/step; profiles/RESULTS.md, 2026-12-05, twenty-fourth session): qwen3-0.6b 0.764 / 0.805 at batch 1,
    0.863 / 0.909 at 4, 1.051 / 1.083 at 8; llama-3.2-1b 0.945 / 0.988 at 1, 1.140 / 1.192 at 8; llama-3.1-8b
    5.293 / 5.204 at 1, 5.640 / 5.513 at 2, 5.875 / 5.753 at 4, 5.895 / 5.991 at 8; llama-2-7b 4.704 / 4.650 at
    1. One slot was level with two on qwen3-0.6b and lost on the others (llama-3.2-1b 1.068 at batch 1, 1.233 at
    8); four and six never won. Fitted on the H100 and checked on the H200 (a third more bandwidth; 2026-12-05,
    twenty-fifth session, 2 / 3 / 4): qwen3-0.6b 0.723 / 0.731 / 0.735 at batch 1; llama-3.2-1b 0.828 / 0.819 /
    0.836 at 1, 0.987 / 0.998 / 1.005 at 8; llama-3.1-8b 4.052 / 3.900 / 3.931 at 1."""
    return 3 if not wide(batch) and layer_bytes_per_sm >= STREAM_BOUND_BYTES else 2


HOP_IN_FLIGHT = 1           # weight slots on their way per SM while the consumers cross a hop: from every warp past
                            # a tile's last slot (its epilogue's stores, the signal's release, the wait for the next
                            # stage's counter) until the next matvec's input (its first window) is staged, the
                            # chain's stores and loads queue behind fewer copies; max_in_flight again past it. H100
                            # sweeps against max_in_flight throughout, the same logits bit for bit (ms/step;
                            # profiles/RESULTS.md): up to SPLIT_BATCH (2026-12-05, twenty-seventh session)
                            # qwen3-0.6b 0.672 / 0.727 at batch 1 (one slot throughout 0.692), 0.945 / 0.991 at 8;
                            # llama-3.2-1b 0.932 / 0.963 at 1, 1.128 / 1.165 at 8; llama-3.1-8b 5.168 / 5.332 at 1.
                            # The signal's barrier + release fell from 1.1-1.8 to 0.8-0.9 us a hop (0.54 with no
                            # copies at all). Past it (2026-12-06, twenty-ninth session): llama-3.2-1b 1.270 /
                            # 1.317 at 16, 1.477 / 1.510 at 32, 1.682 / 1.728 at 64; qwen3-0.6b 1.410 / 1.454 at
                            # 32; llama-3.1-8b 7.107 / 7.203 at 32. Two slots instead of one lost (llama-3.1-8b
                            # 5.265 / 5.189 at 1, 5.698 / 5.613 at 4; llama-2-7b 4.541 / 4.527 at 1).
HOP_WORD = 5                # the word of the CTA's control block (s_ctrl) that is 1 while the consumers cross a hop


def mark_hop(s, crossing: int):
    """The consumers' thread 0 tells the producer where the chain is (s_ctrl[HOP_WORD]): 1 once every warp is past
    a tile's last slot, 0 once the next matvec's input (its first window) is staged. The word is written and read
    (read_hop) by shared-memory atomics: no barrier orders the two warps' accesses (either value is a right cap for
    the slot the producer is about to issue), and compute-sanitizer's racecheck reports a plain store and load of
    it as a hazard."""
    cute.arch.atomic_exch(s.ctrl.iterator + HOP_WORD, Int32(crossing), sem="relaxed", scope="cta")


@cute.jit
def read_hop(lane: Int32, ctrl_addr: Int32) -> Int32:
    """The producer warp's read of s_ctrl[HOP_WORD] (mark_hop) at shared address ctrl_addr: lane 0's atomic,
    broadcast to the warp."""
    hop = Int32(0)
    if lane == 0:
        hop = cute.arch.atomic_or(cute.make_ptr(Int32, ctrl_addr + 4 * HOP_WORD, cute.AddressSpace.smem), Int32(0),
                                  sem="relaxed", scope="cta")
    return cute.arch.shuffle_sync(hop, 0)

X_PAD = 8                   # words after each sequence's staged input row up to SPLIT_BATCH: with rows of a whole
                            # number of 128-byte lines plus 32 bytes, the 8-byte B loads of the four sequences of a
                            # half-warp fall in different banks (conflict-free)
def x_col_bytes(batch: int) -> int:
    """Shared-memory bytes of one staged input column, all sequences: bf16 per sequence up to SPLIT_BATCH; past it
    bf16 per sequence of the padded m-tiles (wide_x_byte; each 16-column k-step's block is WIDE_KS_PAD bytes more,
    which only the buffer's size counts)."""
    return m_tiles(batch) * M_TILE * 2 if wide(batch) else batch * 2


@dataclass(frozen=True)
class SlotGeometry:
    """How the tiles of a matrix with K columns are cut into slots, chunks and work items."""

    k: int
    slab_cols: int       # columns of a slot row, a multiple of COL_PASS (the last slab: what is left of K)
    n_slab: int
    rows_per_slot: int   # a multiple of ITEM_ROWS; the last slot of a tile may hold fewer (a multiple of 8)
    parts: int           # work items across a slab row (slot_parts), slab_cols / parts columns each
    chunk_rows: int      # rows whose partials share memory at once: a multiple of rows_per_slot
    x_slabs: int         # slabs of the input staged at a time (n_slab: the whole input, once per instruction)

    @property
    def n_seg(self) -> int:
        """Partial sums per (row, sequence), one per (slab, part): the epilogue adds them in this fixed order."""
        return self.n_slab * self.parts

    def slab_width(self, sl: int) -> int:
        """Columns of slab sl."""
        return min(self.slab_cols, self.k - sl * self.slab_cols)

    @property
    def x_whole(self) -> bool:
        """Whether the input's K columns are staged once per instruction (else x_slabs slabs at a time,
        once per chunk)."""
        return self.x_slabs >= self.n_slab

    @property
    def x_cols(self) -> int:
        """Columns of one sequence's input row staged at a time."""
        return min(self.k, self.x_slabs * self.slab_cols)

    @property
    def x_stride(self) -> int:
        """32-bit words from one sequence's staged input row to the next's (two bf16 columns a word)."""
        return self.x_cols // 2 + X_PAD

    def chunk_slots(self, rows: int) -> list[int]:
        """Slots of each chunk of a tile of `rows` rows, in the order producer and consumers take them."""
        return [self.n_slab * -(-min(self.chunk_rows, rows - c0) // self.rows_per_slot)
                for c0 in range(0, rows, self.chunk_rows)]

    def slots(self, rows: int) -> int:
        """Slots of a tile of `rows` rows."""
        return sum(self.chunk_slots(rows))


def staging_budget(hidden: int, batch: int) -> tuple[int, int]:
    """(partial floats, staged-input bytes) of the shared memory up to SPLIT_BATCH: PART_FLOATS and X_WHOLE_BYTES,
    unless even the hidden-size inputs (QKV, GATE_UP, the LM head) are too wide to stage whole. Those are staged in
    windows once per chunk of rows, and a chunk holds PART_FLOATS / (slabs x batch) rows: llama-3.1-8b at batch 8
    staged the LM head's input 16 times a tile, GATE_UP's 4 and DOWN's 2. There four times the partials (and
    windows of half the columns) leave one chunk a tile but the LM head's 4: 74.0% of the floor against 64.6%. The
    same budget everywhere lost: llama-3.2-1b at 8 51.4% against 53.4%, qwen3-0.6b at 8 26.2 against 27.9,
    llama-3.1-8b at 1 87.0 against 90.5 (one ring slot less, and inputs that fit whole staged in windows;
    profiles/RESULTS.md, 2026-12-04, fourteenth session). Those inputs were float32 (as bf16 hi + lo); in bf16
    the hidden-size inputs of the suite's shapes fit whole at every batch up to 8, and the rule is for wider
    models (hidden over 4096 at batch 5-8)."""
    if not wide(batch) and x_col_bytes(batch) * hidden > X_WHOLE_BYTES:
        return 4 * PART_FLOATS, X_WHOLE_BYTES // 2
    return PART_FLOATS, X_WHOLE_BYTES


def slot_geometry(k: int, batch: int, parts: int | None = None, groups: int = 1,
                  budget: tuple[int, int] = (PART_FLOATS, X_WHOLE_BYTES)) -> SlotGeometry:
    """The slot geometry of a K-column matrix at a batch size: the fewest slabs whose ITEM_ROWS rows fit a
    slot, slots as many rows as fit, `parts` work items across a slab (slot_parts(batch) unless given),
    chunks as many rows as the budget's partials allow (past SPLIT_BATCH, `groups` row groups per consumer warp),
    the input staged whole where it fits the budget's bytes (staging_budget)."""
    part_floats, x_bytes = budget
    if k % COL_PASS:
        raise ValueError(f"K={k} must be a multiple of {COL_PASS}")
    ppr = k // COL_PASS
    # the fewest slabs whose item rows fit a slot; equal widths but the last, which may be narrower (any
    # K, an odd or prime K / 256 too, gets slabs as wide as a slot allows)
    per_slab = -(-ppr // max(1, -(-k * 2 * ITEM_ROWS // SLOT_BYTES)))
    while per_slab * COL_PASS * 2 * ITEM_ROWS > SLOT_BYTES:
        per_slab -= 1
    slab = per_slab * COL_PASS
    n_slab = -(-ppr // per_slab)
    rows_per_slot = ITEM_ROWS * max(1, SLOT_BYTES // (slab * 2 * ITEM_ROWS))
    parts = parts or slot_parts(batch)
    if slab % (32 * parts):
        raise ValueError(f"a slab of {slab} columns cannot be cut into {parts} work items of whole 32-column blocks")
    # (at least one slot of rows: the partial buffer grows past the budget's floats where one needs more)
    chunk = max(rows_per_slot, part_floats // (n_slab * parts * batch) // rows_per_slot * rows_per_slot)
    if wide(batch):
        # a slot is one row group of one slab, read by the warp that owns the row group in the chunk
        rows_per_slot, parts, chunk = ITEM_ROWS, 1, WIDE_WARPS * ITEM_ROWS * groups
    xb = x_col_bytes(batch)
    return SlotGeometry(k=k, slab_cols=slab, n_slab=n_slab, rows_per_slot=rows_per_slot, parts=parts,
                        chunk_rows=chunk, x_slabs=n_slab if xb * k <= x_bytes else max(1, x_bytes // (xb * slab)))


@dataclass(frozen=True)
class StreamPlan:
    """The slot geometry of each matrix width of a model at one batch size (K = hidden, q or
    intermediate size), and the ring's depth once the rest of shared memory is known."""

    batch: int
    by_k: dict

    @classmethod
    def for_config(cls, config, batch: int, split_widths: tuple[int, ...] = (),
                   groups: int = 1) -> "StreamPlan":
        """split_widths: the K ranges' widths of the stages split over K (split_k.k_splits), beside the whole
        widths."""
        ks = sorted({config.hidden_size, config.q_size, config.intermediate_size, *split_widths})
        budget = staging_budget(config.hidden_size, batch)
        return cls(batch=batch, by_k={k: slot_geometry(k, batch, groups=groups, budget=budget) for k in ks})

    @property
    def parts(self) -> int:
        """Work items per slot row (every width of a plan has the same)."""
        return next(iter(self.by_k.values())).parts

    def geometry(self, k: int) -> SlotGeometry:
        return self.by_k[k]

    @property
    def part_floats(self) -> int:
        """Floats of the partial-sum buffer: the largest chunk's (rows x segments x sequences); none past
        SPLIT_BATCH, where each warp's accumulators go from its registers to their outputs."""
        if wide(self.batch):
            return 4
        return max(g.chunk_rows * g.n_seg * self.batch for g in self.by_k.values())

    @property
    def x_floats(self) -> int:
        """32-bit words of the staged-input buffer: the widest staged row, all sequences (past SPLIT_BATCH in
        bf16, the m-tiles padded to M_TILE sequences, a block per k-step: wide_x_byte)."""
        if wide(self.batch):
            return max(g.x_cols for g in self.by_k.values()) // 16 * wide_ks_bytes(self.batch) // 4
        return self.batch * max(g.x_stride for g in self.by_k.values())

    @staticmethod
    def ring_slots(free_bytes: int) -> int:
        """Slots (with their full and empty mbarriers) that fit in `free_bytes` of shared memory, up to
        MAX_SLOTS; ValueError under MIN_SLOTS."""
        n = min(MAX_SLOTS, free_bytes // (SLOT_BYTES + 16))
        if n < MIN_SLOTS:
            raise ValueError(f"only {free_bytes} bytes of shared memory are left for the weight ring; it needs "
                             f"at least {MIN_SLOTS} slots of {SLOT_BYTES} (use fewer kv_splits or a smaller batch)")
        return n


class WeightStream:
    """Device code of the producer warp (a mixin: `self` is the interpreter, which holds the plan and the
    weight-tile geometry)."""

    @cute.jit
    def trace_record(self, trace: Int64, sm: Int32, i: Int32) -> Int64:
        """Address of instruction i's trace record of CTA sm (trace mode; TRACE_WORDS words)."""
        return trace + (Int64(sm) * self.max_queue_len + Int64(i)) * (TRACE_WORDS * 4)

    @cute.jit
    def tile_geometry(self, op: Int32, split: Boolean):
        """(K, slab_cols, n_slab, rows_per_slot, chunk_rows, x_slabs) of a matvec opcode as runtime values:
        O_PROJ's K is q_size, DOWN's the intermediate size, the others' the hidden size; where `split`, K is
        the width of the stage's K ranges (self.split_widths)."""
        g = self.plan.geometry(self.H)
        k, slab, n_slab, rps = Int32(g.k), Int32(g.slab_cols), Int32(g.n_slab), Int32(g.rows_per_slot)
        chunk, xsl = Int32(g.chunk_rows), Int32(g.x_slabs)
        cases = [(OP_O_PROJ, False, self.Q), (OP_DOWN, False, self.F)]
        cases += [(code, True, width) for code, width in self.split_widths.items()]
        for code, when_split, width in cases:
            gc = self.plan.geometry(width)
            if op == code and (not when_split or split):
                k, slab, n_slab, rps = Int32(gc.k), Int32(gc.slab_cols), Int32(gc.n_slab), Int32(gc.rows_per_slot)
                chunk, xsl = Int32(gc.chunk_rows), Int32(gc.x_slabs)
        return k, slab, n_slab, rps, chunk, xsl

    @cute.jit
    def produce(self, lane: Int32, sm: Int32, s_queue: cute.Tensor, n: Int32, ring: Int32, full: Int32,
                empty: Int32, abort_addr: Int32, w_qkv: Int64, w_o: Int64, w_gate_up: Int64, w_down: Int64,
                w_lm_head: Int64, error: Int64, trace: Int64):
        """The producer warp's whole life: every matvec tile of the queue, slot by slot, each into the next
        ring slot once the consumer warps that read its last use have left it and the slot self.in_flight
        (HOP_IN_FLIGHT while the consumers cross a hop: s_ctrl[HOP_WORD]) before it has landed; then wait until
        every copy issued has landed (a CTA must not exit with a bulk copy in flight). Stops issuing when the
        consumers abort (abort_addr) or a slot stays occupied past the timeout (error word ERR_RING). The slot loops
        are the consumers' (chunk, slab, row group), stepped by additions: the producer is on the critical path
        whenever the ring has just been freed, and a slot index decoded by divisions measured 7% slower
        (profiles/RESULTS.md)."""
        NS = self.ring_slots
        k = Int32(0)
        stop = Int32(0)
        # weights are read once per step: evict_first keeps them from displacing the activations, counters and
        # KV cache in L2 (1-3% faster on every shape and batch measured, profiles/RESULTS.md 2026-12-02)
        policy = policy_evict_first()
        t_free = Int32(0)         # (trace mode) this instruction's waits for a free slot and on the in-flight cap, ns
        t_cap = Int32(0)
        for i in range(n):
            ins = i * WORDS
            op = s_queue[ins + W_OPCODE]
            if cutlass.const_expr(self.W > 1):
                op, _ = dense_opcode(op)
            if stop == 0:
                stop = cute.arch.shuffle_sync(load_shared_volatile(abort_addr), 0)
            if is_matvec(op) and stop == 0:
                if cutlass.const_expr(self.options.trace):
                    t_free = Int32(0)
                    t_cap = Int32(0)
                    if lane == 0:
                        st_i32(self.trace_record(trace, sm, i) + TR_ISSUED_FIRST * 4, globaltimer_lo())
                w_addr, k_row = self.weight_tile(op, s_queue[ins + W_LAYER], s_queue[ins + W_A0], w_qkv, w_o,
                                                 w_gate_up, w_down, w_lm_head)
                split = s_queue[ins + W_K_PARTS] > 1
                K, slab, n_slab, rps, chunk, _ = self.tile_geometry(op, split)
                k0 = s_queue[ins + W_K_PART] * K         # the tile's first column (a K range's, where split)
                a1 = s_queue[ins + W_A1]
                for c0 in range(0, a1, chunk):
                    crows = a1 - c0
                    if crows > chunk:
                        crows = chunk
                    for sl in range(n_slab):
                        for g0 in range(0, crows, rps):
                            nr = crows - g0
                            if nr > rps:
                                nr = rps
                            slot = k % NS
                            if stop == 0:
                                if cutlass.const_expr(self.options.trace):
                                    t0 = globaltimer_lo()
                                stop = self.wait_slot(empty + slot * 8, ((k // NS) % 2) ^ 1, abort_addr, error)
                                if cutlass.const_expr(self.options.trace):
                                    t_free = t_free + (globaltimer_lo() - t0)
                            cap = Int32(self.in_flight)
                            # HOP_IN_FLIGHT while the consumers store, signal, wait and stage (s_ctrl[HOP_WORD];
                            # abort_addr is s_ctrl[1]'s)
                            if read_hop(lane, abort_addr - 4) != 0:
                                cap = Int32(HOP_IN_FLIGHT)
                            kf = k - cap                     # at most that many slots on their way at once
                            if stop == 0 and kf >= 0:
                                if cutlass.const_expr(self.options.trace):
                                    t1 = globaltimer_lo()
                                self.wait_full(full + (kf % NS) * 8, (kf // NS) % 2, error)
                                if cutlass.const_expr(self.options.trace):
                                    t_cap = t_cap + (globaltimer_lo() - t1)
                            if stop == 0 and lane == 0:     # (stop is the same on every lane)
                                dst = ring + slot * SLOT_BYTES
                                width = K - sl * slab              # the last slab may be narrower
                                if width > slab:
                                    width = slab
                                nbytes = nr * width * 2
                                if cutlass.const_expr(self.options.diag_no_copy):
                                    nbytes = Int32(0)
                                mbarrier_arrive_expect_tx(full + slot * 8, nbytes)
                                row0 = Int64(c0 + g0)
                                if cutlass.const_expr(not self.options.diag_no_copy):
                                    if n_slab == 1 and not split:
                                        bulk_copy_g2s(dst, w_addr + row0 * Int64(K) * 2, nbytes, full + slot * 8, policy)
                                    else:
                                        # one copy per 8-row block (its slab's 512-byte blocks are contiguous),
                                        # landed slab_cols * 16 bytes apart; rows are k_row columns long
                                        for rb in range(nr // 8):
                                            bulk_copy_g2s(dst + rb * slab * 16,
                                                          w_addr + ((row0 + rb * 8) * Int64(k_row)
                                                                    + Int64(k0 + sl * slab) * 8) * 2,
                                                          width * 16, full + slot * 8, policy)
                            if stop == 0:
                                k = k + 1
                if cutlass.const_expr(self.options.trace):
                    if lane == 0:
                        rec = self.trace_record(trace, sm, i)
                        st_i32(rec + TR_ISSUED_LAST * 4, globaltimer_lo())
                        st_i32(rec + TR_WAIT_FREE * 4, t_free)
                        st_i32(rec + TR_WAIT_IN_FLIGHT * 4, t_cap)
        # the last use of every ring slot has landed (consumed ones long ago; after an abort, in flight)
        for j in range(NS):
            if j < k:
                last = (k - 1 - j) // NS * NS + j          # the latest slot number using ring slot j
                self.wait_full(full + j * 8, (last // NS) % 2, error)

    @cute.jit
    def wait_slot(self, mbar: Int32, parity: Int32, abort_addr: Int32, error: Int64) -> Int32:
        """Spin until the mbarrier's phase of `parity` completes; 1 if the CTA aborted meanwhile or the wait
        ran past twice the timeout (then ERR_RING goes to the error word and the abort flag is raised), else 0.
        (Twice: consumers that wait on a step counter hold their slots, and their own bounded wait, which
        names the counter, is the error to report; it raises the abort flag that ends this wait.)"""
        done = mbarrier_try_wait(mbar, parity)
        stop = Int32(0)
        t0 = cute.arch.globaltimer()
        while done == 0 and stop == 0:
            done = mbarrier_try_wait(mbar, parity)
            if done == 0:
                stop = load_shared_volatile(abort_addr)
                if cute.arch.globaltimer() - t0 > 2 * self.options.timeout_ns:
                    stop = Int32(1)
                    if cute.arch.lane_idx() == 0:
                        if atomic_cas(error, Int32(0), Int32(ERR_RING)) == 0:
                            store_relaxed(error + 12, parity)
        return cute.arch.shuffle_sync(stop, 0)          # one verdict for the warp: lane 0's

    @cute.jit
    def wait_full(self, mbar: Int32, parity: Int32, error: Int64):
        """A warp's wait for a slot's weights to land (a consumer's before it reads the slot, the producer's
        before the CTA exits), bounded like every wait: past the timeout it writes ERR_RING and goes on; the
        step's outputs are then invalid and the host raises."""
        done = mbarrier_try_wait(mbar, parity)
        ok = Boolean(True)
        t0 = cute.arch.globaltimer()
        while done == 0 and ok:
            done = mbarrier_try_wait(mbar, parity)
            if cute.arch.globaltimer() - t0 > self.options.timeout_ns:
                ok = Boolean(False)
        if not ok:
            if cute.arch.lane_idx() == 0:
                if atomic_cas(error, Int32(0), Int32(ERR_RING)) == 0:
                    store_relaxed(error + 12, parity)
