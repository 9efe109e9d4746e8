"""The persistent decode megakernel (core v2): one CTA per SM interprets its queue of fused-stage
instructions with 15 consumer warps (8 past SPLIT_BATCH), while a producer warp streams the queue's weights
ahead of them.

A CTA's warps:
  - the producer (the last warp, megakernel.kernel.stream) walks the whole queue at once and bulk-copies
    every matvec tile into a ring of shared-memory slots, throttled only by free slots: weights never wait
    for activations, so HBM streams through every dependency hop;
  - the consumers (warps 0 .. warps - 1) run the instructions in order. Before the first, they check once
    per step which sequences' new KV slots alias a slot of the step (scan_aliasing: block table and
    positions are step inputs). Per instruction:
      1. ATTN_PARTIAL copies its first cached token per warp by cp.async (the cache's history is an input);
      2. thread 0 spins (ld.acquire.gpu, bounded by globaltimer) until the counter it waits on reaches its
         epoch-relative target; a timeout writes the error word and aborts the CTA's queue, and so does an
         error word another CTA wrote (read every ERROR_POLL polls), so a failed step ends at once;
      3. the stage body (opcode dispatch by `if`, each body inlined once; megakernel.kernel.matvec,
         .attention, .tokens): a matvec stages its input, then takes its weights slot by slot from the ring
         and multiplies them on the tensor cores;
      4. after a consumer barrier, thread 0 signals its stage counter with red.release.gpu.
    At batch 1 on one GPU (instructions.flagged) the hops into x, h, act and qkv carry their own readiness:
    QKV, O_PROJ, GATE_UP, DOWN and EMBED store {value, epoch} words (st_flagged) and the stages in UNSIGNALLED
    signal nothing; those in POLLING (QKV but layer 0's of a folded embedding, GATE_UP, DOWN, LM_HEAD and
    ATTN_PARTIAL) wait on no counter and poll the words they read instead (staging.stage_round_polled,
    staging.poll_words; a timeout there is ERR_TIMEOUT with counter -1). A residual (O_PROJ's x, DOWN's h) is
    read after an acquire or a polled input that the residual's producer preceded. The attention's output hop
    (ATTN_PARTIAL -> O_PROJ) keeps its counter.
The consumers synchronise among themselves with named barrier 1 (the producer never joins it); all warps
meet at barrier 0 only at the start and at the end. The last CTA to finish advances the epoch, so counters
are never reset and a CUDA graph can replay steps with no host work.

After a failed step (the error word set: the first error wins) every launch runs no instruction and writes
nothing until the host acknowledges the error (MegakernelEngine.check or reset_sync); the first such launch
copies the error code to mapped host memory (MegakernelEngine.error_flag), for loops that never sync. The
launch is cooperative: every CTA resident at once, or the launch is refused.

Trace mode (KernelOptions.trace) records per instruction (stream.TRACE_WORDS): begin, counter ready, end
(consumer thread 0); for a matvec when its input was staged (and how long all its windows took), when consumer
warp 0 got its first and last weight slot and when the consumers were past the last; when the producer started and
finished issuing them, and the ring's waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64

from ..instructions.flagged import POLLING, UNSIGNALLED, flagged_hops
from ..instructions.layout import NARROW_WARPS, StepLayout, require_kernel_batch
from ..instructions.matvec_stages import weight_rows
from ..instructions.opcodes import Opcode
from ..instructions.attention import warp_attention
from ..instructions.record import (W_A0, W_A1, W_A2, W_A3, W_INDEX, W_K_PART, W_K_PARTS, W_LAYER, W_OPCODE, W_SEQS,
                                   W_SIGNAL_ID, W_WAIT_COUNT, W_WAIT_ID, WORDS)
from ..instructions.split_k import SPLIT_STAGES, k_splits, qkv_reduce_folded
from .attention import ERR_ALIAS, ERR_POSITION, LOG2E, AttentionStage  # noqa: F401  (error codes re-exported)
from .matvec import MatvecStage, opcode_in
from .matvec_wide import WideMatvec
from .ring_model import ring_readers
from .staging import POLL_WORD, InputStaging
from .ptx import (atomic_add_acq_rel, cp_async_wait_all, globaltimer_lo, ld_i32, ld_i64, load_acquire,
                  load_acquire_sys, load_relaxed, mbarrier_init, mbarrier_init_fence, red_release_add,
                  red_release_add_sys, report_error, st_i32, store_relaxed, store_system_nonzero)
from .stream import (ERR_RING, OP_TP_REDUCE, PEER_COUNTERS, PEER_WORDS, SLOT_BYTES, TRACE_WORDS,  # noqa: F401
                     HOP_WORD, RELEASE_LANES, WIDE_WARPS, StreamPlan, WeightStream, dense_opcode, is_matvec,
                     max_in_flight, wide, wide_groups)
from .stream import (TR_BEGIN, TR_CONSUMED, TR_END, TR_EPILOGUE, TR_LANDED_FIRST, TR_LANDED_LAST, TR_OP, TR_READY,
                     TR_REACHED_LAST, TR_SM, TR_STAGED, TR_STAGING, TR_WAIT_FREE, TR_WAIT_IN_FLIGHT,
                     TR_WAIT_LANDED)
from .tensor_parallel import ExchangeStages
from .tokens import ERR_TOKEN, TokenStages  # noqa: F401

# Error codes written to error[0] (the first error wins): 1 a counter wait timed out, 2 a position past the
# cache (attention), 3 a token outside the vocabulary (tokens), 4 a weight-ring wait timed out (stream), 5 a
# new token's KV slot that the step also reads or another sequence appends to (attention).
ERR_TIMEOUT = 1
ERROR_POLL = 16          # a counter wait reads the error word every this many polls

# Kernel arguments, in order: every one a global address (Int64).
ARG_NAMES = (
    "queue", "lengths",
    "w_embed", "w_qkv", "w_o", "w_gate_up", "w_down", "w_lm_head",
    "attn_norm", "mlp_norm", "final_norm", "ones", "q_norm", "k_norm", "rope_cos", "rope_sin",
    "tokens", "positions", "block_table",
    "x", "h", "qkv", "attn_part_o", "attn_part_lse", "attn_out", "act",
    "logits", "lm_max", "lm_idx", "out_tokens",
    "part_qkv", "part_o", "part_down",
    "x_wide", "h_wide", "attn_wide", "act_wide", "x_ssq", "h_ssq",
    "counters", "sync", "error", "kv_table", "trace", "host_error", "peers",
)


@dataclass(frozen=True)
class KernelOptions:
    trace: bool = False                      # record per-instruction globaltimer stamps (profiles/RESULTS.md
                                             # has what each measured)
    timeout_ns: int = 2_000_000_000          # bound on every spin: a step counter, a weight-ring slot
    # a diagnostic (wrong results, for timing only): the producer copies no weights, each slot completes at once
    # over zeroed shared memory, so a step takes what the dependency chain and the consumers' work take without
    # the weight stream (tools/gpu_sweep.py 'nocopy:diag_no_copy=1'; profiles/RESULTS.md, 2026-12-03)
    diag_no_copy: bool = False
    # a diagnostic (wrong results, for timing only): no matvec stage stages its input (each staging zeroes the
    # window instead), so a step takes what it takes without the consumers' input staging (up to SPLIT_BATCH) or
    # the bulk copies of the pre-staged input's windows (past it) (tools/gpu_sweep.py 'nostage:diag_no_stage=1';
    # docs/batch_path.md)
    diag_no_stage: bool = False
    # row groups each consumer warp owns per chunk past SPLIT_BATCH (0: stream.wide_groups(batch)): for an A/B
    # sweep
    wide_groups: int = 0
    # weight slots on their way at once per SM (0: stream.max_in_flight(batch, a layer's bytes per SM)): for an
    # A/B sweep
    max_in_flight: int = 0

    def __post_init__(self):
        if self.timeout_ns <= 0:
            raise ValueError(f"KernelOptions.timeout_ns={self.timeout_ns}: every wait needs a positive bound")
        if self.max_in_flight < 0:
            raise ValueError(f"KernelOptions.max_in_flight={self.max_in_flight}: 0 (by the batch and the layer's "
                             "bytes) or a number of weight slots")
        if self.wide_groups not in (0, 1, 2):
            raise ValueError(f"KernelOptions.wide_groups={self.wide_groups}: 0 (by the batch and tiles), 1 or 2 row "
                             "groups per consumer warp")

OP_EMBED, OP_ATTN_PARTIAL, OP_ATTN_REDUCE = int(Opcode.EMBED), int(Opcode.ATTN_PARTIAL), int(Opcode.ATTN_REDUCE)
OP_QKV, OP_O_PROJ, OP_GATE_UP, OP_DOWN = int(Opcode.QKV), int(Opcode.O_PROJ), int(Opcode.GATE_UP), int(Opcode.DOWN)
OP_LM_HEAD, OP_ARGMAX, OP_MV_REDUCE = int(Opcode.LM_HEAD), int(Opcode.ARGMAX), int(Opcode.MV_REDUCE)
SMEM_LIMIT = 227 * 1024


class Fields:
    """A read-only bag of named values for device code: the step's global addresses (`p`) or the CTA's
    shared-memory scratch (`s`), so a stage takes two arguments instead of thirty. (CuTe DSL takes a store
    through `s.name[i]` inside dynamic control flow for a change of `s` itself: stage code binds the
    tensors it writes to locals first, `s_x = s.x`.)"""

    def __init__(self, **values):
        self.__dict__.update(values)


class DecodeKernel(WeightStream, MatvecStage, WideMatvec, InputStaging, AttentionStage, TokenStages,
                   ExchangeStages):
    """Compiled once per (StepLayout, options): model shape, batch bucket, KV splits and cache geometry are
    compile-time constants; every address is a runtime argument."""

    def __init__(self, layout: StepLayout, lm_tiles: int, num_counters: int, max_queue_len: int,
                 kv_strides: tuple[int, int, int] | None = None, options: KernelOptions = KernelOptions()):
        layout.validate()
        require_kernel_batch(layout.batch)
        c = layout.config
        self.layout, self.options = layout, options
        self.num_sms = layout.num_sms
        self.max_queue_len = max_queue_len
        self.L, self.B, self.H = c.num_layers, layout.batch, c.hidden_size
        self.F, self.V = c.intermediate_size, c.vocab_size
        # the token ids the embedding takes: the whole vocabulary (a tensor-parallel rank's LM head has V / W rows)
        self.vocab = (getattr(layout, "full_config", None) or c).vocab_size
        self.Hq, self.Hkv, self.D, self.G = c.num_heads, c.num_kv_heads, c.head_dim, c.gqa_group
        self.Q, self.KV, self.QKV = c.q_size, c.kv_size, c.qkv_rows
        self.S = layout.kv_splits
        self.bs, self.max_blocks = layout.block_size, layout.max_blocks_per_seq
        # element strides of (block, offset, kv head) in a layer's K or V cache; contiguous
        # [num_blocks, block_size, Hkv, D] by default, vLLM's interleaved K|V layout when bound to it
        self.kv_sb, self.kv_st, self.kv_sh = kv_strides or (self.bs * self.Hkv * self.D, self.Hkv * self.D, self.D)
        self.max_seq_len = layout.max_seq_len
        self.scratch_block = layout.scratch_block   # -1: none (appends there skip the aliasing check)
        self.T = lm_tiles                         # LM head tiles' argmax slots (of every rank, tensor parallel)
        # tensor parallel (a ShardLayout): this rank and the world size; 1 rank otherwise
        self.W = getattr(layout, "world_size", 1)
        self.rank = getattr(layout, "rank", 0)
        self.num_counters = num_counters
        self.eps = float(c.rms_norm_eps)
        self.qk_norm = bool(c.qk_norm)
        self.E = self.D // 32                     # head elements per lane
        self.scale_log2 = LOG2E / math.sqrt(self.D)
        # 15 consumer warps up to SPLIT_BATCH: with the producer 16 warps, 4 per SM sub-partition, so 128
        # registers each (16 consumer warps, 17 in all, leave 96, and the kernel spills at some shapes). At batch
        # 5-8 with bf16 staged inputs the kernels fit them too (116-126 registers, no spills), and against 8 warps
        # there (H100, ms/step, 2026-12-06, profiles/RESULTS.md): qwen3-0.6b 0.908 / 0.941 at 8, llama-3.1-8b
        # 5.887 / 5.968 at 8, llama-3.2-1b 1.035 / 1.056 at 5, level at 8 (1.131 / 1.127). Past SPLIT_BATCH
        # WIDE_WARPS, each owning a row group of every chunk.
        self.warps = WIDE_WARPS if wide(self.B) else NARROW_WARPS
        self.cthreads = 32 * self.warps
        self.threads = self.cthreads + 32         # + the producer warp
        # the widths of the K ranges of the stages split over K (split_k.py; none up to SPLIT_BATCH)
        self.split_widths = {}
        for op in SPLIT_STAGES:
            e = k_splits(layout, op)
            if e > 1:
                self.split_widths[int(op)] = weight_rows(op, layout)[1] // e
        widest = max(-(-weight_rows(op, layout)[0] * k_splits(layout, op) // self.num_sms) for op in SPLIT_STAGES)
        self.wide_groups = self.options.wide_groups or wide_groups(self.B, widest)
        self.plan = StreamPlan.for_config(c, self.B, tuple(self.split_widths.values()), self.wide_groups)
        self.wide = wide(self.B)
        # batch 1, one GPU: x, h, act and qkv as {value, epoch} words (instructions.flagged); their consumers poll
        self.flagged = flagged_hops(layout)
        self.warp_attention = warp_attention(layout)
        self.qkv_folded = qkv_reduce_folded(layout)
        free = SMEM_LIMIT - self.smem_bytes(ring_slots=0)
        self.ring_slots = StreamPlan.ring_slots(free)
        self.in_flight = min(self.options.max_in_flight or max_in_flight(self.B, 2 * c.layer_params() // self.num_sms),
                             self.ring_slots)
        # the consumer warps that read ring parts up to SPLIT_BATCH (matvec_narrow): the most that divide the ring's
        # parts (ring_model.ring_readers); past it every warp reads every slot
        self.readers = self.warps if self.wide else ring_readers(self.ring_slots, self.plan.parts, self.warps)

    def tile_k(self, ins) -> int:
        """K of a matvec instruction's tile (host side, as tile_geometry gives it on the device): its stage's, or the
        width of its K range where the stage is split over K."""
        if ins.k_parts > 1:
            return self.split_widths[int(ins.opcode)]
        return weight_rows(ins.opcode, self.layout)[1]

    def scratch_words(self) -> dict[str, dict[str, int]]:
        """32-bit words of every shared-memory buffer but the ring, in allocation order, in three groups: the
        ones every stage may use, the matvec stages' and the attention stage's. The last two share one region
        (no instruction uses both, and a barrier ends every instruction), so the ring gets what either leaves."""
        W, G, D, B = self.warps, self.G, self.D, self.B
        NB = max(8, B)
        A = W if self.warp_attention else 1      # query and new-token buffers: one per warp, or the CTA's one
        return {"common": {"ctrl": 8, "xbar": 2, "alias": 4 * NB, "red": NB, "ired": NB, "wv": W * NB, "wi": W * NB,
                           "rstd": NB, "queue": self.max_queue_len * WORDS},
                "matvec": {"part": self.plan.part_floats, "x": self.plan.x_floats},
                "attention": {"q": G * D * A, "kv": 2 * D * A, "m": W * G, "l": W * G, "o": W * G * D, "pre": W * D}}

    @staticmethod
    def _padded_bytes(words: int) -> int:
        """Bytes of a buffer of `words` 32-bit words, rounded up to the 16-byte alignment of every buffer."""
        return (4 * words + 15) // 16 * 16

    @classmethod
    def _bytes(cls, words: dict[str, int]) -> int:
        return sum(cls._padded_bytes(w) for w in words.values())

    def smem_bytes(self, ring_slots: int | None = None) -> int:
        """Shared memory the kernel allocates (each buffer 16-byte aligned, the ring 128), as in `kernel`."""
        n = self.ring_slots if ring_slots is None else ring_slots
        g = self.scratch_words()
        scratch = self._bytes(g["common"]) + max(self._bytes(g["matvec"]), self._bytes(g["attention"]))
        return scratch + 128 + n * SLOT_BYTES + 2 * n * 8 + 16

    # ------------------------------------------------------------------ host entry
    @cute.jit
    def __call__(self, queue: Int64, lengths: Int64, w_embed: Int64, w_qkv: Int64, w_o: Int64,
                 w_gate_up: Int64, w_down: Int64, w_lm_head: Int64, attn_norm: Int64, mlp_norm: Int64,
                 final_norm: Int64, ones: Int64, q_norm: Int64, k_norm: Int64, rope_cos: Int64,
                 rope_sin: Int64, tokens: Int64, positions: Int64, block_table: Int64, x: Int64, h: Int64,
                 qkv: Int64, attn_part_o: Int64, attn_part_lse: Int64, attn_out: Int64, act: Int64,
                 logits: Int64, lm_max: Int64, lm_idx: Int64, out_tokens: Int64, part_qkv: Int64,
                 part_o: Int64, part_down: Int64, x_wide: Int64, h_wide: Int64,
                 attn_wide: Int64, act_wide: Int64, x_ssq: Int64, h_ssq: Int64, counters: Int64,
                 sync: Int64, error: Int64, kv_table: Int64, trace: Int64, host_error: Int64,
                 peers: Int64, stream):
        self.kernel(queue, lengths, w_embed, w_qkv, w_o, w_gate_up, w_down, w_lm_head, attn_norm, mlp_norm,
                    final_norm, ones, q_norm, k_norm, rope_cos, rope_sin, tokens, positions, block_table,
                    x, h, qkv, attn_part_o, attn_part_lse, attn_out, act, logits, lm_max, lm_idx, out_tokens,
                    part_qkv, part_o, part_down, x_wide, h_wide, attn_wide, act_wide, x_ssq, h_ssq,
                    counters, sync, error, kv_table, trace, host_error, peers).launch(
            grid=[self.num_sms, 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            # every CTA resident at once, or the launch is refused: the CTAs spin on each other's counters
            cooperative=True)

    # ------------------------------------------------------------------ device: shared helpers
    @cute.jit
    def peer_address(self, p, r: int, word: Int32) -> Int64:
        """Rank r's buffer `word` (stream.PEER_RECV_O ...) from the peer table (tensor parallel)."""
        return ld_i64(p.peers + (Int64(r * PEER_WORDS) + Int64(word)) * 8)

    @cute.jit
    def wait_load(self, caddr: Int64) -> Int32:
        """A counter wait's acquire load: at system scope for a tensor-parallel rank, whose exchange counters
        other GPUs signal (the peers' stores into this rank's buffers are then visible), else at GPU scope."""
        if cutlass.const_expr(self.W > 1):
            return load_acquire_sys(caddr)
        return load_acquire(caddr)

    @cute.jit
    def consumer_sync(self):
        """Barrier of the consumer warps alone (named barrier 1; the producer warp never waits on it)."""
        cute.arch.barrier(barrier_id=1, number_of_threads=self.cthreads)

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
               logits: Int64, lm_max: Int64, lm_idx: Int64, out_tokens: Int64, part_qkv: Int64,
               part_o: Int64, part_down: Int64, x_wide: Int64, h_wide: Int64,
               attn_wide: Int64, act_wide: Int64, x_ssq: Int64, h_ssq: Int64, counters: Int64,
               sync: Int64, error: Int64, kv_table: Int64, trace: Int64, host_error: Int64, peers: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        sm, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        p = Fields(w_embed=w_embed, w_qkv=w_qkv, w_o=w_o, w_gate_up=w_gate_up, w_down=w_down,
                   w_lm_head=w_lm_head, attn_norm=attn_norm, mlp_norm=mlp_norm, final_norm=final_norm, ones=ones,
                   q_norm=q_norm, k_norm=k_norm, rope_cos=rope_cos, rope_sin=rope_sin, tokens=tokens,
                   positions=positions, block_table=block_table, x=x, h=h, qkv=qkv, attn_part_o=attn_part_o,
                   attn_part_lse=attn_part_lse, attn_out=attn_out, act=act, logits=logits, lm_max=lm_max,
                   lm_idx=lm_idx, out_tokens=out_tokens, part_qkv=part_qkv, part_o=part_o,
                   part_down=part_down, x_wide=x_wide, h_wide=h_wide,
                   attn_wide=attn_wide, act_wide=act_wide, x_ssq=x_ssq, h_ssq=h_ssq, error=error,
                   kv_table=kv_table, peers=peers)

        smem = cutlass.utils.SmemAllocator()
        types = {"wi": Int32, "ired": Int32, "ctrl": Int32, "xbar": Int32, "alias": Int32, "queue": Int32}
        groups = self.scratch_words()
        bufs = {name: smem.allocate_tensor(types.get(name, cutlass.Float32), cute.make_layout((words,)),
                                           byte_alignment=16)
                for name, words in groups["common"].items()}
        # the matvec and attention buffers: one region, carved twice
        union = max(self._bytes(groups["matvec"]), self._bytes(groups["attention"]))
        region = smem.allocate_tensor(cutlass.Float32, cute.make_layout((union // 4,)), byte_alignment=16)
        for group in ("matvec", "attention"):
            off = 0
            for name, words in groups[group].items():
                bufs[name] = cute.make_tensor(region.iterator + off, cute.make_layout((words,)))
                off += self._padded_bytes(words) // 4
        s_ring = smem.allocate_tensor(Int32, cute.make_layout((self.ring_slots * SLOT_BYTES // 4,)),
                                      byte_alignment=128)
        s_bar = smem.allocate_tensor(Int64, cute.make_layout((2 * self.ring_slots,)), byte_alignment=8)
        s = Fields(x_addr=Int32(bufs["x"].iterator.toint()), pre_addr=Int32(bufs["pre"].iterator.toint()),
                   xbar_addr=Int32(bufs["xbar"].iterator.toint()), **bufs)
        s_ctrl, s_queue = bufs["ctrl"], bufs["queue"]   # epoch, abort, queue length, stop, input copies, hop, poll
        ring = Int32(s_ring.iterator.toint())
        full = Int32(s_bar.iterator.toint())                 # ring_slots full barriers, then the empty ones
        empty = full + self.ring_slots * 8
        abort_addr = Int32(s_ctrl.iterator.toint()) + 4

        if tidx == 0:
            for j in range(self.ring_slots):
                mbarrier_init(full + j * 8, Int32(1))                # the producer's arrive + the copy bytes
                # every lane of each part's reader warp; past SPLIT_BATCH of every consumer warp, which passes
                # every slot
                mbarrier_init(empty + j * 8, Int32((self.warps if self.wide else self.plan.parts) * RELEASE_LANES))
            # past SPLIT_BATCH: the mbarrier of the pre-staged inputs' bulk copies (matvec_wide.input_window); s_ctrl[4]
            # counts the copies completed on it
            mbarrier_init(s.xbar_addr, Int32(1))
            mbarrier_init_fence()
            s_ctrl[0] = ld_i32(sync)
            s_ctrl[1] = Int32(0)
            s_ctrl[3] = Int32(0)
            s_ctrl[4] = Int32(0)
            s_ctrl[HOP_WORD] = Int32(0)   # 1 while the consumers cross a hop (stream.HOP_IN_FLIGHT)
            s_ctrl[POLL_WORD] = Int32(0)  # 1 once a poll of a flagged input timed out (staging: stage_round_polled,
                                          # poll_words)
        s_alias = bufs["alias"]          # per sequence: 1 where its new KV slot aliases (scan_aliasing)
        for b in range(tidx, self.B, self.threads):
            s_alias[b] = Int32(0)
        n = ld_i32(lengths + Int64(sm) * 4)
        failed = ld_i32(error)
        if failed != 0:
            # an error the host has not acknowledged (MegakernelEngine.check / reset_sync): this launch runs
            # no instruction and writes nothing, so a graph replay after a failed step cannot read or write
            # the KV cache with counters behind the epoch, nor wait out a timeout per counter
            n = Int32(0)
        if tidx == 0 and sm == 0:
            # the error code to mapped host memory, which a serving loop reads without a device sync
            # (MegakernelEngine.error_flag): the launch after the failed one writes it
            store_system_nonzero(host_error, failed)
        if tidx == 0:
            s_ctrl[2] = n        # the loop reads the queue length from here (a register less across it)
            if cutlass.const_expr(self.options.trace):
                # the physical SM this CTA runs on, once, in its first record (no other stamp writes that word)
                st_i32(self.trace_record(trace, sm, Int32(0)) + TR_SM * 4, Int32(cute.arch.smid()))
        qbase = queue + Int64(sm) * (self.max_queue_len * WORDS * 4)
        for wi in range(tidx, n * WORDS, self.threads):
            s_queue[wi] = ld_i32(qbase + Int64(wi) * 4)
        if cutlass.const_expr(self.options.diag_no_copy):
            for wi in range(tidx, self.ring_slots * SLOT_BYTES // 4, self.threads):
                s_ring[wi] = Int32(0)          # the slots are never written: zero weights, finite results
        cute.arch.sync_threads()

        if warp == self.warps:
            self.produce(lane, sm, s_queue, n, ring, full, empty, abort_addr, w_qkv, w_o, w_gate_up, w_down,
                         w_lm_head, error, trace)
        else:
            self.consume(tidx, warp, lane, sm, s_queue, ring, full, empty, counters, error, trace, p, s)
        cute.arch.sync_threads()

        # ---- the last CTA out advances the epoch for the next step
        if tidx == 0:
            done = atomic_add_acq_rel(sync + 4, Int32(1))
            if done == self.num_sms - 1:
                store_relaxed(sync + 4, Int32(0))
                store_relaxed(sync, s_ctrl[0] + 1)

    @cute.jit
    def consume(self, tidx: Int32, warp: Int32, lane: Int32, sm: Int32, s_queue: cute.Tensor, ring: Int32,
                full: Int32, empty: Int32, counters: Int64, error: Int64, trace: Int64, p, s):
        """The consumer warps' loop over the queue (the module docstring's steps 1-4)."""
        s_ctrl = s.ctrl
        self.scan_aliasing(tidx, p, s)    # (read by attention after the barrier of its wait)
        k_slot = Int32(0)        # weight slots this CTA's consumers have taken from the ring so far
        i = Int32(0)
        # Loop state in shared memory, not registers: s_ctrl[2] the queue length, s_ctrl[3] the stop flag.
        # Thread 0 sets s_ctrl[1] on a failed wait, before the barrier after the wait, and copies it to
        # s_ctrl[3] between that barrier and the one ending the instruction, so every consumer thread reads
        # the same stop flag at the top of the next iteration (and the producer stops issuing).
        while i < s_ctrl[2] and s_ctrl[3] == 0:
            ins = i * WORDS
            op = s_queue[ins + W_OPCODE]
            xch = Int32(0)            # a tensor-parallel exchange stage (its stores and signal go to every rank)
            if cutlass.const_expr(self.W > 1):
                op, xch = dense_opcode(op)
            layer = s_queue[ins + W_LAYER]
            a0 = s_queue[ins + W_A0]
            a1 = s_queue[ins + W_A1]
            a2 = s_queue[ins + W_A2]
            a3 = s_queue[ins + W_A3]
            t_begin = Int32(0)
            t_ready = Int32(0)
            if cutlass.const_expr(self.options.trace):
                t_begin = globaltimer_lo()
            # batch 1 on one GPU: the RoPE and QK-norm factors of the attention head a warp finishes, loaded before the
            # wait (attn_preload), so that the polled q, k and v are the only loads of phase A after it (H100,
            # 2026-12-07: qwen3-0.6b 1 -1.6% at 32 positions, -2.6% at 200; the llama shapes level at batch 1;
            # qwen3-0.6b 8 +0.7% with them: not past batch 1; profiles/RESULTS.md)
            rope = None
            if cutlass.const_expr(self.flagged):
                rope = self.rope_registers()
            if cutlass.const_expr(not self.warp_attention):
                if op == OP_ATTN_PARTIAL:
                    self.attn_preload(warp, lane, layer, a0, a1, a2, a3, p, s, rope)

            # ---- wait for the producing stage (thread 0 spins, the consumer barrier broadcasts)
            wait_id = s_queue[ins + W_WAIT_ID]
            polled = Boolean(False)       # flagged hops: the stage polls its input's words instead
            if cutlass.const_expr(self.flagged):
                polled = opcode_in(op, POLLING, a3 == 1)    # (a3 == 1: layer 0's QKV of a folded embedding)
            if tidx == 0 and wait_id >= 0 and not polled:
                target = (s_ctrl[0] + 1) * s_queue[ins + W_WAIT_COUNT]
                caddr = counters + Int64(wait_id) * 4
                seen = self.wait_load(caddr)
                t0 = cute.arch.globaltimer()
                ok = Boolean(True)
                spins = Int32(0)
                while seen - target < 0 and ok:
                    seen = self.wait_load(caddr)
                    spins = spins + 1
                    if spins % ERROR_POLL == 0:
                        # another CTA failed (its signal may never come): abort now, not at the timeout
                        if load_relaxed(error) != 0:
                            ok = Boolean(False)
                    if cute.arch.globaltimer() - t0 > self.options.timeout_ns:
                        ok = Boolean(False)
                if not ok:
                    report_error(error, Int32(ERR_TIMEOUT), s_queue[ins + W_INDEX], wait_id, seen)
                    s_ctrl[1] = Int32(1)
            self.consumer_sync()
            aborted = s_ctrl[1]
            if tidx == 0:
                s_ctrl[3] = aborted
            if cutlass.const_expr(self.options.trace):
                t_ready = globaltimer_lo()

            if aborted == 0:
                rec = Int64(0)
                if cutlass.const_expr(self.options.trace):
                    rec = self.trace_record(trace, sm, i)
                if is_matvec(op):
                    k_slot = self.matvec(tidx, warp, lane, op, xch, layer, a0, a1, a2, a3, s_queue[ins + W_K_PART],
                                         s_queue[ins + W_K_PARTS], k_slot, ring, full, empty, p, s, rec)
                else:
                    if op == OP_EMBED:
                        self.embed(tidx, s_queue[ins + W_INDEX], a0, a1, p, s_ctrl[0] + 1)
                    if op == OP_ATTN_PARTIAL:
                        self.attn_partial(tidx, warp, lane, layer, a0, a1, a2, a3, s_queue[ins + W_SEQS],
                                          s_queue[ins + W_INDEX], p, s, rec, rope)
                    if op == OP_ATTN_REDUCE:
                        self.attn_reduce(tidx, layer, a0, a1, a3, p)
                    if op == OP_ARGMAX:
                        self.argmax(warp, lane, a0, p)
                    if cutlass.const_expr(self.W > 1):
                        if op == OP_TP_REDUCE:
                            self.tp_reduce(tidx, layer, a0, a1, a3, p)
                    if cutlass.const_expr(len(self.split_widths) > 0):
                        if op == OP_MV_REDUCE:
                            self.mv_reduce(tidx, layer, a0, a1, a2, a3, p, rec)

            # ---- signal: every consumer's stores precede the barrier; the release orders them
            self.consumer_sync()
            signal_id = s_queue[ins + W_SIGNAL_ID]
            unsignalled = Boolean(False)  # flagged hops: what these stages write is polled, not waited on
            if cutlass.const_expr(self.flagged):
                unsignalled = opcode_in(op, UNSIGNALLED, Boolean(False))   # (layer 0's QKV stores qkv too)
                if tidx == 0 and s_ctrl[POLL_WORD] != 0:
                    # a poll of the stage's flagged input timed out or saw another CTA's error
                    # (staging.stage_round_polled, poll_words): no signal, the loop stops; the error word names the
                    # instruction, no counter (-1) and the epoch it polled for
                    report_error(error, Int32(ERR_TIMEOUT), s_queue[ins + W_INDEX], Int32(-1), s_ctrl[0] + 1)
                    s_ctrl[1] = Int32(1)
            if tidx == 0 and s_ctrl[1] == 0 and signal_id >= 0 and not unsignalled:
                if xch != 0:
                    # an exchange stage's signal lands on that counter of every rank, itself included
                    for r in cutlass.range_constexpr(self.W):
                        red_release_add_sys(self.peer_address(p, r, Int32(PEER_COUNTERS)) + Int64(signal_id) * 4,
                                            Int32(1))
                else:
                    red_release_add(counters + Int64(signal_id) * 4, Int32(1))
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    rec = self.trace_record(trace, sm, i)
                    st_i32(rec + TR_OP * 4, s_queue[ins + W_INDEX] * 256 + op)
                    st_i32(rec + TR_BEGIN * 4, t_begin)
                    st_i32(rec + TR_READY * 4, t_ready)
                    st_i32(rec + TR_END * 4, globaltimer_lo())
                    if not is_matvec(op):
                        # (a matvec stamps these itself; MV_REDUCE, and past SPLIT_BATCH ATTN_PARTIAL, their phases
                        # in TR_STAGED and TR_CONSUMED)
                        if op != OP_MV_REDUCE and (op != OP_ATTN_PARTIAL or not self.wide):
                            st_i32(rec + TR_STAGED * 4, Int32(0))
                            st_i32(rec + TR_CONSUMED * 4, Int32(0))
                        for w in (TR_LANDED_FIRST, TR_LANDED_LAST, TR_WAIT_FREE, TR_WAIT_IN_FLIGHT, TR_WAIT_LANDED,
                                  TR_EPILOGUE, TR_REACHED_LAST, TR_STAGING):
                            st_i32(rec + w * 4, Int32(0))
            i = i + 1
        # no K/V copy is left in flight when the CTA exits: an instruction that aborted after its copies
        # never waited for them
        cp_async_wait_all()
