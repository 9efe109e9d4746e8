"""The persistent decode megakernel: one CTA per SM interprets its queue of fused-stage instructions.

Device layout of a CTA: 16 warps where the matvec input is staged in shared memory, else 8. Each
instruction:
  1. a matvec's warps issue the 16-byte weight loads of their first work unit before the wait below
     (weights never depend on activations), and ATTN_PARTIAL's warps copy their first cached token's
     K/V into shared memory (attn_preload);
  2. thread 0 spins (ld.acquire.gpu, bounded by globaltimer) until the counter it waits on reaches
     epoch-relative target; a timeout writes the error word and aborts the CTA's queue;
  3. the stage body runs (opcode dispatch by `if`; every body is inlined once);
  4. after a CTA barrier, thread 0 signals its stage counter with red.release.gpu.
(Opt-in, `KernelOptions.prefetch`: thread 0 also asks the copy engine to prefetch the next
instruction's weight tile into L2. Measured slower on the H200 once tiles were streamed by all 16 warps:
the prefetches compete with the current tile for HBM and evict each other in L2.)
The last CTA to finish advances the epoch, so counters are never reset and a CUDA graph can replay
steps with no host work.

Every buffer is addressed through a raw Int64 address passed as a kernel argument; strides are
compile-time constants of the StepLayout. Matvec tiles are cut into work units (rows_per_unit rows
over `unroll` 256-column passes) spread over all warps; lane l reads 16 bytes of each row per pass, so
every weight load is a coalesced 512-byte warp request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from ..instructions.layout import (COL_PASS, ROW_GROUP, SLAB_STAGE_BYTES, SMEM_LIMIT, X_STAGE_BYTES,
                                   StepLayout)
from ..instructions.opcodes import Opcode
from ..instructions.record import (W_A0, W_A1, W_A2, W_A3, W_INDEX, W_LAYER, W_OPCODE, W_SIGNAL_ID,
                                   W_WAIT_COUNT, W_WAIT_ID, WORDS)
from .ptx import (atomic_add_acq_rel, atomic_add_relaxed, atomic_cas, cp_async_shared, cp_async_wait_all,
                  load_shared_b32, bulk_copy_g2s, fence_proxy_async_shared, load_acquire,
                  load_f32x4, load_shared_raw, load_weights_bf16x8, load_weights_raw, mbarrier_arrive_expect_tx,
                  mbarrier_init, mbarrier_init_fence, mbarrier_try_wait, prefetch_l2, red_release_add,
                  store_relaxed, unpack_bf16x2, unpack_bf16x8, warp_max_index, warp_sum)

THREADS = 256
WARPS = THREADS // 32
CHUNK_ROWS = 128           # matvec rows whose partials share memory at once (fewer where K needs many segments)
PART_SLOTS_MAX = 8192      # partials (float32) one chunk may keep in shared memory
X_UNROLL = 4               # input quads each thread loads per round when staging it
MAX_PASS_UNROLL = 8        # 256-column passes per loop iteration: up to 8 x 16 B loads in flight per row
LOG2E = 1.4426950408889634

# Error codes written to error[0] (the first error wins).
ERR_TIMEOUT = 1
ERR_POSITION = 2
ERR_TOKEN = 3

OP_EMBED, OP_QKV, OP_ATTN_PARTIAL, OP_ATTN_REDUCE = int(Opcode.EMBED), int(Opcode.QKV), int(Opcode.ATTN_PARTIAL), int(Opcode.ATTN_REDUCE)
OP_O_PROJ, OP_GATE_UP, OP_DOWN, OP_LM_HEAD, OP_ARGMAX = int(Opcode.O_PROJ), int(Opcode.GATE_UP), int(Opcode.DOWN), int(Opcode.LM_HEAD), int(Opcode.ARGMAX)

# Kernel arguments, in order: every one a global address (Int64).
ARG_NAMES = (
    "queue", "lengths",
    "w_embed", "w_qkv", "w_o", "w_gate_up", "w_down", "w_lm_head",
    "attn_norm", "mlp_norm", "final_norm", "ones", "q_norm", "k_norm", "rope_cos", "rope_sin",
    "tokens", "positions", "block_table",
    "x", "h", "qkv", "attn_part_o", "attn_part_lse", "attn_out", "act",
    "logits", "lm_max", "lm_idx", "out_tokens",
    "counters", "sync", "error", "kv_table", "trace",
)


@dataclass(frozen=True)
class KernelOptions:
    trace: bool = False                      # record per-instruction globaltimer stamps
    timeout_ns: int = 2_000_000_000          # bounded spin on a counter
    prefetch_bytes: int = 256 * 1024         # cap on the L2 prefetch of the next weight tile
    prefetch: bool = False                   # L2 bulk prefetch of upcoming tiles (slower on the H200, see above)
    warps: int = 0                           # warps per CTA, a multiple of 8 (0: 16 when the matvec input
                                             # fits in shared memory, else 8, so each thread gets 255 registers)
    x_in_smem: bool = True                   # stage normalized matvec inputs in shared memory where they fit
    rows_per_unit: int = 0                   # rows of a work unit sharing its input columns (0: 2 where the
                                             # input is staged, else 1 per 8 loads)
    prefetch_ahead: int = 1                  # L2-prefetch the weight tile of the instruction this many ahead
    attn_preload: bool = True                # ATTN_PARTIAL loads its first cached token's K/V before its wait
                                             # (by cp.async into shared memory; not on the slab path)
    unroll: int = 0                          # 256-column passes per work unit (0: by batch, within the
                                             # registers: 8 at batch 1 or 8 warps, 4 up to batch 4, else 2)
    preload: int = 1                         # work items per warp whose weight loads are issued before the
                                             # matvec's wait (0: none; at most the items of one step)
    parallel_argmax: bool = True             # ARGMAX reduces the LM head tiles with every thread, not one per sequence
                                             # (at batch 1-2; above, one thread per sequence)
    smem_prefix: int = 0                     # bytes per buffer (two buffers) of the next matvec tile's first
                                             # rows, bulk-copied into shared memory one instruction ahead
                                             # (0: off; shrunk to the shared memory left; replaces preload)
    early_loads: bool = True                 # O_PROJ / DOWN load their residual right after the wait, and the
                                             # attention merge loads every split's partial with its lse: one
                                             # round trip less on each (False: the loads where they are used)
    hop_prefetch: int = 0                    # bytes of the next instruction's weight tile that thread 0 asks
                                             # the copy engine to bring into L2 at an instruction whose wait
                                             # spans the attention hop (ATTN_PARTIAL, O_PROJ), while HBM is
                                             # otherwise idle (0: off)


@cute.jit
def ld_i32(addr: Int64) -> Int32:
    return cute.arch.inline_ptx("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def ld_i64(addr: Int64) -> Int64:
    return cute.arch.inline_ptx("ld.global.b64 {$w0}, [{$r0}];", write_only_types=[Int64], read_only_args=[addr])


@cute.jit
def ld_f32(addr: Int64) -> Float32:
    return cute.arch.inline_ptx("ld.global.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[addr])


@cute.jit
def ld_bf16(addr: Int64) -> Float32:
    return cute.arch.inline_ptx("{ .reg .b16 t; ld.global.nc.b16 t, [{$r0}]; cvt.f32.bf16 {$w0}, t; }",
                                write_only_types=[Float32], read_only_args=[addr])


@cute.jit
def st_f32(addr: Int64, v: Float32):
    cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def st_i32(addr: Int64, v: Int32):
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def st_bf16(addr: Int64, v: Float32):
    cute.arch.inline_ptx("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r1}; st.global.b16 [{$r0}], t; }",
                         read_only_args=[addr, v])


@cute.jit
def round_bf16(v: Float32) -> Float32:
    return cute.arch.inline_ptx("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r0}; cvt.f32.bf16 {$w0}, t; }",
                                write_only_types=[Float32], read_only_args=[v])


@cute.jit
def ex2(v: Float32) -> Float32:
    return cute.arch.inline_ptx("ex2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def lg2(v: Float32) -> Float32:
    return cute.arch.inline_ptx("lg2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def rsqrt(v: Float32) -> Float32:
    return cute.arch.inline_ptx("rsqrt.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def ld_shared_f32x4(addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Float32] * 4, read_only_args=[addr])


@cute.jit
def load_weights_bf16x4(addr: Int64):
    """4 bf16 at an 8-byte aligned address (read-only path) -> 4 float32."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t0, t1;\n"
        "ld.global.nc.v2.b32 {t0, t1}, [{$r0}];\n"
        "shl.b32 {$w0}, t0, 16; and.b32 {$w1}, t0, 0xffff0000;\n"
        "shl.b32 {$w2}, t1, 16; and.b32 {$w3}, t1, 0xffff0000; }",
        write_only_types=[Float32] * 4, read_only_args=[addr])


@cute.jit
def globaltimer_lo() -> Int32:
    return Int32(cute.arch.globaltimer() & Int64(0x7FFFFFFF))


class DecodeKernel:
    """Compiled once per (StepLayout, options): model shape, batch bucket, KV splits and cache
    geometry are compile-time constants; every address is a runtime argument."""

    def __init__(self, layout: StepLayout, lm_tiles: int, num_counters: int, max_queue_len: int,
                 kv_strides: tuple[int, int, int] | None = None, options: KernelOptions = KernelOptions()):
        layout.validate()
        c = layout.config
        self.layout, self.options = layout, options
        self.num_sms = layout.num_sms
        self.max_queue_len = max_queue_len
        self.L, self.B, self.H = c.num_layers, layout.batch, c.hidden_size
        self.F, self.V = c.intermediate_size, c.vocab_size
        self.Hq, self.Hkv, self.D, self.G = c.num_heads, c.num_kv_heads, c.head_dim, c.gqa_group
        self.Q, self.KV, self.QKV = c.q_size, c.kv_size, c.qkv_rows
        self.S = layout.kv_splits
        self.bs, self.max_blocks = layout.block_size, layout.max_blocks_per_seq
        # element strides of (block, offset, kv head) in a layer's K or V cache; contiguous
        # [num_blocks, block_size, Hkv, D] by default, vLLM's interleaved K|V layout when bound to it
        self.kv_sb, self.kv_st, self.kv_sh = kv_strides or (self.bs * self.Hkv * self.D, self.Hkv * self.D, self.D)
        self.max_seq_len = layout.max_seq_len
        self.T = lm_tiles
        self.lm_pool = layout.lm_pool
        self.num_counters = num_counters
        self.eps = float(c.rms_norm_eps)
        self.qk_norm = bool(c.qk_norm)
        self.E = self.D // 32                     # head elements per lane
        self.scale_log2 = LOG2E / math.sqrt(self.D)
        self.k_max = max(self.H, self.Q, self.F)
        self.x_smem = options.x_in_smem and layout.stages_input
        # 256-column passes per work unit (loads in flight per row): 8, or fewer where 16 warps (128
        # registers each) hold the accumulators and inputs of several sequences (and the slab loop)
        passes = [k // COL_PASS for k in (self.H, self.Q, self.F)]
        wide = self.x_smem and layout.input_bytes > X_STAGE_BYTES      # staged in slabs (below)
        cap = options.unroll or (MAX_PASS_UNROLL if self.B == 1 or not self.x_smem
                                 else 4 if self.B <= 4 and not wide else 2)
        self.unroll = next(u for u in (8, 4, 2, 1) if u <= cap and all(p % u == 0 for p in passes))
        # Where a batch's widest input row does not fit the staging buffer (slab_staging layouts), each
        # matvec stages and streams its K columns in slabs of slab_cols; otherwise one slab is all of K.
        self.slab_cols = self.k_max
        if wide:
            seg_cols = COL_PASS * self.unroll
            self.slab_cols = (SLAB_STAGE_BYTES // (4 * self.B)) // seg_cols * seg_cols
        self.slabs = self.slab_cols < self.k_max
        seg_max = self.k_max // (COL_PASS * self.unroll)
        self.chunk_rows = max(16, min(CHUNK_ROWS, PART_SLOTS_MAX // (seg_max * self.B) // 16 * 16))
        self.part_slots = self.chunk_rows * seg_max * self.B
        # The matvec input, times the norm weights, is staged in shared memory as float32 when it fits
        # beside everything else the CTA keeps there (queue, partials, attention scratch): the item
        # loop then reads it with shared loads, and 16 warps have registers for two items in flight.
        self.fused_reduce = layout.fused_reduce
        if self.fused_reduce and not self.x_smem:
            raise ValueError("a layout with the attention merge folded into O_PROJ needs x_in_smem=True")
        warps = options.warps or (16 if self.x_smem else 8)
        if warps % ROW_GROUP or not ROW_GROUP <= warps <= 32:
            raise ValueError(f"warps={warps} must be a multiple of {ROW_GROUP} in 8..32")
        self.warps = warps
        self.threads = 32 * warps
        # loads in flight per warp: items side by side x unroll passes, within the register budget
        self.items_per_step = options.rows_per_unit or (2 if self.x_smem else max(1, 8 // self.unroll))
        if ROW_GROUP % self.items_per_step:
            raise ValueError(f"rows_per_unit={self.items_per_step} must divide {ROW_GROUP}")
        self.raw_words = self.items_per_step * self.unroll * 4
        # (the slab path, batch 5-8, has no register to spare for the early residual, and no shared memory
        # for the K/V preload)
        self.early_res = options.early_loads and not self.slabs
        self.attn_pre = options.attn_preload and not self.slabs
        # parallel ARGMAX at batch 1-2 (measured faster at batch 1): beside attn_preload at batch 3
        # (qwen3-0.6b) and on the slab path (llama-3.2-1b batch 7), ptxas spills 8 bytes at 128 registers
        self.par_argmax = options.parallel_argmax and self.B <= 2 and not self.slabs
        # (the slab path, batch 5-8, has no registers to spare for loads held across the wait)
        self.preload_items = 0 if self.slabs else min(max(0, int(options.preload)), self.items_per_step)
        if self.qk_norm and self.B == 4 and self.unroll == 4:
            # preloaded registers beside QK-norm attention's at 4 passes per unit: ptxas spills 8
            # instructions (qwen3-0.6b, batch 4); tests/unit/test_kernel_compile.py checks every batch
            self.preload_items = 0
        # Tile prefixes in shared memory (smem_prefix): while a CTA waits on and runs instruction i, the
        # copy engine brings the first rows of instruction i+1's weight tile into one of two buffers, so
        # HBM streams across the dependency hop. Only where the buffers fit beside everything else.
        self.prefix_bytes = 0
        if options.smem_prefix > 0 and not self.slabs:
            free = SMEM_LIMIT - self.smem_bytes(warps, with_x=True) - 2 * 8 - 128
            per = min(int(options.smem_prefix), free // 2) // 1024 * 1024
            if per >= 8 * 1024:
                self.prefix_bytes = per
                self.preload_items = 0          # the prefix replaces the register preload
        if self.smem_bytes(warps, with_x=True) > SMEM_LIMIT:
            raise ValueError(f"the kernel needs {self.smem_bytes(warps, with_x=True)} bytes of shared memory per "
                             f"CTA, more than the {SMEM_LIMIT} an sm_90 CTA can have; use fewer kv_splits or a "
                             f"smaller batch")

    def smem_bytes(self, warps: int, with_x: bool) -> int:
        """Shared memory the kernel allocates (each buffer 16-byte aligned), as in `kernel`; the tile
        prefix buffers and their mbarriers (smem_prefix) once their size is known."""
        G, D = self.G, self.D
        words = [4, 8, 8, warps * 8, warps * 8, self.part_slots,
                 4 if with_x and self.x_smem else self.part_slots, 8,
                 (self.B * self.slab_cols if self.x_smem else 4) if with_x else 0,
                 G * D, 2 * D, warps * G, warps * G, warps * G * D, self.max_queue_len * WORDS, 4,
                 warps * D if getattr(self, "attn_pre", False) else 4]
        prefix = getattr(self, "prefix_bytes", 0)
        return sum((4 * w + 15) // 16 * 16 for w in words) + (2 * prefix + 2 * 8 + 128 if prefix else 0)

    # ------------------------------------------------------------------ host entry
    @cute.jit
    def __call__(self, queue: Int64, lengths: Int64, w_embed: Int64, w_qkv: Int64, w_o: Int64,
                 w_gate_up: Int64, w_down: Int64, w_lm_head: Int64, attn_norm: Int64, mlp_norm: Int64,
                 final_norm: Int64, ones: Int64, q_norm: Int64, k_norm: Int64, rope_cos: Int64,
                 rope_sin: Int64, tokens: Int64, positions: Int64, block_table: Int64, x: Int64, h: Int64,
                 qkv: Int64, attn_part_o: Int64, attn_part_lse: Int64, attn_out: Int64, act: Int64,
                 logits: Int64, lm_max: Int64, lm_idx: Int64, out_tokens: Int64, counters: Int64,
                 sync: Int64, error: Int64, kv_table: Int64, trace: Int64,
                 stream):
        self.kernel(queue, lengths, w_embed, w_qkv, w_o, w_gate_up, w_down, w_lm_head, attn_norm, mlp_norm,
                    final_norm, ones, q_norm, k_norm, rope_cos, rope_sin, tokens, positions, block_table,
                    x, h, qkv, attn_part_o, attn_part_lse, attn_out, act, logits, lm_max, lm_idx, out_tokens,
                    counters, sync, error, kv_table, trace).launch(
            grid=[self.num_sms, 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device: weight geometry
    @cute.jit
    def weight_tile(self, op: Int32, layer: Int32, row0: Int32, w_qkv: Int64, w_o: Int64,
                    w_gate_up: Int64, w_down: Int64, w_lm_head: Int64):
        """(address of the tile's first row, K) of a matvec stage; (0, 0) for other opcodes."""
        addr = Int64(0)
        k = Int32(0)
        l64 = Int64(layer)
        r64 = Int64(row0)
        if op == OP_QKV:
            addr = w_qkv + (l64 * self.QKV + r64) * (self.H * 2)
            k = Int32(self.H)
        if op == OP_O_PROJ:
            addr = w_o + (l64 * self.H + r64) * (self.Q * 2)
            k = Int32(self.Q)
        if op == OP_GATE_UP:
            addr = w_gate_up + (l64 * (2 * self.F) + r64) * (self.H * 2)
            k = Int32(self.H)
        if op == OP_DOWN:
            addr = w_down + (l64 * self.H + r64) * (self.F * 2)
            k = Int32(self.F)
        if op == OP_LM_HEAD:
            addr = w_lm_head + r64 * (self.H * 2)
            k = Int32(self.H)
        return addr, k

    # ------------------------------------------------------------------ device: the interpreter
    @cute.kernel
    def kernel(self, queue: Int64, lengths: Int64, w_embed: Int64, w_qkv: Int64, w_o: Int64,
               w_gate_up: Int64, w_down: Int64, w_lm_head: Int64, attn_norm: Int64, mlp_norm: Int64,
               final_norm: Int64, ones: Int64, q_norm: Int64, k_norm: Int64, rope_cos: Int64,
               rope_sin: Int64, tokens: Int64, positions: Int64, block_table: Int64, x: Int64, h: Int64,
               qkv: Int64, attn_part_o: Int64, attn_part_lse: Int64, attn_out: Int64, act: Int64,
               logits: Int64, lm_max: Int64, lm_idx: Int64, out_tokens: Int64, counters: Int64,
               sync: Int64, error: Int64, kv_table: Int64, trace: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        sm, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        smem = cutlass.utils.SmemAllocator()
        # epoch, abort, queue length, stop
        s_ctrl = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
        s_red = smem.allocate_tensor(Float32, cute.make_layout((8,)), byte_alignment=16)
        s_ired = smem.allocate_tensor(Int32, cute.make_layout((8,)), byte_alignment=16)
        s_wv = smem.allocate_tensor(Float32, cute.make_layout((self.warps * 8,)), byte_alignment=16)
        s_wi = smem.allocate_tensor(Int32, cute.make_layout((self.warps * 8,)), byte_alignment=16)
        # matvec partials: one per (row, segment, sequence) of a chunk
        s_part = smem.allocate_tensor(Float32, cute.make_layout((self.part_slots,)), byte_alignment=16)
        s_ssq = smem.allocate_tensor(Float32, cute.make_layout((4 if self.x_smem else self.part_slots,)),
                                     byte_alignment=16)
        s_rstd = smem.allocate_tensor(Float32, cute.make_layout((8,)), byte_alignment=16)
        s_x = smem.allocate_tensor(Float32, cute.make_layout((self.B * self.slab_cols if self.x_smem else 4,)),
                                   byte_alignment=16)
        s_q = smem.allocate_tensor(Float32, cute.make_layout((self.G * self.D,)), byte_alignment=16)
        s_kv = smem.allocate_tensor(Float32, cute.make_layout((2 * self.D,)), byte_alignment=16)
        s_m = smem.allocate_tensor(Float32, cute.make_layout((self.warps * self.G,)), byte_alignment=16)
        s_l = smem.allocate_tensor(Float32, cute.make_layout((self.warps * self.G,)), byte_alignment=16)
        s_o = smem.allocate_tensor(Float32, cute.make_layout((self.warps * self.G * self.D,)), byte_alignment=16)
        # the CTA's whole instruction queue, copied once: instruction fetch is then a shared-memory read
        s_queue = smem.allocate_tensor(Int32, cute.make_layout((self.max_queue_len * WORDS,)), byte_alignment=16)
        s_lm = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)    # LM head pool ticket
        # attn_preload: each warp's first cached token, bf16 k then v (D each), copied before the wait
        s_pre = smem.allocate_tensor(Int32, cute.make_layout((self.warps * self.D if self.attn_pre else 4,)),
                                     byte_alignment=16)

        wb = Int32(0)        # shared addresses of the two tile-prefix buffers and their mbarriers
        mb = Int32(0)
        if cutlass.const_expr(self.prefix_bytes > 0):
            s_wbuf = smem.allocate_tensor(Int32, cute.make_layout((2 * self.prefix_bytes // 4,)), byte_alignment=128)
            s_mbar = smem.allocate_tensor(Int64, cute.make_layout((2,)), byte_alignment=8)
            wb = Int32(s_wbuf.iterator.toint())
            mb = Int32(s_mbar.iterator.toint())
            if tidx == 0:
                mbarrier_init(mb, Int32(1))
                mbarrier_init(mb + 8, Int32(1))
                mbarrier_init_fence()

        if tidx == 0:
            s_ctrl[0] = ld_i32(sync)
            s_ctrl[1] = Int32(0)
            s_ctrl[3] = Int32(0)
        cute.arch.sync_threads()
        # (the epoch stays in s_ctrl[0] and is read where used: one register less across the loop)
        n = ld_i32(lengths + Int64(sm) * 4)
        if tidx == 0:
            s_ctrl[2] = n        # the loop reads the queue length from here (a register less across it)
        qbase = queue + Int64(sm) * (self.max_queue_len * WORDS * 4)
        for wi in range(tidx, n * WORDS, self.threads):
            s_queue[wi] = ld_i32(qbase + Int64(wi) * 4)
        cute.arch.sync_threads()

        # prefetch the first instructions' tiles: later ones are prefetched prefetch_ahead instructions ahead
        if cutlass.const_expr(self.options.prefetch):
            for j in cutlass.range_constexpr(self.options.prefetch_ahead):
                if tidx == 0 and n > j:
                    self.prefetch_instruction(s_queue, Int32(j * WORDS), w_qkv, w_o, w_gate_up, w_down, w_lm_head)

        # tile prefixes issued and consumed so far (every thread counts; thread 0 issues): the k-th
        # prefixed matvec of this CTA uses buffer k % 2 and waits for mbarrier phase parity (k // 2) % 2
        pf_issued = Int32(0)
        pf_used = Int32(0)
        if cutlass.const_expr(self.prefix_bytes > 0):
            if n > 0:
                pf_issued = self.issue_prefix(tidx, s_queue, Int32(0), pf_issued, wb, mb, w_qkv, w_o, w_gate_up,
                                              w_down, w_lm_head)

        i = Int32(0)
        # Loop state in shared memory, not registers: s_ctrl[2] the queue length, s_ctrl[3] the stop flag.
        # Thread 0 sets s_ctrl[1] on a failed wait, before the barrier after the wait, and copies it to
        # s_ctrl[3] between that barrier and the one ending the instruction, so every thread reads the
        # same stop flag at the top of the next iteration.
        while i < s_ctrl[2] and s_ctrl[3] == 0:
            ins = i * WORDS
            op = s_queue[ins + W_OPCODE]
            layer = s_queue[ins + W_LAYER]
            a0 = s_queue[ins + W_A0]
            a1 = s_queue[ins + W_A1]
            a2 = s_queue[ins + W_A2]
            a3 = s_queue[ins + W_A3]
            # (wait, signal and index words are read where used: fewer registers live across the body)
            t_begin = Int32(0)
            t_ready = Int32(0)
            if cutlass.const_expr(self.options.trace):
                t_begin = globaltimer_lo()

            if cutlass.const_expr(self.options.prefetch):
                ahead = self.options.prefetch_ahead
                if tidx == 0 and i + ahead < s_ctrl[2]:
                    self.prefetch_instruction(s_queue, ins + ahead * WORDS, w_qkv, w_o, w_gate_up, w_down,
                                              w_lm_head)

            # ---- across the attention hop HBM idles: the next tile (GATE_UP after O_PROJ) streams into L2
            if cutlass.const_expr(self.options.hop_prefetch > 0):
                if tidx == 0 and i + 1 < s_ctrl[2]:
                    if op == OP_O_PROJ or op == OP_ATTN_PARTIAL:
                        self.prefetch_instruction(s_queue, ins + WORDS, w_qkv, w_o, w_gate_up, w_down, w_lm_head,
                                                  cap=self.options.hop_prefetch)

            # ---- the next instruction's tile prefix: into the buffer this one does not use
            if cutlass.const_expr(self.prefix_bytes > 0):
                if i + 1 < s_ctrl[2]:
                    pf_issued = self.issue_prefix(tidx, s_queue, ins + WORDS, pf_issued, wb, mb, w_qkv, w_o,
                                                  w_gate_up, w_down, w_lm_head)

            # ---- preload: a matvec's first weights do not depend on the producing stage, so every
            # warp issues its first step of loads now and they arrive while thread 0 waits
            is_matvec = op >= OP_QKV and op != OP_ATTN_PARTIAL and op != OP_ATTN_REDUCE and op != OP_ARGMAX
            raw = cute.make_rmem_tensor((self.raw_words,), Int32)
            if cutlass.const_expr(self.attn_pre):
                if op == OP_ATTN_PARTIAL:
                    # the cache holds positions < pos from earlier steps: nothing this step writes
                    self.attn_preload(warp, lane, layer, a0, a1, a2, a3, positions, block_table, kv_table, s_pre)
            if cutlass.const_expr(self.preload_items > 0):
                if is_matvec:
                    # (never with slabs: preload_items is 0 there)
                    w0_addr, k0 = self.weight_tile(op, layer, a0, w_qkv, w_o, w_gate_up, w_down, w_lm_head)
                    n_units0 = (a1 // self.items_per_step) * (k0 // (COL_PASS * self.unroll))
                    if a1 > self.chunk_rows:
                        n_units0 = Int32(self.chunk_rows // self.items_per_step) * (k0 // (COL_PASS * self.unroll))
                    if warp < n_units0:
                        self.load_step(lane, w0_addr, k0, Int32(0), warp, raw, count=self.preload_items)

            # ---- wait for the producing stage (thread 0 spins, the CTA barrier broadcasts)
            wait_id = s_queue[ins + W_WAIT_ID]
            if tidx == 0 and wait_id >= 0:
                target = (s_ctrl[0] + 1) * s_queue[ins + W_WAIT_COUNT]
                caddr = counters + Int64(wait_id) * 4
                seen = load_acquire(caddr)
                t0 = cute.arch.globaltimer()
                ok = Boolean(True)
                while seen - target < 0 and ok:
                    seen = load_acquire(caddr)
                    if cute.arch.globaltimer() - t0 > self.options.timeout_ns:
                        ok = Boolean(False)
                if not ok:
                    if atomic_cas(error, Int32(0), Int32(ERR_TIMEOUT)) == 0:
                        store_relaxed(error + 4, s_queue[ins + W_INDEX])
                        store_relaxed(error + 8, wait_id)
                        store_relaxed(error + 12, seen)
                    s_ctrl[1] = Int32(1)
            cute.arch.sync_threads()
            aborted = s_ctrl[1]
            if tidx == 0:
                s_ctrl[3] = aborted
            if cutlass.const_expr(self.options.trace):
                t_ready = globaltimer_lo()

            if aborted == 0:
                # matvec or not as one if/else: the preloaded registers are dead on the other branch
                if is_matvec:
                    pf_rows = Int32(0)
                    pf_addr = Int32(0)
                    if cutlass.const_expr(self.prefix_bytes > 0):
                        _, _, pf_rows = self.prefix_plan(s_queue, ins, w_qkv, w_o, w_gate_up, w_down, w_lm_head)
                        if pf_rows > 0:
                            slot = pf_used % 2
                            pf_addr = wb + slot * self.prefix_bytes
                            # the copy was issued an instruction ago: normally complete by now
                            landed = mbarrier_try_wait(mb + slot * 8, (pf_used // 2) % 2)
                            while landed == 0:
                                landed = mbarrier_try_wait(mb + slot * 8, (pf_used // 2) % 2)
                            pf_used = pf_used + 1
                    self.matvec(tidx, warp, lane, op, layer, a0, a1, a2, w_qkv, w_o, w_gate_up, w_down,
                                w_lm_head, attn_norm, mlp_norm, final_norm, ones, x, h, qkv, attn_out, act,
                                logits, lm_max, lm_idx, s_red, s_ired, s_part, s_ssq, s_wv, s_wi, s_rstd, s_x,
                                raw, a3, attn_part_o, attn_part_lse, pf_rows, pf_addr, w_embed, tokens)
                    if cutlass.const_expr(self.lm_pool is not None):
                        if op == OP_LM_HEAD and a3 > 0:
                            # the pool: take tiles by ticket until none is left (LM_HEAD's a3 = 1)
                            pool = self.lm_pool
                            if tidx == 0:
                                s_lm[0] = atomic_add_relaxed(sync + 8, Int32(1))
                            cute.arch.sync_threads()
                            t = s_lm[0]
                            while t < pool.tiles:
                                # the next ticket is asked for now; its answer is read after this tile
                                nxt = Int32(0)
                                if tidx == 0:
                                    nxt = atomic_add_relaxed(sync + 8, Int32(1))
                                row0 = Int32(pool.start) + t * pool.pool_rows
                                n_rows = Int32(self.V) - row0
                                if n_rows > pool.pool_rows:
                                    n_rows = Int32(pool.pool_rows)
                                self.matvec(tidx, warp, lane, Int32(OP_LM_HEAD), Int32(0), row0, n_rows, a2,
                                            w_qkv, w_o, w_gate_up, w_down, w_lm_head, attn_norm, mlp_norm,
                                            final_norm, ones, x, h, qkv, attn_out, act, logits, lm_max, lm_idx,
                                            s_red, s_ired, s_part, s_ssq, s_wv, s_wi, s_rstd, s_x, raw, Int32(0),
                                            attn_part_o, attn_part_lse, Int32(0), Int32(0), w_embed, tokens,
                                            lm_continue=True)
                                if tidx == 0:
                                    s_lm[0] = nxt
                                cute.arch.sync_threads()
                                t = s_lm[0]
                else:
                    if op == OP_EMBED:
                        self.embed(tidx, w_embed, tokens, x, error, s_queue[ins + W_INDEX])
                    if op == OP_ATTN_PARTIAL:
                        self.attn_partial(tidx, warp, lane, layer, a0, a1, a2, a3, s_queue[ins + W_INDEX], qkv,
                                          q_norm, k_norm, rope_cos, rope_sin, positions, block_table, kv_table,
                                          attn_part_o, attn_part_lse, error, s_q, s_kv, s_m, s_l, s_o, s_pre)
                    if op == OP_ATTN_REDUCE:
                        self.attn_reduce(tidx, layer, a0, a1, a3, attn_part_o, attn_part_lse, attn_out)
                    if op == OP_ARGMAX:
                        self.argmax(tidx, warp, lane, a0, lm_max, lm_idx, out_tokens, tokens, positions, s_wv, s_wi)

            # ---- signal: every thread's stores precede the barrier; the release orders them
            cute.arch.sync_threads()
            signal_id = s_queue[ins + W_SIGNAL_ID]
            if tidx == 0 and s_ctrl[1] == 0 and signal_id >= 0:
                red_release_add(counters + Int64(signal_id) * 4, Int32(1))
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    rec = trace + (Int64(sm) * self.max_queue_len + Int64(i)) * 32
                    st_i32(rec, s_queue[ins + W_INDEX])
                    st_i32(rec + 4, op)
                    st_i32(rec + 8, t_begin)
                    st_i32(rec + 12, t_ready)
                    st_i32(rec + 16, globaltimer_lo())
                    st_i32(rec + 20, sm)
            i = i + 1

        # ---- a CTA that stopped early (an error) lets its tile prefixes still in flight land before it
        # exits: the aborted instruction's own and the next one's, at most two
        if cutlass.const_expr(self.prefix_bytes > 0):
            if tidx == 0:
                while pf_used < pf_issued:
                    slot = pf_used % 2
                    landed = mbarrier_try_wait(mb + slot * 8, (pf_used // 2) % 2)
                    while landed == 0:
                        landed = mbarrier_try_wait(mb + slot * 8, (pf_used // 2) % 2)
                    pf_used = pf_used + 1

        # ---- (attn_preload) no K/V copy is left in flight when the CTA exits: an instruction that
        # aborted after its copies never waited for them
        if cutlass.const_expr(self.attn_pre):
            cp_async_wait_all()

        # ---- the last CTA out advances the epoch for the next step
        if tidx == 0:
            done = atomic_add_acq_rel(sync + 4, Int32(1))
            if done == self.num_sms - 1:
                store_relaxed(sync + 4, Int32(0))
                store_relaxed(sync + 8, Int32(0))         # the LM head pool's ticket: every CTA is done
                store_relaxed(sync, s_ctrl[0] + 1)

    @cute.jit
    def prefetch_instruction(self, s_queue: cute.Tensor, ins: Int32, w_qkv: Int64, w_o: Int64,
                             w_gate_up: Int64, w_down: Int64, w_lm_head: Int64, cap: int = 0):
        """L2 prefetch of the first min(tile bytes, cap or prefetch_bytes) of the instruction at word `ins`."""
        op = s_queue[ins + W_OPCODE]
        addr, k = self.weight_tile(op, s_queue[ins + W_LAYER], s_queue[ins + W_A0],
                                   w_qkv, w_o, w_gate_up, w_down, w_lm_head)
        limit = cap or self.options.prefetch_bytes
        if k > 0:
            nbytes = s_queue[ins + W_A1] * k * 2
            if nbytes > limit:
                nbytes = Int32(limit)
            prefetch_l2(addr, nbytes)

    @cute.jit
    def prefix_plan(self, s_queue: cute.Tensor, ins: Int32, w_qkv: Int64, w_o: Int64, w_gate_up: Int64,
                    w_down: Int64, w_lm_head: Int64):
        """(tile address, K, rows) of the prefix of the instruction at word `ins`: its first rows, whole
        work units, that fit one buffer; rows 0 for instructions without weights."""
        op = s_queue[ins + W_OPCODE]
        addr, k = self.weight_tile(op, s_queue[ins + W_LAYER], s_queue[ins + W_A0], w_qkv, w_o, w_gate_up,
                                   w_down, w_lm_head)
        rows = Int32(0)
        if k > 0:
            rows = Int32(self.prefix_bytes // 2) // k // self.items_per_step * self.items_per_step
            if rows > s_queue[ins + W_A1]:
                rows = s_queue[ins + W_A1]
        return addr, k, rows

    @cute.jit
    def issue_prefix(self, tidx: Int32, s_queue: cute.Tensor, ins: Int32, pf_issued: Int32, wb: Int32, mb: Int32,
                     w_qkv: Int64, w_o: Int64, w_gate_up: Int64, w_down: Int64, w_lm_head: Int64) -> Int32:
        """Thread 0 bulk-copies the prefix of the instruction at word `ins` (if it has one) into buffer
        pf_issued % 2; every thread returns the updated count. That buffer's previous prefix belonged to
        a matvec two prefixes back, which every thread finished before the last instruction barrier."""
        addr, k, rows = self.prefix_plan(s_queue, ins, w_qkv, w_o, w_gate_up, w_down, w_lm_head)
        out = pf_issued
        if rows > 0:
            if tidx == 0:
                slot = pf_issued % 2
                nbytes = rows * k * 2
                fence_proxy_async_shared()
                mbarrier_arrive_expect_tx(mb + slot * 8, nbytes)
                bulk_copy_g2s(wb + slot * self.prefix_bytes, addr, nbytes, mb + slot * 8)
            out = pf_issued + 1
        return out

    # ------------------------------------------------------------------ stage bodies
    @cute.jit
    def embed(self, tidx: Int32, w_embed: Int64, tokens: Int64, x: Int64, error: Int64, index: Int32):
        for t in range(tidx, self.B * self.H, self.threads):
            b = t // self.H
            k = t - b * self.H
            tok = ld_i32(tokens + Int64(b) * 4)
            if tok < 0 or tok >= self.V:
                if k == 0:
                    if atomic_cas(error, Int32(0), Int32(ERR_TOKEN)) == 0:
                        store_relaxed(error + 4, index)
                        store_relaxed(error + 12, tok)
                tok = Int32(0)
            st_f32(x + Int64(t) * 4, ld_bf16(w_embed + (Int64(tok) * self.H + Int64(k)) * 2))

    @cute.jit
    def matvec(self, tidx: Int32, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, a1: Int32,
               tile: Int32, w_qkv: Int64, w_o: Int64, w_gate_up: Int64, w_down: Int64, w_lm_head: Int64,
               attn_norm: Int64, mlp_norm: Int64, final_norm: Int64, ones: Int64, x: Int64, h: Int64,
               qkv: Int64, attn_out: Int64, act: Int64, logits: Int64, lm_max: Int64, lm_idx: Int64,
               s_red: cute.Tensor, s_ired: cute.Tensor, s_part: cute.Tensor, s_ssq: cute.Tensor,
               s_wv: cute.Tensor, s_wi: cute.Tensor, s_rstd: cute.Tensor, s_x: cute.Tensor, raw: cute.Tensor,
               a3: Int32, attn_part_o: Int64, attn_part_lse: Int64, pf_rows: Int32, pf_addr: Int32,
               w_embed: Int64, tokens: Int64, lm_continue: bool = False):
        """One tile of a matvec stage (rows a0 .. a0 + a1 - 1). lm_continue: an LM head pool tile, whose
        (max, argmax) extends the instruction's slot and whose weights were not preloaded."""
        B, H = self.B, self.H
        l64 = Int64(layer)
        w_addr, K = self.weight_tile(op, layer, a0, w_qkv, w_o, w_gate_up, w_down, w_lm_head)
        # input rows (one per sequence, width K), norm weights, output rows, residual rows
        in_addr = Int64(0)
        norm_addr = ones
        has_norm = Boolean(False)
        out_addr = Int64(0)
        out_w = Int32(0)
        res_addr = Int64(0)
        has_res = Boolean(False)
        if op == OP_QKV:
            in_addr = x + l64 * (B * H * 4)
            norm_addr = attn_norm + l64 * (H * 2)
            has_norm = Boolean(True)
            out_addr = qkv + (l64 * (B * self.QKV) + Int64(a0)) * 4
            out_w = Int32(self.QKV)
        if op == OP_O_PROJ:
            in_addr = attn_out + l64 * (B * self.Q * 4)
            out_addr = h + (l64 * (B * H) + Int64(a0)) * 4
            out_w = Int32(H)
            res_addr = x + (l64 * (B * H) + Int64(a0)) * 4
            has_res = Boolean(True)
        if op == OP_GATE_UP:
            in_addr = h + l64 * (B * H * 4)
            norm_addr = mlp_norm + l64 * (H * 2)
            has_norm = Boolean(True)
            out_addr = act + (l64 * (B * self.F) + Int64(a0 // 2)) * 4
            out_w = Int32(self.F)
        if op == OP_DOWN:
            in_addr = act + l64 * (B * self.F * 4)
            out_addr = x + ((l64 + 1) * (B * H) + Int64(a0)) * 4
            out_w = Int32(H)
            res_addr = h + (l64 * (B * H) + Int64(a0)) * 4
            has_res = Boolean(True)
        if op == OP_LM_HEAD:
            in_addr = x + Int64(self.L) * (B * H * 4)
            norm_addr = final_norm
            has_norm = Boolean(True)
            out_addr = logits + Int64(a0) * 4
            out_w = Int32(self.V)
        is_gate_up = op == OP_GATE_UP
        is_lm = op == OP_LM_HEAD
        merge = op == OP_O_PROJ and a3 > 0      # O_PROJ's input is the merge of the attention splits
        from_embed = op == OP_QKV and a3 == 1   # layer 0's QKV reads embed[token] (embed_folded layouts)

        # Work items are (row, segment): a segment is `unroll` 256-column passes of one row, so a
        # warp issues all its 16-byte loads for an item at once, and two items side by side. A chunk
        # of up to chunk_rows rows is spread over every warp of the CTA (all of a small tile's loads
        # are in flight together); partial dot products meet in shared memory and are summed in a
        # fixed order (deterministic), then the epilogue runs one thread per output.
        seg_cols = COL_PASS * self.unroll
        n_seg = K // seg_cols
        # the residual of this thread's first output (O_PROJ, DOWN), loaded now: its round trip overlaps
        # the input's instead of ending the instruction
        res0 = Float32(0.0)
        n_res0 = a1 * B
        if a1 > self.chunk_rows:
            n_res0 = Int32(self.chunk_rows * B)
        if cutlass.const_expr(self.early_res):
            if has_res and tidx < n_res0:
                r0 = tidx // B
                res0 = ld_f32(res_addr + (Int64(tidx - r0 * B) * Int64(H) + Int64(r0)) * 4)
        ss = cute.make_rmem_tensor((B,), Float32)
        if cutlass.const_expr(self.x_smem and not self.slabs):
            # stage x * norm weight in shared memory, and sum(x^2) per sequence for the RMSNorm
            for b in cutlass.range_constexpr(B):
                ss[b] = Float32(0.0)
            if cutlass.const_expr(self.layout.embed_folded):
                if from_embed:
                    self.stage_embed(tidx, K, w_embed, tokens, norm_addr, s_x, ss)
                else:
                    self.stage(tidx, layer, K, merge, in_addr, norm_addr, attn_part_o, attn_part_lse, s_x, ss)
            else:
                self.stage(tidx, layer, K, merge, in_addr, norm_addr, attn_part_o, attn_part_lse, s_x, ss)
            self.rms_statistic(tidx, warp, lane, K, ss, s_wv, s_rstd)
            cute.arch.sync_threads()
        if cutlass.const_expr(not lm_continue):
            if is_lm and tidx < B:
                s_red[tidx] = Float32(-math.inf)
                s_ired[tidx] = Int32(0x7FFFFFFF)
        for c0 in range(0, a1, self.chunk_rows):
            rows = a1 - c0
            if rows > self.chunk_rows:
                rows = Int32(self.chunk_rows)
            n_units = (rows // self.items_per_step) * n_seg
            sx_base = Int32(0)
            if cutlass.const_expr(self.x_smem):
                sx_base = Int32(s_x.iterator.toint())
            if cutlass.const_expr(self.slabs):
                self.slab_units(tidx, warp, lane, layer, c0, rows, K, w_addr, in_addr, norm_addr, merge,
                                attn_part_o, attn_part_lse, s_x, sx_base, raw, s_part, s_ssq, s_wv, s_rstd, ss)
            else:
                for unit in range(warp, n_units, self.warps):
                    # the first unit of the first chunk was (partly) loaded before the wait (preload)
                    if cutlass.const_expr(self.preload_items > 0 and not lm_continue):
                        if c0 > 0 or unit != warp:
                            self.load_step(lane, w_addr, K, c0, unit, raw)
                        else:
                            if cutlass.const_expr(self.preload_items < self.items_per_step):
                                self.load_step(lane, w_addr, K, c0, unit, raw, first=self.preload_items)
                    else:
                        if cutlass.const_expr(self.prefix_bytes > 0):
                            self.load_step(lane, w_addr, K, c0, unit, raw, pf_rows=pf_rows, pf_addr=pf_addr)
                        else:
                            self.load_step(lane, w_addr, K, c0, unit, raw)
                    self.compute_step(lane, K, unit, raw, in_addr, norm_addr, sx_base, s_part, s_ssq)
            cute.arch.sync_threads()
            # ---- epilogue: one thread per (output row, sequence)
            n_out = rows * B
            if is_gate_up:
                n_out = (rows // 2) * B
            for t in range(tidx, n_out, self.threads):
                r = t // B
                b = t - r * B
                scale = Float32(1.0)
                if has_norm:
                    if cutlass.const_expr(self.x_smem):
                        scale = s_rstd[b]
                    else:
                        sq = Float32(0.0)
                        for sg in range(n_seg):
                            sq = sq + s_ssq[sg * B + b]          # row 0's segments cover all of K
                        scale = rsqrt(sq / Float32(K) + Float32(self.eps))
                ob = out_addr + Int64(b) * Int64(out_w) * 4
                if is_gate_up:
                    # output r = (pair p, row j): gate row p*16+j, up row p*16+8+j
                    p = r // ROW_GROUP
                    j = r - p * ROW_GROUP
                    gr = p * (2 * ROW_GROUP) + j
                    g = Float32(0.0)
                    up = Float32(0.0)
                    for sg in range(n_seg):
                        g = g + s_part[(gr * n_seg + sg) * B + b]
                        up = up + s_part[((gr + ROW_GROUP) * n_seg + sg) * B + b]
                    g = g * scale
                    up = up * scale
                    silu = g / (Float32(1.0) + ex2(-g * Float32(LOG2E)))
                    st_f32(ob + Int64(c0 // 2 + r) * 4, silu * up)
                else:
                    y = Float32(0.0)
                    for sg in range(n_seg):
                        y = y + s_part[(r * n_seg + sg) * B + b]
                    y = y * scale
                    if has_res:
                        if cutlass.const_expr(not self.early_res):
                            y = y + ld_f32(res_addr + (Int64(b) * Int64(H) + Int64(c0 + r)) * 4)
                        else:
                            if c0 == 0 and t == tidx:
                                y = y + res0
                            else:
                                y = y + ld_f32(res_addr + (Int64(b) * Int64(H) + Int64(c0 + r)) * 4)
                    st_f32(ob + Int64(c0 + r) * 4, y)
                    if is_lm:
                        s_part[(r * n_seg) * B + b] = y          # keep the logit for the argmax below
            cute.arch.sync_threads()
            # ---- LM head: (max, argmax) of the chunk per sequence, merged into the tile's; ties -> lowest row
            if is_lm:
                for b in cutlass.range_constexpr(B):
                    bv = Float32(-math.inf)
                    bi = Int32(0x7FFFFFFF)
                    for r in range(tidx, rows, self.threads):
                        v = s_part[(r * n_seg) * B + b]
                        if v > bv:
                            bv = v
                            bi = a0 + c0 + r
                    bv, bi = warp_max_index(bv, bi)
                    if lane == 0:
                        s_wv[warp * B + b] = bv
                        s_wi[warp * B + b] = bi
                cute.arch.sync_threads()
                if tidx < B:
                    bv, bi = self.merge_warp_maxima(tidx, s_red[tidx], s_ired[tidx], s_wv, s_wi)
                    s_red[tidx] = bv
                    s_ired[tidx] = bi
                cute.arch.sync_threads()
        if is_lm and tidx < B:
            st_f32(lm_max + (Int64(tidx) * self.T + Int64(tile)) * 4, s_red[tidx])
            st_i32(lm_idx + (Int64(tidx) * self.T + Int64(tile)) * 4, s_ired[tidx])

    @cute.jit
    def slab_units(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, c0: Int32, rows: Int32, K: Int32,
                   w_addr: Int64, in_addr: Int64, norm_addr: Int64, merge: Boolean, attn_part_o: Int64,
                   attn_part_lse: Int64, s_x: cute.Tensor, sx_base: Int32, raw: cute.Tensor, s_part: cute.Tensor,
                   s_ssq: cute.Tensor, s_wv: cute.Tensor, s_rstd: cute.Tensor, ss: cute.Tensor):
        """One chunk's work units when the input is staged in slabs of slab_cols columns: stage a slab
        (x * norm weight, or the merged attention), run the units of its segments, repeat; the partials
        of every segment meet in s_part as in one slab. sum(x^2) is gathered while chunk 0 stages, and
        the RMSNorm statistic written to s_rstd after its last slab."""
        B = self.B
        seg_cols = COL_PASS * self.unroll
        first_chunk = c0 == 0
        if first_chunk:
            for b in cutlass.range_constexpr(B):
                ss[b] = Float32(0.0)
        for s0 in range(0, K, self.slab_cols):
            kw = K - s0
            if kw > self.slab_cols:
                kw = Int32(self.slab_cols)
            self.stage(tidx, layer, K, merge, in_addr, norm_addr, attn_part_o, attn_part_lse, s_x, ss,
                       s0, kw, first_chunk)
            cute.arch.sync_threads()
            n_seg_s = kw // seg_cols
            seg0 = s0 // seg_cols
            n_units = (rows // self.items_per_step) * n_seg_s
            for unit in range(warp, n_units, self.warps):
                # (no preload on this path: every unit loads its weights here)
                self.load_step(lane, w_addr, K, c0, unit, raw, n_seg=n_seg_s, seg0=seg0)
                self.compute_step(lane, K, unit, raw, in_addr, norm_addr, sx_base, s_part, s_ssq,
                                  n_seg_slab=n_seg_s, seg0=seg0)
            cute.arch.sync_threads()          # the slab is read: the next one may overwrite it
        if first_chunk:
            self.rms_statistic(tidx, warp, lane, K, ss, s_wv, s_rstd)

    @cute.jit
    def rms_statistic(self, tidx: Int32, warp: Int32, lane: Int32, K: Int32, ss: cute.Tensor, s_wv: cute.Tensor,
                      s_rstd: cute.Tensor):
        """s_rstd[b] = rsqrt(mean(x^2) + eps) from every thread's partial sum(x^2) in ss (the CTA's
        reduction through s_wv; a barrier is needed before s_rstd is read)."""
        for b in cutlass.range_constexpr(self.B):
            tot = warp_sum(ss[b])
            if lane == 0:
                s_wv[warp * 8 + b] = tot
        cute.arch.sync_threads()
        if tidx < self.B:
            tot = Float32(0.0)
            for w in range(self.warps):
                tot = tot + s_wv[w * 8 + tidx]
            s_rstd[tidx] = rsqrt(tot / Float32(K) + Float32(self.eps))

    @cute.jit
    def stage(self, tidx: Int32, layer: Int32, K: Int32, merge: Boolean, in_addr: Int64, norm_addr: Int64,
              attn_part_o: Int64, attn_part_lse: Int64, s_x: cute.Tensor, ss: cute.Tensor,
              s0=None, kw=None, gather=None):
        """The matvec input into s_x: O_PROJ's merged attention splits where `merge` (layouts with the
        merge folded in), else the input row x norm weight with sum(x^2) into ss. All of K, or with s0
        and kw the slab of columns s0 .. s0 + kw (row stride slab_cols; ss only when `gather`)."""
        if cutlass.const_expr(self.fused_reduce):
            if merge:
                self.stage_merged_attention(tidx, layer, K, attn_part_o, attn_part_lse, s_x, s0, kw)
            else:
                self.stage_input(tidx, K, in_addr, norm_addr, s_x, ss, s0, kw, gather)
        else:
            self.stage_input(tidx, K, in_addr, norm_addr, s_x, ss, s0, kw, gather)

    def staged_extent(self, K, s0, kw):
        """(columns staged, row stride in s_x) of stage_input / stage_merged_attention: the whole row of
        K columns, or with a slab start s0 (decided at trace time) its kw columns at stride slab_cols."""
        if s0 is None:
            return K, K
        return kw, self.slab_cols

    def staged_column(self, q, s0):
        """Input column of the staged quad q: 4q, or 4q past the slab start s0."""
        if s0 is None:
            return q * 4
        return s0 + q * 4

    @cute.jit
    def stage_input(self, tidx: Int32, K: Int32, in_addr: Int64, norm_addr: Int64, s_x: cute.Tensor,
                    ss: cute.Tensor, s0=None, kw=None, gather=None):
        """s_x = input row x norm weight for every sequence, ss[b] = sum(x^2): X_UNROLL quads per thread
        per round, so a whole input row is one round of loads. With s0, kw: that slab of columns, at row
        stride slab_cols, and ss only when `gather`."""
        width, stride = self.staged_extent(K, s0, kw)
        for b in cutlass.range_constexpr(self.B):
            for q0 in range(tidx, width // 4, self.threads * X_UNROLL):
                for v in cutlass.range_constexpr(X_UNROLL):
                    q = q0 + v * self.threads
                    if q < width // 4:
                        k = self.staged_column(q, s0)
                        xv = load_f32x4(in_addr + (Int64(b) * Int64(K) + Int64(k)) * 4)
                        nv = load_weights_bf16x4(norm_addr + Int64(k) * 2)
                        for e in cutlass.range_constexpr(4):
                            if cutlass.const_expr(s0 is None):
                                ss[b] = ss[b] + xv[e] * xv[e]
                            else:
                                if gather:
                                    ss[b] = ss[b] + xv[e] * xv[e]
                            s_x[b * stride + q * 4 + e] = xv[e] * nv[e]

    @cute.jit
    def stage_embed(self, tidx: Int32, K: Int32, w_embed: Int64, tokens: Int64, norm_addr: Int64,
                    s_x: cute.Tensor, ss: cute.Tensor):
        """stage_input for layer 0's QKV with the embedding folded in: the input row of sequence b is
        embed[token[b]] (bf16 -> float32, as EMBED writes x[0]). A token outside the vocabulary reads
        row 0 here; EMBED reports it in the error word."""
        for b in cutlass.range_constexpr(self.B):
            tok = ld_i32(tokens + Int64(b) * 4)
            if tok < 0 or tok >= self.V:
                tok = Int32(0)
            row = w_embed + Int64(tok) * (self.H * 2)
            for q0 in range(tidx, K // 4, self.threads * X_UNROLL):
                for v in cutlass.range_constexpr(X_UNROLL):
                    q = q0 + v * self.threads
                    if q < K // 4:
                        xv = load_weights_bf16x4(row + Int64(q * 4) * 2)
                        nv = load_weights_bf16x4(norm_addr + Int64(q * 4) * 2)
                        for e in cutlass.range_constexpr(4):
                            ss[b] = ss[b] + xv[e] * xv[e]
                            s_x[b * K + q * 4 + e] = xv[e] * nv[e]

    @cute.jit
    def stage_merged_attention(self, tidx: Int32, layer: Int32, K: Int32, attn_part_o: Int64,
                               attn_part_lse: Int64, s_x: cute.Tensor, s0=None, kw=None):
        """O_PROJ folded with the attention merge: s_x = the merged attention output of every sequence,
        one quad per thread at a time (each quad is 2 x splits loads). With s0, kw: that slab of columns,
        at row stride slab_cols."""
        width, stride = self.staged_extent(K, s0, kw)
        for b in cutlass.range_constexpr(self.B):
            for q in range(tidx, width // 4, self.threads):
                xv = cute.make_rmem_tensor((4,), Float32)
                k = self.staged_column(q, s0)
                self.merge_quad(layer, b, k, attn_part_o, attn_part_lse, xv)
                for e in cutlass.range_constexpr(4):
                    s_x[b * stride + q * 4 + e] = xv[e]

    @cute.jit
    def merge_quad(self, layer: Int32, b: Int32, k: Int32, attn_part_o: Int64, attn_part_lse: Int64,
                   out: cute.Tensor):
        """Attention output elements k..k+3 (one head) of sequence b: the splits' partial outputs
        weighted by exp(lse_s - max) and normalized, as ATTN_REDUCE computes them."""
        head = k // self.D
        d = k - head * self.D
        base = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S
        lse = cute.make_rmem_tensor((self.S,), Float32)
        ov = cute.make_rmem_tensor((self.S * 4,), Float32)
        for s in cutlass.range_constexpr(self.S):
            lse[s] = ld_f32(attn_part_lse + (base + s) * 4)
            if cutlass.const_expr(self.options.early_loads):
                # every split's partial in the same round of loads as the lse values (an empty split wrote
                # lse = -inf and a zero partial, which the test below skips): no second round trip
                self.load_partial(attn_part_o, base, s, d, ov)
        mx = Float32(-math.inf)
        for s in cutlass.range_constexpr(self.S):
            if lse[s] > mx:
                mx = lse[s]
        tot = Float32(0.0)
        for e in cutlass.range_constexpr(4):
            out[e] = Float32(0.0)
        for s in cutlass.range_constexpr(self.S):
            if lse[s] > Float32(-math.inf):
                f = ex2((lse[s] - mx) * Float32(LOG2E))
                if cutlass.const_expr(not self.options.early_loads):
                    self.load_partial(attn_part_o, base, s, d, ov)
                tot = tot + f
                for e in cutlass.range_constexpr(4):
                    out[e] = out[e] + f * ov[s * 4 + e]
        for e in cutlass.range_constexpr(4):
            out[e] = out[e] / tot

    @cute.jit
    def load_partial(self, attn_part_o: Int64, base: Int64, s: int, d: Int32, ov: cute.Tensor):
        """Elements d..d+3 of split s's partial output into ov[4s:4s+4]."""
        o4 = load_f32x4(attn_part_o + ((base + s) * self.D + Int64(d)) * 4)
        for e in cutlass.range_constexpr(4):
            ov[s * 4 + e] = o4[e]

    @cute.jit
    def load_step(self, lane: Int32, w_addr: Int64, K: Int32, c0: Int32, unit: Int32, raw: cute.Tensor,
                  first: int = 0, count: int = -1, n_seg=None, seg0=None, pf_rows=None, pf_addr=None):
        """Issue a warp's 16-byte weight loads for one work unit into `raw` (4 words per load); nothing
        waits for them here. A unit is `items_per_step` consecutive rows of the chunk starting at row c0,
        over one column segment (`unroll` 256-column passes), so its rows share the input columns.
        Only rows first .. first + count - 1 of the unit when given (the preload issues a prefix). With
        slabs, units enumerate the n_seg segments of the slab starting at segment seg0. With pf_rows, a
        unit within the tile's first pf_rows rows reads them from the prefix buffer at shared pf_addr
        (the same rows, row-major with K columns) instead."""
        seg_cols = COL_PASS * self.unroll
        if cutlass.const_expr(n_seg is None):
            n_seg = K // seg_cols
        p = unit // n_seg
        sg = unit - p * n_seg
        if cutlass.const_expr(seg0 is not None):
            sg = sg + seg0
        if cutlass.const_expr(pf_rows is None):
            self.load_rows_global(lane, w_addr, K, c0, p, sg, raw, first, count)
        else:
            if c0 + p * self.items_per_step < pf_rows:
                for h in cutlass.range_constexpr(first, self.items_per_step if count < 0 else first + count):
                    r = p * self.items_per_step + h
                    srow = pf_addr + ((c0 + r) * K + sg * seg_cols + lane * 8) * 2
                    for u in cutlass.range_constexpr(self.unroll):
                        v = load_shared_raw(srow + u * COL_PASS * 2)
                        for e in cutlass.range_constexpr(4):
                            raw[(h * self.unroll + u) * 4 + e] = v[e]
            else:
                self.load_rows_global(lane, w_addr, K, c0, p, sg, raw, first, count)

    @cute.jit
    def load_rows_global(self, lane: Int32, w_addr: Int64, K: Int32, c0: Int32, p: Int32, sg: Int32,
                         raw: cute.Tensor, first: int, count: int):
        """load_step's 16-byte global loads of unit row-group p, segment sg."""
        seg_cols = COL_PASS * self.unroll
        for h in cutlass.range_constexpr(first, self.items_per_step if count < 0 else first + count):
            r = p * self.items_per_step + h
            wrow = w_addr + (Int64(c0 + r) * Int64(K) + Int64(sg * seg_cols + lane * 8)) * 2
            for u in cutlass.range_constexpr(self.unroll):
                v = load_weights_raw(wrow + u * COL_PASS * 2)
                for e in cutlass.range_constexpr(4):
                    raw[(h * self.unroll + u) * 4 + e] = v[e]

    @cute.jit
    def compute_step(self, lane: Int32, K: Int32, unit: Int32, raw: cute.Tensor, in_addr: Int64,
                     norm_addr: Int64, sx_base: Int32, s_part: cute.Tensor, s_ssq: cute.Tensor,
                     n_seg_slab=None, seg0=None):
        """Dot products of a unit's rows (weights in `raw`) with the input, which is read once for all of
        them: one partial per (row, segment, sequence) into s_part at ((row * n_seg + segment) * B + b)
        (and sum(x^2) into s_ssq when the input is read from global)."""
        B, R = self.B, self.items_per_step
        seg_cols = COL_PASS * self.unroll
        n_seg = K // seg_cols
        if cutlass.const_expr(n_seg_slab is None):
            p = unit // n_seg
            sg = unit - p * n_seg
        else:
            p = unit // n_seg_slab
            sg = unit - p * n_seg_slab + seg0
        col0 = sg * seg_cols + lane * 8
        acc = cute.make_rmem_tensor((R * B,), Float32)
        ssq = cute.make_rmem_tensor((B,), Float32)
        for i in cutlass.range_constexpr(R * B):
            acc[i] = Float32(0.0)
        for b in cutlass.range_constexpr(B):
            ssq[b] = Float32(0.0)
        for u in cutlass.range_constexpr(self.unroll):
            for b in cutlass.range_constexpr(B):
                xa = cute.make_rmem_tensor((8,), Float32)
                if cutlass.const_expr(self.x_smem):
                    # x * norm weight, staged by matvec; the statistic is already in s_rstd
                    if cutlass.const_expr(n_seg_slab is None):
                        xs = sx_base + (b * K + col0 + u * COL_PASS) * 4
                    else:
                        # the staged slab of sequence b: slab_cols columns from segment seg0
                        xs = sx_base + (b * self.slab_cols + col0 - seg0 * seg_cols + u * COL_PASS) * 4
                    xl = ld_shared_f32x4(xs)
                    xh = ld_shared_f32x4(xs + 16)
                    for e in cutlass.range_constexpr(4):
                        xa[e] = xl[e]
                        xa[4 + e] = xh[e]
                else:
                    # x and the norm weight from global (L1), sum(x^2) beside the dot product
                    c64 = Int64(col0 + u * COL_PASS)
                    nw = load_weights_bf16x8(norm_addr + c64 * 2)
                    xl = load_f32x4(in_addr + (Int64(b) * Int64(K) + c64) * 4)
                    xh = load_f32x4(in_addr + (Int64(b) * Int64(K) + c64) * 4 + 16)
                    sq = ssq[b]
                    for e in cutlass.range_constexpr(4):
                        sq = sq + xl[e] * xl[e]
                        xa[e] = xl[e] * nw[e]
                    for e in cutlass.range_constexpr(4):
                        sq = sq + xh[e] * xh[e]
                        xa[4 + e] = xh[e] * nw[4 + e]
                    ssq[b] = sq
                for h in cutlass.range_constexpr(R):
                    q = (h * self.unroll + u) * 4
                    w = unpack_bf16x8(raw[q], raw[q + 1], raw[q + 2], raw[q + 3])
                    s0 = acc[h * B + b]
                    for e in cutlass.range_constexpr(8):
                        s0 = s0 + w[e] * xa[e]
                    acc[h * B + b] = s0
        for h in cutlass.range_constexpr(R):
            item = (p * R + h) * n_seg + sg
            for b in cutlass.range_constexpr(B):
                dot = warp_sum(acc[h * B + b])
                if lane == 0:
                    s_part[item * B + b] = dot
        if cutlass.const_expr(not self.x_smem):
            for b in cutlass.range_constexpr(B):
                sqs = warp_sum(ssq[b])
                if lane == 0:
                    for h in cutlass.range_constexpr(R):
                        s_ssq[((p * R + h) * n_seg + sg) * B + b] = sqs

    @cute.jit
    def split_bounds(self, pos: Int32, split: Int32, num_splits: Int32):
        """Cached positions [lo, hi) of split `split` of `num_splits` at position pos (attention.split_range)."""
        chunk = (pos + num_splits - 1) // num_splits
        lo = split * chunk
        if lo > pos:
            lo = pos
        hi = lo + chunk
        if hi > pos:
            hi = pos
        return lo, hi

    @cute.jit
    def load_cached_kv(self, b: Int32, kvh: Int32, t: Int32, block_table: Int64, k_base: Int64, v_base: Int64,
                       lane: Int32, kk: cute.Tensor, vv: cute.Tensor):
        """This lane's E elements of the cached k and v of sequence b at position t (kv head kvh)."""
        ts = self.cached_token(b, kvh, t, block_table)
        for e in cutlass.range_constexpr(self.E):
            kk[e] = ld_bf16(k_base + (ts + Int64(lane * self.E + e)) * 2)
            vv[e] = ld_bf16(v_base + (ts + Int64(lane * self.E + e)) * 2)

    @cute.jit
    def cached_token(self, b: Int32, kvh: Int32, t: Int32, block_table: Int64) -> Int64:
        """Element offset, in a layer's K (or V) cache, of sequence b's position t, kv head kvh: its block
        from the block table, then the cache's strides."""
        tb = ld_i32(block_table + (Int64(b) * self.max_blocks + Int64(t // self.bs)) * 4)
        return Int64(tb) * self.kv_sb + Int64(t % self.bs) * self.kv_st + Int64(kvh) * self.kv_sh

    def preload_slot(self, warp: Int32, lane: Int32, s_pre: cute.Tensor) -> Int32:
        """Shared address of this lane's k elements in its warp's slot of s_pre: a slot holds D bf16 of k,
        then D of v (4 * D bytes); the lane's v elements are D * 2 bytes further."""
        return Int32(s_pre.iterator.toint()) + (warp * 2 * self.D + lane * self.E) * 2

    @cute.jit
    def attn_preload(self, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32, split: Int32,
                     num_splits: Int32, positions: Int64, block_table: Int64, kv_table: Int64, s_pre: cute.Tensor):
        """Before ATTN_PARTIAL's wait: this warp's first cached token of the split (the one phase B takes
        first, position lo + warp), its lane's bf16 k and v elements copied to the warp's slot of s_pre by
        cp.async (no register holds them across the wait), when the warp has one. Positions and the
        cache's history are step inputs, never written by the stages this instruction waits on."""
        pos = ld_i32(positions + Int64(b) * 4)
        if pos < 0 or pos >= self.max_seq_len:
            pos = Int32(0)                      # attn_partial reports it; no cached token is read
        lo, hi = self.split_bounds(pos, split, num_splits)
        if lo + warp < hi:
            off = (self.cached_token(b, kvh, lo + warp, block_table) + Int64(lane * self.E)) * 2
            dst = self.preload_slot(warp, lane, s_pre)
            cp_async_shared(dst, ld_i64(kv_table + Int64(layer) * 16) + off, self.E * 2)
            cp_async_shared(dst + self.D * 2, ld_i64(kv_table + Int64(layer) * 16 + 8) + off, self.E * 2)

    @cute.jit
    def preloaded_kv(self, warp: Int32, lane: Int32, s_pre: cute.Tensor, kk: cute.Tensor, vv: cute.Tensor):
        """This lane's k and v elements that attn_preload copied (float32), after waiting for the copies."""
        cp_async_wait_all()
        src = self.preload_slot(warp, lane, s_pre)
        for w in cutlass.range_constexpr(self.E // 2):
            kk[2 * w], kk[2 * w + 1] = unpack_bf16x2(load_shared_b32(src + w * 4))
            vv[2 * w], vv[2 * w + 1] = unpack_bf16x2(load_shared_b32(src + self.D * 2 + w * 4))

    @cute.jit
    def attn_partial(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32,
                     split: Int32, num_splits: Int32, index: Int32, qkv: Int64, q_norm: Int64, k_norm: Int64,
                     rope_cos: Int64, rope_sin: Int64, positions: Int64, block_table: Int64, kv_table: Int64,
                     attn_part_o: Int64, attn_part_lse: Int64, error: Int64,
                     s_q: cute.Tensor, s_kv: cute.Tensor, s_m: cute.Tensor, s_l: cute.Tensor, s_o: cute.Tensor,
                     s_pre: cute.Tensor):
        D, E, G, half = self.D, self.E, self.G, self.D // 2
        pos = ld_i32(positions + Int64(b) * 4)
        bad = pos < 0 or pos >= self.max_seq_len
        if bad:
            if tidx == 0:
                if atomic_cas(error, Int32(0), Int32(ERR_POSITION)) == 0:
                    store_relaxed(error + 4, index)
                    store_relaxed(error + 12, pos)
            pos = Int32(0)
        last = split == num_splits - 1
        row = qkv + (Int64(layer) * self.B + Int64(b)) * (self.QKV * 4)
        # the layer's K and V base addresses (a device table, so a bound cache can move without a
        # recompile or a new CUDA graph); element offset of (block, offset, kv head) from the strides
        k_base = ld_i64(kv_table + Int64(layer) * 16)
        v_base = ld_i64(kv_table + Int64(layer) * 16 + 8)
        blk = ld_i32(block_table + (Int64(b) * self.max_blocks + Int64(pos // self.bs)) * 4)
        slot = Int64(blk) * self.kv_sb + Int64(pos % self.bs) * self.kv_st + Int64(kvh) * self.kv_sh

        # ---- phase A: q heads of the group, then k, then v of the new token -> smem
        for hh in range(warp, G + 2, self.warps):
            off = Int32(0)
            if hh < G:
                off = (kvh * G + hh) * D
            if hh == G:
                off = Int32(self.Q) + kvh * D
            if hh == G + 1:
                off = Int32(self.Q + self.KV) + kvh * D
            vals = cute.make_rmem_tensor((E,), Float32)
            for e in cutlass.range_constexpr(E):
                vals[e] = ld_f32(row + Int64(off + lane * E + e) * 4)
            if cutlass.const_expr(self.qk_norm):
                if hh <= G:
                    ss = Float32(0.0)
                    for e in cutlass.range_constexpr(E):
                        ss = ss + vals[e] * vals[e]
                    ss = warp_sum(ss)
                    r = rsqrt(ss / Float32(D) + Float32(self.eps))
                    nbase = q_norm
                    if hh == G:
                        nbase = k_norm
                    for e in cutlass.range_constexpr(E):
                        vals[e] = vals[e] * r * ld_bf16(nbase + (Int64(layer) * D + Int64(lane * E + e)) * 2)
            if hh <= G:
                for e in cutlass.range_constexpr(E):
                    partner = cute.arch.shuffle_sync_bfly(vals[e], offset=16)
                    fi = (lane * E + e) % half
                    cs = ld_f32(rope_cos + (Int64(pos) * half + Int64(fi)) * 4)
                    sn = ld_f32(rope_sin + (Int64(pos) * half + Int64(fi)) * 4)
                    rot = vals[e] * cs + partner * sn
                    if lane < 16:
                        rot = vals[e] * cs - partner * sn
                    vals[e] = rot
            if hh < G:
                for e in cutlass.range_constexpr(E):
                    s_q[hh * D + lane * E + e] = vals[e]
            else:
                cache = k_base
                if hh == G + 1:
                    cache = v_base
                for e in cutlass.range_constexpr(E):
                    rv = round_bf16(vals[e])
                    s_kv[(hh - G) * D + lane * E + e] = rv
                    if last:
                        st_bf16(cache + (slot + Int64(lane * E + e)) * 2, rv)
        cute.arch.sync_threads()

        # ---- phase B: online softmax over the split's cached tokens, one token per warp at a time
        lo, hi = self.split_bounds(pos, split, num_splits)
        qv = cute.make_rmem_tensor((G * E,), Float32)
        for g in cutlass.range_constexpr(G):
            for e in cutlass.range_constexpr(E):
                qv[g * E + e] = s_q[g * D + lane * E + e]
        m = cute.make_rmem_tensor((G,), Float32)
        lsum = cute.make_rmem_tensor((G,), Float32)
        o = cute.make_rmem_tensor((G * E,), Float32)
        for g in cutlass.range_constexpr(G):
            m[g] = Float32(-math.inf)
            lsum[g] = Float32(0.0)
            for e in cutlass.range_constexpr(E):
                o[g * E + e] = Float32(0.0)
        n_tok = hi - lo
        extra = Int32(0)
        if last and warp == 0:
            extra = Int32(1)
        n_mine = (n_tok - warp + self.warps - 1) // self.warps
        if n_tok <= warp:
            n_mine = Int32(0)
        for j in range(n_mine + extra):
            kk = cute.make_rmem_tensor((E,), Float32)
            vv = cute.make_rmem_tensor((E,), Float32)
            if j < n_mine:
                if cutlass.const_expr(self.attn_pre):
                    if j == 0:          # loaded before the wait (attn_preload)
                        self.preloaded_kv(warp, lane, s_pre, kk, vv)
                    else:
                        self.load_cached_kv(b, kvh, lo + warp + j * self.warps, block_table, k_base, v_base,
                                            lane, kk, vv)
                else:
                    self.load_cached_kv(b, kvh, lo + warp + j * self.warps, block_table, k_base, v_base, lane,
                                        kk, vv)
            else:
                for e in cutlass.range_constexpr(E):
                    kk[e] = s_kv[lane * E + e]
                    vv[e] = s_kv[D + lane * E + e]
            for g in cutlass.range_constexpr(G):
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(E):
                    dot = dot + qv[g * E + e] * kk[e]
                s = warp_sum(dot) * Float32(self.scale_log2)
                m_new = m[g]
                if s > m_new:
                    m_new = s
                corr = ex2(m[g] - m_new)
                p = ex2(s - m_new)
                lsum[g] = lsum[g] * corr + p
                for e in cutlass.range_constexpr(E):
                    o[g * E + e] = o[g * E + e] * corr + p * vv[e]
                m[g] = m_new

        # ---- phase C: merge the warps' (m, l, o) and write the split's partial
        for g in cutlass.range_constexpr(G):
            if lane == 0:
                s_m[warp * G + g] = m[g]
                s_l[warp * G + g] = lsum[g]
            for e in cutlass.range_constexpr(E):
                s_o[(warp * G + g) * D + lane * E + e] = o[g * E + e]
        cute.arch.sync_threads()
        for t in range(tidx, G * D, self.threads):
            g = t // D
            d = t - g * D
            mx = Float32(-math.inf)
            for w in cutlass.range_constexpr(self.warps):
                mw = s_m[w * G + g]
                if mw > mx:
                    mx = mw
            tot = Float32(0.0)
            acc_o = Float32(0.0)
            if mx > Float32(-math.inf):
                for w in cutlass.range_constexpr(self.warps):
                    f = ex2(s_m[w * G + g] - mx)
                    tot = tot + s_l[w * G + g] * f
                    acc_o = acc_o + s_o[(w * G + g) * D + d] * f
            head = kvh * G + g
            pidx = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S + Int64(split)
            outv = Float32(0.0)
            lse = Float32(-math.inf)
            if tot > Float32(0.0):
                outv = acc_o / tot
                lse = (mx + lg2(tot)) * Float32(1.0 / LOG2E)
            st_f32(attn_part_o + (pidx * D + Int64(d)) * 4, outv)
            if d == 0:
                st_f32(attn_part_lse + pidx * 4, lse)

    @cute.jit
    def attn_reduce(self, tidx: Int32, layer: Int32, b: Int32, kvh: Int32, num_splits: Int32,
                    attn_part_o: Int64, attn_part_lse: Int64, attn_out: Int64):
        D, G = self.D, self.G
        for t in range(tidx, G * D, self.threads):
            g = t // D
            d = t - g * D
            head = kvh * G + g
            base = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S
            mx = Float32(-math.inf)
            for s in range(num_splits):
                v = ld_f32(attn_part_lse + (base + Int64(s)) * 4)
                if v > mx:
                    mx = v
            tot = Float32(0.0)
            acc_o = Float32(0.0)
            for s in range(num_splits):
                lse = ld_f32(attn_part_lse + (base + Int64(s)) * 4)
                if lse > Float32(-math.inf):
                    f = ex2((lse - mx) * Float32(LOG2E))
                    tot = tot + f
                    acc_o = acc_o + f * ld_f32(attn_part_o + ((base + Int64(s)) * D + Int64(d)) * 4)
            st_f32(attn_out + ((Int64(layer) * self.B + Int64(b)) * self.Q + Int64(head * D + d)) * 4, acc_o / tot)

    @cute.jit
    def argmax(self, tidx: Int32, warp: Int32, lane: Int32, num_tiles: Int32, lm_max: Int64, lm_idx: Int64,
               out_tokens: Int64, tokens: Int64, positions: Int64, s_wv: cute.Tensor, s_wi: cute.Tensor):
        """Per sequence, the (max, lowest index among equal maxima) over the LM head tiles' results, then
        the next token is written and the inputs advanced. One thread per sequence scans the tiles, or
        (parallel_argmax) every thread takes some tiles and warps and then the CTA reduce them with the
        same comparison, which is associative: the same token either way."""
        if cutlass.const_expr(self.par_argmax):
            self.argmax_parallel(tidx, warp, lane, num_tiles, lm_max, lm_idx, out_tokens, tokens, positions, s_wv,
                                 s_wi)
        else:
            self.argmax_serial(tidx, num_tiles, lm_max, lm_idx, out_tokens, tokens, positions)

    @cute.jit
    def argmax_parallel(self, tidx: Int32, warp: Int32, lane: Int32, num_tiles: Int32, lm_max: Int64,
                        lm_idx: Int64, out_tokens: Int64, tokens: Int64, positions: Int64, s_wv: cute.Tensor,
                        s_wi: cute.Tensor):
        for b in cutlass.range_constexpr(self.B):
            bv, bi = self.scan_tiles(b, tidx, self.threads, num_tiles, lm_max, lm_idx)
            bv, bi = warp_max_index(bv, bi)
            if lane == 0:
                s_wv[warp * self.B + b] = bv
                s_wi[warp * self.B + b] = bi
        cute.arch.sync_threads()
        if tidx < self.B:
            _, ci = self.merge_warp_maxima(tidx, Float32(-math.inf), Int32(0x7FFFFFFF), s_wv, s_wi)
            self.emit_token(tidx, ci, out_tokens, tokens, positions)

    @cute.jit
    def argmax_serial(self, tidx: Int32, num_tiles: Int32, lm_max: Int64, lm_idx: Int64, out_tokens: Int64,
                      tokens: Int64, positions: Int64):
        if tidx < self.B:
            _, bi = self.scan_tiles(tidx, Int32(0), 1, num_tiles, lm_max, lm_idx)
            self.emit_token(tidx, bi, out_tokens, tokens, positions)

    @cute.jit
    def scan_tiles(self, b: Int32, t0: Int32, step: int, num_tiles: Int32, lm_max: Int64, lm_idx: Int64):
        """(max, lowest index among equal maxima) of sequence b over LM head tiles t0, t0 + step, ..."""
        bv = Float32(-math.inf)
        bi = Int32(0x7FFFFFFF)
        for t in range(t0, num_tiles, step):
            v = ld_f32(lm_max + (Int64(b) * self.T + Int64(t)) * 4)
            vi = ld_i32(lm_idx + (Int64(b) * self.T + Int64(t)) * 4)
            if v > bv or (v == bv and vi < bi):
                bv = v
                bi = vi
        return bv, bi

    @cute.jit
    def merge_warp_maxima(self, b: Int32, bv: Float32, bi: Int32, s_wv: cute.Tensor, s_wi: cute.Tensor):
        """(bv, bi) merged with every warp's (max, index) of sequence b in s_wv/s_wi (slot warp * B + b):
        the larger value, the lower index among equal ones."""
        for w in range(self.warps):
            v = s_wv[w * self.B + b]
            vi = s_wi[w * self.B + b]
            if v > bv or (v == bv and vi < bi):
                bv = v
                bi = vi
        return bv, bi

    @cute.jit
    def emit_token(self, b: Int32, token: Int32, out_tokens: Int64, tokens: Int64, positions: Int64):
        st_i32(out_tokens + Int64(b) * 4, token)
        # advance the inputs: the next launch decodes the token just chosen, one position on
        st_i32(tokens + Int64(b) * 4, token)
        st_i32(positions + Int64(b) * 4, ld_i32(positions + Int64(b) * 4) + 1)
