"""Device code of ATTN_PARTIAL and ATTN_REDUCE on the consumer warps, and the split merge that O_PROJ's
input staging uses where the layout folds ATTN_REDUCE into it.

The records, split ranges and torch references are in megakernel.instructions.attention. ATTN_PARTIAL:
  A. the group's query heads and the new token's k, v (QK-norm, RoPE) into shared memory; the last split
     appends k, v to the paged cache unless that breaks the aliasing rule (`scan_aliasing`, once a step); at
     batch 1 on one GPU the norm weights and RoPE factors were loaded before the wait (softmax_pass.attn_preload);
  B. an online softmax over the split's cached tokens (the new token last): softmax_pass.py;
  C. the warps' (max, sum, output) merged and the split's partial (output, log-sum-exp) written.
Past SPLIT_BATCH with one split and more (sequence, kv head) pairs than SMs
(instructions.attention.warp_attention) an ATTN_PARTIAL takes several sequences, the consumer warps shared out among
them (`attend_sequences`: 2 a sequence at batch 64 on the presets): a CTA-wide item there is ~4 us of dependent round
trips and barriers for ~30 tokens, and a layer at batch 64 put ~4 of them on each SM in series (20 us a layer on
llama-3.2-1b; 7 with a warp each).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..instructions.attention import sequence_groups
from ..instructions.layout import wide_x_byte
from ..instructions.opcodes import Opcode
from ..instructions.split_k import k_splits
from .ptx import (cp_async_wait_all, ex2, globaltimer_lo, ld_f32, ld_i32, ld_i64, lg2, load_f32x4,
                  report_error, round_bf16, rsqrt, st_bf16, st_f32, st_i32, warp_sum)
from .softmax_pass import LOG2E, STREAM_ELEMS, WARP_UNROLL, SoftmaxPass
from .stream import TR_CONSUMED, TR_STAGED

MERGE_GROUP = 4            # attention splits whose partials one merge holds in registers at once
ERR_POSITION = 2
ERR_ALIAS = 5           # a new token's KV slot is one this step reads or another sequence appends to
ALIAS_UNROLL = 4        # block-table entries per thread whose loads the aliasing scan issues together


class AttentionStage(SoftmaxPass):
    """Consumer-side attention (a mixin of the interpreter)."""

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
    def scan_aliasing(self, tidx: Int32, p, s):
        """s.alias[b] = 1 for every sequence b whose new token (position pos[b], its slot through b's table) would
        overwrite a slot this step reads (a position < pos[o] of any sequence o, through o's table) or one another
        sequence appends to: check_block_aliasing's rule, which the last split of b's attention then enforces (it
        writes no K/V and reports ERR_ALIAS), on every path that launches. Block table and positions are step
        inputs, so the consumers run it once per step, before their first instruction (while the first weight
        slots land); the thread's share of the table entries that the rule reads (pos[o] // block_size + 1 of
        sequence o), ALIAS_UNROLL loads in flight together. A position outside the cache reads and appends nothing
        (attention reports it); appends into the layout's scratch block (vLLM's null block, where its padded rows
        write) are exempt. s.alias starts zeroed; a thread only ever writes 1 there."""
        B, bs, MB = self.B, self.bs, self.max_blocks
        NB = max(8, B)
        s_alias = s.alias        # [0, B): the verdicts; then per sequence o: pos[o], entries read, append block
        for o in range(tidx, B, self.cthreads):
            po = ld_i32(p.positions + o * 4)
            nb = Int32(0)           # table entries of sequence o that the rule reads
            blk = Int32(-1)         # the block sequence o appends into (-1: checks nothing)
            if po >= 0 and po < self.max_seq_len:
                nb = po // bs + 1
                blk = ld_i32(p.block_table + (Int64(o) * MB + Int64(po // bs)) * 4)
                if blk == self.scratch_block:
                    blk = Int32(-1)
            s_alias[NB + o] = po
            s_alias[2 * NB + o] = nb
            s_alias[3 * NB + o] = blk
        self.consumer_sync()
        for o in range(B):
            pt = s_alias[NB + o]
            n_o = s_alias[2 * NB + o]
            for j0 in range(tidx, n_o, self.cthreads * ALIAS_UNROLL):
                entries = cute.make_rmem_tensor((ALIAS_UNROLL,), Int32)
                for u in cutlass.range_constexpr(ALIAS_UNROLL):      # the round's loads first
                    entries[u] = Int32(-1)
                    j = j0 + u * self.cthreads
                    if j < n_o:
                        entries[u] = ld_i32(p.block_table + (Int64(o) * MB + Int64(j)) * 4)
                for u in cutlass.range_constexpr(ALIAS_UNROLL):
                    j = j0 + u * self.cthreads
                    if j < n_o:
                        for b in range(B):
                            t = j * bs + s_alias[NB + b] % bs     # o's position that this entry maps to b's slot
                            if entries[u] == s_alias[3 * NB + b] and (t < pt or (t == pt and o != b)):
                                s_alias[b] = Int32(1)

    @cute.jit
    def load_head(self, hh: Int32, lane: Int32, kvh: Int32, row: Int64, vals: cute.Tensor, at: int,
                  scale: Float32, p, s):
        """This lane's E elements of the new token's query head hh < G of the kv head's group, its k (hh == G) or
        its v (G + 1), from the qkv row, into vals[at:]; where QKV's reduce is folded into the attention
        (qkv_folded), `row` is the sequence's row of QKV's first K range's partials, and each element is the sum of
        its ranges' partials in range order, times `scale` (qkv_scale); where the hops are flagged
        (instructions.flagged), the row's {value, epoch} words polled until each is this step's."""
        D, E, G = self.D, self.E, self.G
        off = Int32(0)
        if hh < G:
            off = (kvh * G + hh) * D
        if hh == G:
            off = Int32(self.Q) + kvh * D
        if hh == G + 1:
            off = Int32(self.Q + self.KV) + kvh * D
        if cutlass.const_expr(self.qkv_folded):
            NP = k_splits(self.layout, Opcode.QKV)
            parts = cute.make_rmem_tensor((E * NP,), Float32)
            for e in cutlass.range_constexpr(E):
                for r in cutlass.range_constexpr(NP):
                    parts[e * NP + r] = ld_f32(row + (Int64(r) * (self.B * self.QKV) + Int64(off + lane * E + e)) * 4)
            for e in cutlass.range_constexpr(E):
                y = Float32(0.0)
                for r in cutlass.range_constexpr(NP):
                    y = y + parts[e * NP + r]
                vals[at + e] = y * scale
        elif cutlass.const_expr(self.flagged):
            self.poll_words(row + Int64(off + lane * E) * 8, E, vals, at, p, s)
        else:
            for e in cutlass.range_constexpr(E):
                vals[at + e] = ld_f32(row + Int64(off + lane * E + e) * 4)

    @cute.jit
    def finish_head(self, hh: Int32, lane: Int32, layer: Int32, kvh: Int32, pos: Int32, blk: Int32, k_base: Int64,
                    v_base: Int64, append: cutlass.Boolean, vals: cute.Tensor, at: int, q_at: Int32, kv_at: Int32,
                    p, s, rope=None):
        """Head hh of load_head's vals[at:] (QK-norm, RoPE at pos): the query into s.q from element q_at, k and v
        rounded to bf16 into s.kv from element kv_at and, where `append`, into the paged cache (block blk). (A
        step with a bad position or an aliased slot writes no cache slot: the error is raised, the cache kept.)
        The norm weights and RoPE factors (rope_factors) are loaded here, after the wait, or at batch 1 on one GPU
        come in `rope`: attn_preload loaded them before the wait, for head hh = the warp."""
        s_kv, s_q = s.kv, s.q
        D, E, G = self.D, self.E, self.G
        f = rope                  # (hh is then the warp's one head: attend_split)
        if cutlass.const_expr(rope is None):
            f = cute.make_rmem_tensor((3 * E,), Float32)
            if hh <= G:
                self.rope_factors(hh, lane, layer, pos, p, f)
        if cutlass.const_expr(self.qk_norm):
            if hh <= G:
                ssq = Float32(0.0)
                for e in cutlass.range_constexpr(E):
                    ssq = ssq + vals[at + e] * vals[at + e]
                ssq = warp_sum(ssq)
                r = rsqrt(ssq / Float32(D) + Float32(self.eps))
                for e in cutlass.range_constexpr(E):
                    vals[at + e] = vals[at + e] * r * f[e]
        if hh <= G:
            for e in cutlass.range_constexpr(E):
                partner = cute.arch.shuffle_sync_bfly(vals[at + e], offset=16)
                rot = vals[at + e] * f[E + e] + partner * f[2 * E + e]
                if lane < 16:
                    rot = vals[at + e] * f[E + e] - partner * f[2 * E + e]
                vals[at + e] = rot
        if hh < G:
            for e in cutlass.range_constexpr(E):
                s_q[q_at + hh * D + lane * E + e] = vals[at + e]
        else:
            cache = k_base
            if hh == G + 1:
                cache = v_base
            for e in cutlass.range_constexpr(E):
                rv = round_bf16(vals[at + e])
                s_kv[kv_at + (hh - G) * D + lane * E + e] = rv
                if append:
                    st_bf16(cache + (self.token_offset(blk, kvh, pos) + Int64(lane * E + e)) * 2, rv)

    def qkv_row(self, layer: Int32, b: Int32, p) -> Int64:
        """Address of sequence b's qkv row of a layer (float32, QKV's output; {value, epoch} words where the hops
        are flagged); where QKV's reduce is folded into the attention, of its row of the layer's first K range's
        partials (part_qkv [L, E, B, rows])."""
        if cutlass.const_expr(self.qkv_folded):
            NP = k_splits(self.layout, Opcode.QKV)
            return p.part_qkv + ((Int64(layer) * NP * self.B + Int64(b)) * self.QKV) * 4
        return p.qkv + (Int64(layer) * self.B + Int64(b)) * (self.QKV * (8 if self.flagged else 4))

    @cute.jit
    def qkv_scale(self, lane: Int32, layer: Int32, b: Int32, p) -> Float32:
        """Where QKV's reduce is folded into the attention: sequence b's RMS scale of x[layer], from its sums of
        squares (x_ssq) by the reduce's own sum (matvec_wide.ssq_sum over lanes 0 .. ssq_threads() - 1), so the
        same bits; every lane gets lane 0's. 1 elsewhere."""
        scale = Float32(1.0)
        if cutlass.const_expr(self.qkv_folded):
            _, ssq = self.wide_source(int(Opcode.QKV), layer, p)          # (x_ssq[layer]: f32 [B, H / 8])
            row = ssq + Int64(b) * (self.H // 8 * 4)
            tot = cute.arch.shuffle_sync(self.ssq_sum(row, lane, lane < self.ssq_threads()), 0)
            scale = rsqrt(tot / Float32(self.H) + Float32(self.eps))
        return scale

    @cute.jit
    def new_token_setup(self, lead: cutlass.Boolean, layer: Int32, b: Int32, last: cutlass.Boolean, index: Int32,
                        p, s):
        """Sequence b's position (0 where it is out of range), whether the new token's k and v go to the cache
        (the last split, a good position, no aliasing: s.alias[b], scan_aliasing), the layer's K and V base
        addresses and the new token's cache block. `lead` reports a bad position (ERR_POSITION) or an aliased
        slot of the last split (ERR_ALIAS), naming the instruction and the sequence."""
        pos = ld_i32(p.positions + Int64(b) * 4)
        bad = pos < 0 or pos >= self.max_seq_len
        aliased = s.alias[b]
        # one report for both errors (a second atomic's block cost spilled registers)
        code = Int32(0)
        if aliased != 0 and last:
            code = Int32(ERR_ALIAS)
        if bad:
            code = Int32(ERR_POSITION)
        if code != 0 and lead:
            report_error(p.error, code, index, b, pos)
        if bad:
            pos = Int32(0)
        # the layer's K and V base addresses (a device table, so a bound cache can move without a
        # recompile or a new CUDA graph); element offset of (block, offset, kv head) from the strides
        k_base = ld_i64(p.kv_table + Int64(layer) * 16)
        v_base = ld_i64(p.kv_table + Int64(layer) * 16 + 8)
        # the new token's cache block: loaded now, its slot address computed where the last split appends, so
        # the load's round trip runs beside phase A's instead of before it
        blk = ld_i32(p.block_table + (Int64(b) * self.max_blocks + Int64(pos // self.bs)) * 4)
        append = last and not bad and aliased == 0
        return pos, append, k_base, v_base, blk

    @cute.jit
    def attn_partial(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32,
                     split: Int32, num_splits: Int32, seqs: Int32, index: Int32, p, s, rec: Int64, rope=None):
        """The instruction's phases A-C (the module docstring); s.alias[b] = 1 (scan_aliasing): the last split
        writes no K/V and reports ERR_ALIAS. With KernelOptions.trace past SPLIT_BATCH, the ends of phases A and B
        in its trace record (rec: TR_STAGED, TR_CONSUMED; at batch 1-8 the stamps' registers would spill). Where
        the layout has warp_attention, `seqs` sequences from b, the consumer warps shared out among them
        (attend_sequences). `rope` (batch 1 on one GPU, else None): the QK-norm and RoPE factors of the warp's
        head, loaded before the wait (attn_preload)."""
        if cutlass.const_expr(self.warp_attention):
            self.attend_sequences(tidx, warp, lane, layer, b, kvh, seqs, index, p, s, rec)
        else:
            self.attend_split(tidx, warp, lane, layer, b, kvh, split, num_splits, index, p, s, rec, rope)

    @cute.jit
    def attend_split(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32,
                     split: Int32, num_splits: Int32, index: Int32, p, s, rec: Int64, rope=None):
        """One (sequence, kv head, split) on all the consumer warps: phases A-C of the module docstring."""
        D, G = self.D, self.G
        # (phase A takes one head a warp, G + 2 <= warps: the G query heads of a kv head are at most ROW_GROUP)
        assert rope is None or G + 2 <= self.warps, "a warp's preloaded RoPE factors are of one head"
        last = split == num_splits - 1
        pos, append, k_base, v_base, blk = self.new_token_setup(tidx == 0, layer, b, last, index, p, s)
        row = self.qkv_row(layer, b, p)
        scale = self.qkv_scale(lane, layer, b, p)

        # ---- phase A: q heads of the group, then k, then v of the new token -> smem
        for hh in range(warp, G + 2, self.warps):
            vals = cute.make_rmem_tensor((self.E,), Float32)
            self.load_head(hh, lane, kvh, row, vals, 0, scale, p, s)
            self.finish_head(hh, lane, layer, kvh, pos, blk, k_base, v_base, append, vals, 0, Int32(0), Int32(0), p, s,
                             rope)
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace and self.wide):
            if tidx == 0:
                st_i32(rec + TR_STAGED * 4, globaltimer_lo())

        lo, hi = self.split_bounds(pos, split, num_splits)
        if self.long_split(lo, hi):
            # ---- phase B, more tokens than warps (a long context): several tokens per warp at a time
            cp_async_wait_all()               # (the per-warp pass's copies, if any: this pass reads the cache itself)
            if cutlass.const_expr(self.wide):
                self.attend_streamed(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)
            else:
                self.attend_mma(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)
        else:
            # ---- phase B, at most a token per warp: the first copied before the wait
            self.attend_per_warp(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)

        # ---- phase C: merge the warps' (m, l, o) and write the split's partial
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace and self.wide):
            if tidx == 0:
                st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
        for t in range(tidx, G * D, self.cthreads):
            g = t // D
            self.merge_warps(0, self.warps, g, t - g * D, layer, b, kvh, split, p, s)

    @cute.jit
    def merge_warps(self, w0, nw: int, g: Int32, d: Int32, layer: Int32, b: Int32, kvh: Int32, split: Int32, p, s):
        """Phase C for element d of query head g of the kv head's group: the (m, l, o) states of warps w0 .. w0 +
        nw - 1 (s.m, s.l, s.o) merged, the split's partial output and, for d = 0, its log-sum-exp written (and,
        past SPLIT_BATCH with a single split, O_PROJ's pre-staged input); a split with no token (every state's max
        -inf) writes output 0 and lse -inf."""
        s_l, s_m, s_o = s.l, s.m, s.o
        D, G = self.D, self.G
        mx = Float32(-math.inf)
        for w in cutlass.range_constexpr(nw):
            mw = s_m[(w0 + w) * G + g]
            if mw > mx:
                mx = mw
        tot = Float32(0.0)
        acc_o = Float32(0.0)
        if mx > Float32(-math.inf):
            for w in cutlass.range_constexpr(nw):
                f = ex2(s_m[(w0 + w) * G + g] - mx)
                tot = tot + s_l[(w0 + w) * G + g] * f
                acc_o = acc_o + s_o[((w0 + w) * G + g) * D + d] * f
        head = kvh * G + g
        pidx = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S + Int64(split)
        outv = Float32(0.0)
        lse = Float32(-math.inf)
        if tot > Float32(0.0):
            outv = acc_o / tot
            lse = (mx + lg2(tot)) * Float32(1.0 / LOG2E)
        st_f32(p.attn_part_o + (pidx * D + Int64(d)) * 4, outv)
        if cutlass.const_expr(self.wide and self.layout.fused_reduce):
            # (past SPLIT_BATCH, a single split: its output is O_PROJ's input, pre-staged here for its bulk copy)
            self.store_attention_wide(layer, b, head * D + d, outv, p)
        if d == 0:
            st_f32(p.attn_part_lse + pidx * 4, lse)

    def sequence_warps(self) -> int:
        """Consumer warps per sequence of an attend_sequences instruction: those an instruction of the layout's
        most sequences leaves to each (2 at batch 64 on the presets, 4 at 32; measured against one warp per
        sequence, profiles/RESULTS.md 2026-12-04: level at llama-3.2-1b 64, 2-3% faster at llama-3.2-1b 32,
        qwen3-0.6b 64, llama-3.1-8b 32)."""
        return self.warps // max(n for _, n in sequence_groups(self.layout))

    @cute.jit
    def attend_sequences(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b0: Int32, kvh: Int32,
                         seqs: Int32, index: Int32, p, s, rec: Int64):
        """ATTN_PARTIAL of sequences b0 .. b0 + seqs - 1 (warp_attention: past SPLIT_BATCH, one split), WPS =
        sequence_warps() consumer warps each (warps j WPS .. j WPS + WPS - 1 take sequence b0 + j): A, the new
        token's heads spread over the sequence's warps (into s.q and s.kv, and the cache); B, its cached tokens
        streamed, WARP_UNROLL tokens per lane group an iteration, the iterations over its warps in turn
        (stream_tokens with first = the warp's place, stride = WPS), each warp's state into s.m, s.l, s.o; C, the
        sequence's WPS states merged (as attend_split merges all the warps'), the output written (attn_part, and
        O_PROJ's pre-staged input). Every consumer warp passes the two barriers, with a sequence or without. With
        KernelOptions.trace, the ends of A and B in the trace record (TR_STAGED, TR_CONSUMED)."""
        D, E, G, NE = self.D, self.E, self.G, STREAM_ELEMS
        WPS = self.sequence_warps()
        LPT = D // NE
        j = warp // WPS
        sub = warp - j * WPS
        b = b0 + j
        q_at = j * (G * D)
        kv_at = j * (2 * D)
        pos = Int32(0)
        k_base = Int64(0)
        v_base = Int64(0)
        if j < seqs:
            pos, append, k_base, v_base, blk = self.new_token_setup(lane == 0 and sub == 0, layer, b, True, index,
                                                                    p, s)
            row = self.qkv_row(layer, b, p)
            scale = self.qkv_scale(lane, layer, b, p)
            for hh in range(sub, G + 2, WPS):
                vals = cute.make_rmem_tensor((E,), Float32)
                self.load_head(hh, lane, kvh, row, vals, 0, scale, p, s)
                self.finish_head(hh, lane, layer, kvh, pos, blk, k_base, v_base, append, vals, 0, q_at, kv_at, p, s)
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                st_i32(rec + TR_STAGED * 4, globaltimer_lo())
        if j < seqs:
            m, lsum, o = self.stream_tokens(lane, b, kvh, Int32(0), pos, sub, Int32(WPS), WARP_UNROLL, True,
                                            sub == 0, q_at, kv_at, k_base, v_base, p, s)
            tg = lane // LPT
            self.store_softmax_state(warp, lane, m, lsum, o, NE, (lane - tg * LPT) * NE, tg == 0, s)
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
        for t in range(tidx, (self.warps // WPS) * G * D, self.cthreads):
            jj = t // (G * D)
            r = t - jj * (G * D)
            g = r // D
            if jj < seqs:
                self.merge_warps(jj * WPS, WPS, g, r - g * D, layer, b0 + jj, kvh, Int32(0), p, s)

    @cute.jit
    def attn_reduce(self, tidx: Int32, layer: Int32, b: Int32, kvh: Int32, num_splits: Int32, p):
        D, G = self.D, self.G
        for t in range(tidx, G * D, self.cthreads):
            g = t // D
            d = t - g * D
            head = kvh * G + g
            base = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S
            mx = Float32(-math.inf)
            for sp in range(num_splits):
                v = ld_f32(p.attn_part_lse + (base + Int64(sp)) * 4)
                if v > mx:
                    mx = v
            tot = Float32(0.0)
            acc_o = Float32(0.0)
            for sp in range(num_splits):
                lse = ld_f32(p.attn_part_lse + (base + Int64(sp)) * 4)
                if lse > Float32(-math.inf):
                    f = ex2((lse - mx) * Float32(LOG2E))
                    tot = tot + f
                    acc_o = acc_o + f * ld_f32(p.attn_part_o + ((base + Int64(sp)) * D + Int64(d)) * 4)
            out = acc_o / tot
            st_f32(p.attn_out + ((Int64(layer) * self.B + Int64(b)) * self.Q + Int64(head * D + d)) * 4, out)
            if cutlass.const_expr(self.wide):
                self.store_attention_wide(layer, b, head * D + d, out, p)

    @cute.jit
    def store_attention_wide(self, layer: Int32, b: Int32, k: Int32, v: Float32, p):
        """Past SPLIT_BATCH: element k of sequence b's attention output into O_PROJ's pre-staged input
        (StepBuffers.attn_wide[layer]: bf16 in the wgmma B layout, no norm), for its bulk copy (matvec_wide)."""
        st_bf16(p.attn_wide + Int64(layer) * self.wide_bytes(self.Q) + Int64(wide_x_byte(b, k, self.B)), v)

    @cute.jit
    def merge_quad(self, layer: Int32, b: Int32, k: Int32, attn_part_o: Int64, attn_part_lse: Int64,
                   out: cute.Tensor):
        """Attention output elements k..k+3 (one head) of sequence b: the splits' partial outputs weighted by
        exp(lse_s - max) and normalized, as ATTN_REDUCE computes them. The lse values and the first
        MERGE_GROUP splits' partials load in one round, the other splits' a group at a time (16 splits'
        partials at once would not fit the registers); an empty split wrote lse = -inf and a zero partial,
        skipped below."""
        head = k // self.D
        d = k - head * self.D
        base = ((Int64(layer) * self.B + Int64(b)) * self.Hq + Int64(head)) * self.S
        lse = cute.make_rmem_tensor((self.S,), Float32)
        for sp in cutlass.range_constexpr(self.S):
            lse[sp] = ld_f32(attn_part_lse + (base + sp) * 4)
        tot = Float32(0.0)
        for e in cutlass.range_constexpr(4):
            out[e] = Float32(0.0)
        mx = Float32(-math.inf)
        for g0 in cutlass.range_constexpr(0, self.S, MERGE_GROUP):
            n = min(MERGE_GROUP, self.S - g0)
            ov = cute.make_rmem_tensor((n * 4,), Float32)
            for j in cutlass.range_constexpr(n):
                o4 = load_f32x4(attn_part_o + ((base + g0 + j) * self.D + Int64(d)) * 4)
                for e in cutlass.range_constexpr(4):
                    ov[j * 4 + e] = o4[e]
            if cutlass.const_expr(g0 == 0):
                for sp in cutlass.range_constexpr(self.S):
                    if lse[sp] > mx:
                        mx = lse[sp]
            for j in cutlass.range_constexpr(n):
                if lse[g0 + j] > Float32(-math.inf):
                    f = ex2((lse[g0 + j] - mx) * Float32(LOG2E))
                    tot = tot + f
                    for e in cutlass.range_constexpr(4):
                        out[e] = out[e] + f * ov[j * 4 + e]
        for e in cutlass.range_constexpr(4):
            out[e] = out[e] / tot
