"""Phase B of ATTN_PARTIAL on the consumer warps: an online softmax over cached tokens of the paged KV cache (the new
token last), and the cache addressing it needs. Four forms:
  - a split of at most as many tokens as warps, one token per warp (a lane: D / 32 elements), each warp's copied to
    shared memory by cp.async before the instruction's wait (`attn_preload`: the cache's history is a step input,
    nothing this step writes) (`attend_per_warp`);
  - a longer split up to SPLIT_BATCH on the tensor cores, the warps taking its steps of 8-token tiles in turn
    (`attend_mma`, `stream_tokens_mma`);
  - a longer split past SPLIT_BATCH streamed on the CUDA cores by all the warps in turn, several tokens per warp
    with their loads in flight together (`attend_streamed`);
  - a sequence's whole context streamed by one warp (attention.attend_sequences, past SPLIT_BATCH).
The last two share `stream_tokens`, whose tokens go into the softmax a block at a time (`stream_block`). Each warp
ends with its (max, sum, output) state; attention.py merges the warps' states and writes the partials.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..instructions.layout import MMA_TILES
from .ptx import (cp_async_shared, cp_async_wait_all, ex2, high_halves, ld_bf16, ld_f32, ld_i32, ld_i64,
                  ld_shared_f32x4, load_global_b32x4, load_shared_b32, load_shared_raw, low_halves, mma_bf16_1688,
                  mma_bf16_16816_rows8, mma_bf16_16816_rows8_zero, pack_bf16x2, round_bf16, st_shared_b32x4,
                  unpack_bf16x2, warp_sum)

STREAM_ELEMS = 8           # streamed pass: elements of a token's k (and v) per lane, one 16-byte load each (8: the
                           # 16-byte stores of attend_sequences)
# ... tokens per lane group per iteration past SPLIT_BATCH (8 consumer warps of 168 registers)
STREAM_UNROLL = 1
# ... where a sequence's own warps stream its whole context (warp_attention, past SPLIT_BATCH: 168 registers a thread;
# llama-3.2-1b at 64, 2 / 4 / 8: 1.803 / 1.770 / 1.757 ms, 8 within the rounds' spread of 4; qwen3-0.6b 2 / 4:
# 2.246 / 2.129; llama-3.1-8b 2 / 4: 8.263 / 8.248; profiles/RESULTS.md, 2026-12-04)
WARP_UNROLL = 4
LOG2E = 1.4426950408889634


@cute.jit
def bf16x2_hi_lo(x0: Float32, x1: Float32):
    """Two float32 as packed bf16 pairs (x0 in the low half) of their rounding (hi) and of what it left (lo): hi +
    lo carries ~16 mantissa bits, so two bf16 MMAs give the float32 products (the tensor-core pass's query and
    weights)."""
    return pack_bf16x2(x0, x1), pack_bf16x2(x0 - round_bf16(x0), x1 - round_bf16(x1))


class SoftmaxPass:
    """Consumer-side online softmax over cached tokens (a mixin of the interpreter, under AttentionStage)."""

    @cute.jit
    def cached_token(self, b: Int32, kvh: Int32, t: Int32, block_table: Int64) -> Int64:
        """Element offset, in a layer's K (or V) cache, of sequence b's position t, kv head kvh: its block
        from the block table, then the cache's strides."""
        tb = ld_i32(block_table + (Int64(b) * self.max_blocks + Int64(t // self.bs)) * 4)
        return self.token_offset(tb, kvh, t)

    @cute.jit
    def token_offset(self, tb: Int32, kvh: Int32, t: Int32) -> Int64:
        """Element offset of position t (in block tb), kv head kvh, in a layer's K (or V) cache: the strides."""
        return Int64(tb) * self.kv_sb + Int64(t % self.bs) * self.kv_st + Int64(kvh) * self.kv_sh

    @cute.jit
    def load_cached_kv(self, b: Int32, kvh: Int32, t: Int32, block_table: Int64, k_base: Int64, v_base: Int64,
                       lane: Int32, kk: cute.Tensor, vv: cute.Tensor):
        """This lane's E elements of the cached k and v of sequence b at position t (kv head kvh)."""
        ts = self.cached_token(b, kvh, t, block_table)
        for e in cutlass.range_constexpr(self.E):
            kk[e] = ld_bf16(k_base + (ts + Int64(lane * self.E + e)) * 2)
            vv[e] = ld_bf16(v_base + (ts + Int64(lane * self.E + e)) * 2)

    def preload_slot(self, warp: Int32, lane: Int32, s) -> Int32:
        """Shared address of this lane's k elements in its warp's preload slot: a slot holds D bf16 of k,
        then D of v (4 * D bytes); the lane's v elements are D * 2 bytes further."""
        return s.pre_addr + (warp * 2 * self.D + lane * self.E) * 2

    def long_split(self, lo: Int32, hi: Int32):
        """Whether cached positions [lo, hi) are more than the consumer warps: a split that phase B streams (on the
        tensor cores up to SPLIT_BATCH, whose query fragments take the preload slots), not one token a warp."""
        return hi - lo > self.warps

    @cute.jit
    def rope_registers(self):
        """Registers for the factors of one head's QK-norm and RoPE, a lane's E elements each: the norm weights,
        cos, sin (rope_factors), zeros. (Zeroed where they are made, at the top of the queue loop, so that before
        the wait of an instruction that is not the attention's nothing of them is live.)"""
        f = cute.make_rmem_tensor((3 * self.E,), Float32)
        for e in cutlass.range_constexpr(3 * self.E):
            f[e] = Float32(0.0)
        return f

    @cute.jit
    def rope_factors(self, hh: Int32, lane: Int32, layer: Int32, pos: Int32, p, f: cute.Tensor):
        """Into f: this lane's E QK-norm weights of head hh (hh < G: the query's, G: the key's; 1 without QK-norm),
        then its E RoPE cos and E sin at position pos, as finish_head applies them (heads hh <= G)."""
        D, E, G, half = self.D, self.E, self.G, self.D // 2
        for e in cutlass.range_constexpr(E):
            f[e] = Float32(1.0)
            if cutlass.const_expr(self.qk_norm):
                nbase = p.q_norm
                if hh == G:
                    nbase = p.k_norm
                f[e] = ld_bf16(nbase + (Int64(layer) * D + Int64(lane * E + e)) * 2)
            fi = (lane * E + e) % half
            f[E + e] = ld_f32(p.rope_cos + (Int64(pos) * half + Int64(fi)) * 4)
            f[2 * E + e] = ld_f32(p.rope_sin + (Int64(pos) * half + Int64(fi)) * 4)

    @cute.jit
    def attn_preload(self, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32, split: Int32,
                     num_splits: Int32, p, s, rope=None):
        """Before ATTN_PARTIAL's wait: this warp's first cached token of the split (position lo + warp), its
        lane's bf16 k and v elements copied to the warp's preload slot by cp.async, when the warp has one and, up to
        SPLIT_BATCH, the split has no more tokens than warps (a longer one takes the tensor-core pass, which reads
        the cache itself and keeps its query fragments in the slots). With `rope` (batch 1 on one GPU): the
        QK-norm and RoPE factors of the head the warp finishes first in phase A (head `warp`, where it is one that
        takes them: phase A takes one head a warp), so that phase A has no load after the wait but the new token's
        own (rope_factors)."""
        pos = ld_i32(p.positions + Int64(b) * 4)
        if pos < 0 or pos >= self.max_seq_len:
            pos = Int32(0)                      # attn_partial reports it; no cached token is read
        if cutlass.const_expr(rope is not None):
            if warp <= self.G:
                self.rope_factors(warp, lane, layer, pos, p, rope)
        lo, hi = self.split_bounds(pos, split, num_splits)
        copies = lo + warp < hi
        if cutlass.const_expr(not self.wide):
            if self.long_split(lo, hi):
                copies = False
        if copies:
            off = (self.cached_token(b, kvh, lo + warp, p.block_table) + Int64(lane * self.E)) * 2
            dst = self.preload_slot(warp, lane, s)
            cp_async_shared(dst, ld_i64(p.kv_table + Int64(layer) * 16) + off, self.E * 2)
            cp_async_shared(dst + self.D * 2, ld_i64(p.kv_table + Int64(layer) * 16 + 8) + off, self.E * 2)

    @cute.jit
    def preloaded_kv(self, warp: Int32, lane: Int32, s, kk: cute.Tensor, vv: cute.Tensor):
        """This lane's k and v elements that attn_preload copied (float32), after waiting for the copies."""
        cp_async_wait_all()
        src = self.preload_slot(warp, lane, s)
        for w in cutlass.range_constexpr(self.E // 2):
            kk[2 * w], kk[2 * w + 1] = unpack_bf16x2(load_shared_b32(src + w * 4))
            vv[2 * w], vv[2 * w + 1] = unpack_bf16x2(load_shared_b32(src + self.D * 2 + w * 4))

    @cute.jit
    def softmax_state(self, n: int):
        """An empty online-softmax state of the G query heads: (m, l, o) = (-inf, 0, 0), n output elements
        per head."""
        m = cute.make_rmem_tensor((self.G,), Float32)
        lsum = cute.make_rmem_tensor((self.G,), Float32)
        o = cute.make_rmem_tensor((self.G * n,), Float32)
        for g in cutlass.range_constexpr(self.G):
            m[g] = Float32(-math.inf)
            lsum[g] = Float32(0.0)
            for e in cutlass.range_constexpr(n):
                o[g * n + e] = Float32(0.0)
        return m, lsum, o

    @cute.jit
    def store_softmax_state(self, warp: Int32, lane: Int32, m: cute.Tensor, lsum: cute.Tensor, o: cute.Tensor,
                            n: int, d0: Int32, writes: cutlass.Boolean, s):
        """A warp's (m, l, o) into s.m, s.l (lane 0) and s.o: this lane's n elements of each head from
        element d0, where `writes`."""
        s_l, s_m, s_o = s.l, s.m, s.o
        G = self.G
        for g in cutlass.range_constexpr(G):
            if lane == 0:
                s_m[warp * G + g] = m[g]
                s_l[warp * G + g] = lsum[g]
            if writes:
                for e in cutlass.range_constexpr(n):
                    s_o[(warp * G + g) * self.D + d0 + e] = o[g * n + e]

    @cute.jit
    def attend_per_warp(self, warp: Int32, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32,
                        last: cutlass.Boolean, k_base: Int64, v_base: Int64, p, s):
        """Phase B for a split of at most as many tokens as warps (a short context): an online softmax over the
        split's cached tokens, one token per warp (a lane: D / 32 elements), each warp's copied to shared memory
        before the wait (attn_preload), the new token last (warp 0 of the last split); the warp's (m, l, o)
        into s.m, s.l, s.o."""
        s_kv, s_q = s.kv, s.q
        D, E, G = self.D, self.E, self.G
        qv = cute.make_rmem_tensor((G * E,), Float32)
        for g in cutlass.range_constexpr(G):
            for e in cutlass.range_constexpr(E):
                qv[g * E + e] = s_q[g * D + lane * E + e]
        m, lsum, o = self.softmax_state(E)
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
                if j == 0:          # copied before the wait (attn_preload)
                    self.preloaded_kv(warp, lane, s, kk, vv)
                else:
                    self.load_cached_kv(b, kvh, lo + warp + j * self.warps, p.block_table, k_base, v_base,
                                        lane, kk, vv)
            else:
                for e in cutlass.range_constexpr(E):
                    kk[e] = s_kv[lane * E + e]
                    vv[e] = s_kv[D + lane * E + e]
            for g in cutlass.range_constexpr(G):
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(E):
                    dot = dot + qv[g * E + e] * kk[e]
                sc = warp_sum(dot) * Float32(self.scale_log2)
                m_new = m[g]
                if sc > m_new:
                    m_new = sc
                corr = ex2(m[g] - m_new)
                pr = ex2(sc - m_new)
                lsum[g] = lsum[g] * corr + pr
                for e in cutlass.range_constexpr(E):
                    o[g * E + e] = o[g * E + e] * corr + pr * vv[e]
                m[g] = m_new
        self.store_softmax_state(warp, lane, m, lsum, o, E, lane * E, True, s)

    @cute.jit
    def attend_streamed(self, warp: Int32, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32,
                        last: cutlass.Boolean, k_base: Int64, v_base: Int64, p, s):
        """Phase B past SPLIT_BATCH for a split of more tokens than warps: the warps take the split's iterations in
        turn (stream_tokens), the new token (the last split) warp 0's; the warp's (m, l, o) into s.m, s.l, s.o."""
        LPT = self.D // STREAM_ELEMS
        tg = lane // LPT
        m, lsum, o = self.stream_tokens(lane, b, kvh, lo, hi, warp, Int32(self.warps), STREAM_UNROLL, False,
                                        last and warp == 0, Int32(0), Int32(0), k_base, v_base, p, s)
        self.store_softmax_state(warp, lane, m, lsum, o, STREAM_ELEMS, (lane - tg * LPT) * STREAM_ELEMS, tg == 0, s)

    @cute.jit
    def attend_mma(self, warp: Int32, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32,
                   last: cutlass.Boolean, k_base: Int64, v_base: Int64, p, s):
        """Phase B up to SPLIT_BATCH for a split of more tokens than warps, on the tensor cores: the warps take its
        steps in turn (stream_tokens_mma), the new token (the last split) warp 0's; the warp's (m, l, o) into s.m,
        s.l, s.o."""
        D, G = self.D, self.G
        r = lane // 4
        q = lane - 4 * r
        self.mma_queries(warp * 32 + lane, s.pre_addr, s)
        self.consumer_sync()
        m, lsum, acc = self.stream_tokens_mma(lane, b, kvh, lo, hi, warp, Int32(self.warps), last and warp == 0,
                                              s.pre_addr, k_base, v_base, p, s)
        s_l, s_m, s_o = s.l, s.m, s.o
        if q == 0 and r < G:
            s_m[warp * G + r] = m
            s_l[warp * G + r] = lsum
        VD = D // 8
        for i in cutlass.range_constexpr(D // 16):
            for j in cutlass.range_constexpr(4):
                h = 2 * q + j % 2
                if h < G:
                    s_o[(warp * G + h) * D + VD * r + 2 * i + j // 2] = acc[4 * i + j]

    @cute.jit
    def mma_queries(self, tidx: Int32, qf: Int32, s):
        """The queries in s.q as the score MMAs' A operand (stream_tokens_mma), written once for every warp to
        the shared words at qf (the preload slots: a long split copies none there): scaled to log2 units, split
        into bf16 hi + lo; chunk c of lane 4 r + q is the 16 bytes at qf + (32 c + lane) * 16: hi a0, hi a2, lo a0,
        lo a2 (A's row r = head r: elements D/4 q + 4c, + 1 and + 2, + 3; rows >= G zero)."""
        D, G = self.D, self.G
        KD = D // 4
        if tidx < 32 * (D // 16):
            c = tidx // 32
            lane = tidx - 32 * c
            r = lane // 4
            q = lane - 4 * r
            x = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                x[e] = Float32(0.0)
                if r < G:
                    x[e] = s.q[r * D + KD * q + 4 * c + e] * Float32(self.scale_log2)
            hi0, lo0 = bf16x2_hi_lo(x[0], x[1])
            hi2, lo2 = bf16x2_hi_lo(x[2], x[3])
            st_shared_b32x4(qf + tidx * 16, hi0, hi2, lo0, lo2)

    @cute.jit
    def stream_tokens_mma(self, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32, first: Int32,
                          stride: Int32, new_token: cutlass.Boolean, qf: Int32, k_base: Int64, v_base: Int64, p,
                          s):
        """An online softmax over cached positions [lo, hi) of sequence b (kv head kvh) on the tensor cores, in
        steps of MMA_TILES[D] tiles of 8 tokens, this warp's steps first, first + stride, ...; where new_token,
        the new token (k and v in s.kv) last; the query fragments at qf (mma_queries). Lane 4 r + q:
          scores   S = Q K^T by m16n8k16 (M: the G query heads, rows r < G; N: a tile's 8 tokens; K: 16 elements
                   of the head a chunk): its key operand is token r's elements D/4 q .. D/4 q + D/4 - 1 (chunk c
                   takes four of them, 4c ..), straight from 16-byte loads; the query in the same element order,
                   scaled to log2 units and split into bf16 hi + lo (two MMAs: the scores as float32 products
                   would give them);
          softmax  the lane holds head r's scores of tokens 2q and 2q + 1: the tile's maximum over the 4 lanes of
                   the head (two shuffles), the rescale, the weights, split bf16 hi + lo;
          output   O^T += V^T P^T by m16n8k8 (M: 16 elements of the head a tile, N: the heads, K: 8 tokens): the
                   weights are the B operand as the softmax left them; the values' A operand is tokens 2q and
                   2q + 1's elements D/8 r .. (m-tile i takes 2i and 2i + 1), paired from two 16-byte loads by
                   prmt. The accumulators: acc[4i + j] = O[head 2q + j % 2][D/8 r + 2i + j // 2].
        Returns the lane's (m, l, acc): m and l of head r (l summed over the head's lanes)."""
        s_kv = s.kv
        D = self.D
        NC = D // 16                  # k-chunks of a score MMA; m-tiles of the output
        KD = D // 4                   # a lane's elements of a key
        VD = D // 8                   # a lane's elements of a value
        TS = MMA_TILES[D]
        r = lane // 4
        q = lane - 4 * r
        m = Float32(-math.inf)
        lsum = Float32(0.0)
        acc = cute.make_rmem_tensor((4 * NC,), Float32)
        for i in cutlass.range_constexpr(4 * NC):
            acc[i] = Float32(0.0)
        step = 8 * TS
        n_it = (hi - lo + stride * step - 1) // (stride * step)
        for it in range(n_it):
            t0 = lo + (it * stride + first) * step
            if t0 < hi:                 # (a warp past the split's end takes no step: every block has a token)
                kw = cute.make_rmem_tensor((TS * KD // 2,), Int32)
                vw = cute.make_rmem_tensor((TS * VD,), Int32)
                for u in cutlass.range_constexpr(TS):
                    for e in cutlass.range_constexpr(KD // 2):
                        kw[u * KD // 2 + e] = Int32(0)     # (a token past the split: zeros, its score masked)
                    tk = t0 + 8 * u + r
                    if tk < hi:
                        off = (self.cached_token(b, kvh, tk, p.block_table) + Int64(KD * q)) * 2
                        for j in cutlass.range_constexpr(KD // 8):
                            w4 = load_global_b32x4(k_base + off + 16 * j)
                            for e in cutlass.range_constexpr(4):
                                kw[u * KD // 2 + 4 * j + e] = w4[e]
                    for w in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(VD // 2):
                            vw[(2 * u + w) * (VD // 2) + e] = Int32(0)
                        tv = t0 + 8 * u + 2 * q + w
                        if tv < hi:
                            off = (self.cached_token(b, kvh, tv, p.block_table) + Int64(VD * r)) * 2
                            for j in cutlass.range_constexpr(VD // 8):
                                w4 = load_global_b32x4(v_base + off + 16 * j)
                                for e in cutlass.range_constexpr(4):
                                    vw[(2 * u + w) * (VD // 2) + 4 * j + e] = w4[e]
                m, lsum = self.mma_tokens(TS, hi - t0, r, q, qf + lane * 16, kw, vw, m, lsum, acc)
        if new_token:
            # the new token as tile position 0 of one more tile, from shared memory (bf16-exact float32 there)
            kw = cute.make_rmem_tensor((KD // 2,), Int32)
            vw = cute.make_rmem_tensor((VD,), Int32)
            for e in cutlass.range_constexpr(KD // 2):
                kw[e] = Int32(0)
                if r == 0:
                    kw[e] = pack_bf16x2(s_kv[KD * q + 2 * e], s_kv[KD * q + 2 * e + 1])
            for e in cutlass.range_constexpr(VD):
                vw[e] = Int32(0)
            if q == 0:
                for e in cutlass.range_constexpr(VD // 2):
                    vw[e] = pack_bf16x2(s_kv[D + VD * r + 2 * e], s_kv[D + VD * r + 2 * e + 1])
            m, lsum = self.mma_tokens(1, Int32(1), r, q, qf + lane * 16, kw, vw, m, lsum, acc)
        lsum = lsum + cute.arch.shuffle_sync_bfly(lsum, offset=1)
        lsum = lsum + cute.arch.shuffle_sync_bfly(lsum, offset=2)
        return m, lsum, acc

    @cute.jit
    def mma_tokens(self, TS: int, n_valid: Int32, r: Int32, q: Int32, qa: Int32, kw: cute.Tensor, vw: cute.Tensor,
                   m: Float32, lsum: Float32, acc: cute.Tensor):
        """TS tiles of 8 tokens into the tensor-core pass's online softmax (stream_tokens_mma), tokens from
        n_valid on masked: kw and vw as it loads them. Returns head r's (m, l) (l: this lane's tokens only)."""
        D = self.D
        NC, KD, VD = D // 16, D // 4, D // 8
        sc = cute.make_rmem_tensor((2 * TS,), Float32)
        for u in cutlass.range_constexpr(TS):
            for c in cutlass.range_constexpr(NC):
                qw = load_shared_raw(qa + c * 512)          # hi a0, hi a2, lo a0, lo a2 (mma_queries)
                k0 = kw[u * KD // 2 + 2 * c]
                k1 = kw[u * KD // 2 + 2 * c + 1]
                if cutlass.const_expr(c == 0):
                    c0, c1, c2, c3 = mma_bf16_16816_rows8_zero(qw[2], qw[3], k0, k1)
                else:
                    c0, c1, c2, c3 = mma_bf16_16816_rows8(qw[2], qw[3], k0, k1, c0, c1, c2, c3)
                c0, c1, c2, c3 = mma_bf16_16816_rows8(qw[0], qw[1], k0, k1, c0, c1, c2, c3)
            sc[2 * u] = c0
            sc[2 * u + 1] = c1
            if 8 * u + 2 * q >= n_valid:
                sc[2 * u] = Float32(-math.inf)
            if 8 * u + 2 * q + 1 >= n_valid:
                sc[2 * u + 1] = Float32(-math.inf)
        mb = sc[0]
        for i in cutlass.range_constexpr(1, 2 * TS):
            mb = cute.arch.fmax(mb, sc[i])
        mb = cute.arch.fmax(mb, cute.arch.shuffle_sync_bfly(mb, offset=1))
        mb = cute.arch.fmax(mb, cute.arch.shuffle_sync_bfly(mb, offset=2))
        m_new = cute.arch.fmax(m, mb)        # (a block's first token is below n_valid: finite)
        corr = ex2(m - m_new)
        tot = Float32(0.0)
        ph = cute.make_rmem_tensor((TS,), Int32)
        pl = cute.make_rmem_tensor((TS,), Int32)
        for u in cutlass.range_constexpr(TS):
            p0 = ex2(sc[2 * u] - m_new)
            p1 = ex2(sc[2 * u + 1] - m_new)
            tot = tot + p0 + p1
            ph[u], pl[u] = bf16x2_hi_lo(p0, p1)
        # the output's columns are heads 2q and 2q + 1: their lanes' rescale
        ca = cute.arch.shuffle_sync(corr, 8 * q)
        cb = cute.arch.shuffle_sync(corr, 8 * q + 4)
        for i in cutlass.range_constexpr(NC):
            acc[4 * i] = acc[4 * i] * ca
            acc[4 * i + 1] = acc[4 * i + 1] * cb
            acc[4 * i + 2] = acc[4 * i + 2] * ca
            acc[4 * i + 3] = acc[4 * i + 3] * cb
        for u in cutlass.range_constexpr(TS):
            for i in cutlass.range_constexpr(NC):
                w0 = vw[2 * u * (VD // 2) + i]            # token 8u + 2q: elements VD r + 2i, + 1
                w1 = vw[(2 * u + 1) * (VD // 2) + i]      # token 8u + 2q + 1
                a0 = low_halves(w0, w1)
                a1 = high_halves(w0, w1)
                d0, d1, d2, d3 = mma_bf16_1688(a0, a1, ph[u], acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                                               acc[4 * i + 3])
                d0, d1, d2, d3 = mma_bf16_1688(a0, a1, pl[u], d0, d1, d2, d3)
                acc[4 * i] = d0
                acc[4 * i + 1] = d1
                acc[4 * i + 2] = d2
                acc[4 * i + 3] = d3
        return m_new, lsum * corr + tot

    @cute.jit
    def stream_tokens(self, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32, first: Int32, stride: Int32,
                      UT: int, ahead: bool, new_token: cutlass.Boolean, q_at: Int32, kv_at: Int32, k_base: Int64,
                      v_base: Int64, p, s):
        """An online softmax over cached positions [lo, hi) of sequence b (kv head kvh), in iterations of UT tokens
        per lane group, this warp's iterations first, first + stride, ...: a lane group of D / STREAM_ELEMS lanes
        takes one token per load (a lane: STREAM_ELEMS elements, one 16-byte load of k and one of v), so a warp
        takes 32 * STREAM_ELEMS / D tokens per load and UT loads per iteration, all in flight together, folded
        into the softmax as one block (`stream_block`); each token's cache block id is loaded just before its k and
        v (block_ids), or where `ahead` an iteration before. Each lane group keeps its own (m, l, o); where
        new_token, lane group 0 adds the new token (k and v at s.kv[kv_at:]) last; the groups' states are merged by
        shuffles at the end, so every lane group returns the warp's. The queries are s.q[q_at:]."""
        s_kv = s.kv
        D, G, NE = self.D, self.G, STREAM_ELEMS
        NW = NE // 2                 # packed bf16 words of a lane's share of a token's k (and of its v)
        LPT = D // NE                # lanes per token
        TPW = 32 // LPT              # tokens per warp-wide load
        step = TPW * UT              # tokens per warp per iteration
        tg = lane // LPT
        c = lane - tg * LPT          # this lane's elements: NE c .. NE c + NE - 1 of a head
        qa = Int32(s.q.iterator.toint()) + (q_at + c * NE) * 4    # ... of head 0's query (shared memory)
        m, lsum, o = self.softmax_state(NE)
        bt = p.block_table + Int64(b) * (self.max_blocks * 4)
        lane_off = Int64(kvh) * self.kv_sh + Int64(c * NE)
        n_it = (hi - lo + stride * step - 1) // (stride * step)
        tb = cute.make_rmem_tensor((UT,), Int32)
        if cutlass.const_expr(ahead):
            self.block_ids(tb, bt, lo + first * step, hi, tg, UT)
        for it in range(n_it):
            t0 = lo + (it * stride + first) * step
            kw = cute.make_rmem_tensor((UT * NW,), Int32)
            vw = cute.make_rmem_tensor((UT * NW,), Int32)
            if cutlass.const_expr(not ahead):
                self.block_ids(tb, bt, t0, hi, tg, UT)
            for u in cutlass.range_constexpr(UT):
                t = t0 + u * TPW + tg
                for e in cutlass.range_constexpr(NW):
                    kw[u * NW + e] = Int32(0)       # (a token past the split: zeros, so its weight 0 adds 0)
                    vw[u * NW + e] = Int32(0)
                if t < hi:
                    off = (Int64(tb[u]) * self.kv_sb + Int64(t % self.bs) * self.kv_st + lane_off) * 2
                    kr = load_global_b32x4(k_base + off)
                    vr = load_global_b32x4(v_base + off)
                    for e in cutlass.range_constexpr(NW):
                        kw[u * NW + e] = kr[e]
                        vw[u * NW + e] = vr[e]
            if cutlass.const_expr(ahead):
                self.block_ids(tb, bt, t0 + stride * step, hi, tg, UT)     # (in flight during this block's softmax)
            # this lane group's tokens of the iteration below hi: u < n_valid
            n_valid = (hi - t0 - tg + TPW - 1) // TPW
            self.stream_block(n_valid, UT, qa, kw, vw, m, lsum, o)
        # the new token, from shared memory (every lane computes its score; lane group 0 adds it)
        kw = cute.make_rmem_tensor((NW,), Int32)
        vw = cute.make_rmem_tensor((NW,), Int32)
        for e in cutlass.range_constexpr(NW):
            kw[e] = pack_bf16x2(s_kv[kv_at + c * NE + 2 * e], s_kv[kv_at + c * NE + 2 * e + 1])
            vw[e] = pack_bf16x2(s_kv[kv_at + D + c * NE + 2 * e], s_kv[kv_at + D + c * NE + 2 * e + 1])
        mine = Int32(0)
        if new_token and tg == 0:
            mine = Int32(1)
        self.stream_block(mine, 1, qa, kw, vw, m, lsum, o)
        # merge the lane groups' states (a butterfly over the groups: every group ends with the warp's)
        for sh in cutlass.range_constexpr(LPT.bit_length() - 1, 5):
            for g in cutlass.range_constexpr(G):
                m2 = cute.arch.shuffle_sync_bfly(m[g], offset=1 << sh)
                l2 = cute.arch.shuffle_sync_bfly(lsum[g], offset=1 << sh)
                mn = cute.arch.fmax(m[g], m2)
                f1 = Float32(0.0)
                f2 = Float32(0.0)
                if mn > Float32(-math.inf):
                    f1 = ex2(m[g] - mn)
                    f2 = ex2(m2 - mn)
                lsum[g] = lsum[g] * f1 + l2 * f2
                for e in cutlass.range_constexpr(NE):
                    o2 = cute.arch.shuffle_sync_bfly(o[g * NE + e], offset=1 << sh)
                    o[g * NE + e] = o[g * NE + e] * f1 + o2 * f2
                m[g] = mn
        return m, lsum, o

    @cute.jit
    def block_ids(self, tb: cute.Tensor, bt: Int64, t0: Int32, hi: Int32, tg: Int32, UT: int):
        """The cache blocks of this lane group's tokens t0 + u * (tokens per warp-wide load) + tg, u < UT, below
        hi, from the sequence's block-table row bt (a split's few entries: after the first warp's load, L1 hits)."""
        TPW = 32 // (self.D // STREAM_ELEMS)
        for u in cutlass.range_constexpr(UT):
            t = t0 + u * TPW + tg
            tb[u] = Int32(0)
            if t < hi:
                tb[u] = ld_i32(bt + Int64(t // self.bs) * 4)

    @cute.jit
    def stream_block(self, n_valid: Int32, n: int, qa: Int32, kw: cute.Tensor, vw: cute.Tensor,
                     m: cute.Tensor, lsum: cute.Tensor, o: cute.Tensor):
        """n tokens into a lane group's online softmax as one block, the first n_valid of them counted: token
        u's k and v are the packed bf16 words u * STREAM_ELEMS / 2 .. of kw and vw. The scores of every
        (token, query head) (the lane's products, its query elements read from shared memory at qa, summed over
        the group's lanes; every lane takes part in the shuffles); then, per head, the block's maximum, one
        rescale of (l, o) and the block's weights times its values."""
        NE = STREAM_ELEMS
        NW = NE // 2
        G = self.G
        LPT = self.D // NE
        sc = cute.make_rmem_tensor((n * G,), Float32)
        for u in cutlass.range_constexpr(n):
            kf = cute.make_rmem_tensor((NE,), Float32)
            for e in cutlass.range_constexpr(NW):
                kf[2 * e], kf[2 * e + 1] = unpack_bf16x2(kw[u * NW + e])
            for g in cutlass.range_constexpr(G):
                dot = Float32(0.0)
                for h in cutlass.range_constexpr(NE // 4):
                    q4 = ld_shared_f32x4(qa + (g * self.D + 4 * h) * 4)
                    for e in cutlass.range_constexpr(4):
                        dot = dot + q4[e] * kf[4 * h + e]
                for w in cutlass.range_constexpr(LPT.bit_length() - 1):
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << w)
                sc[u * G + g] = dot * Float32(self.scale_log2)
        if n_valid > 0:
            for g in cutlass.range_constexpr(G):
                m_new = m[g]
                for u in cutlass.range_constexpr(n):
                    if u < n_valid:
                        m_new = cute.arch.fmax(m_new, sc[u * G + g])
                corr = ex2(m[g] - m_new)
                tot = lsum[g] * corr
                for u in cutlass.range_constexpr(n):
                    pr = Float32(0.0)
                    if u < n_valid:
                        pr = ex2(sc[u * G + g] - m_new)
                    sc[u * G + g] = pr                   # (the score's register now holds the weight)
                    tot = tot + pr
                lsum[g] = tot
                m[g] = m_new
                for e in cutlass.range_constexpr(NE):
                    o[g * NE + e] = o[g * NE + e] * corr
            for u in cutlass.range_constexpr(n):
                for e in cutlass.range_constexpr(NW):
                    v0, v1 = unpack_bf16x2(vw[u * NW + e])
                    for g in cutlass.range_constexpr(G):
                        o[g * NE + 2 * e] = o[g * NE + 2 * e] + sc[u * G + g] * v0
                        o[g * NE + 2 * e + 1] = o[g * NE + 2 * e + 1] + sc[u * G + g] * v1
