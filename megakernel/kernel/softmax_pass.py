"""Phase B of ATTN_PARTIAL on the consumer warps: an online softmax over cached tokens of the paged KV cache (the new
token last), and the cache addressing it needs. Three forms:
  - a split of at most as many tokens as warps, one token per warp (a lane: D / 32 elements), each warp's copied to
    shared memory by cp.async before the instruction's wait (`attn_preload`: the cache's history is a step input,
    nothing this step writes) (`attend_per_warp`);
  - a longer split (at the batches compiled with it, STREAM_UNROLL) streamed by all the warps in turn, several
    tokens per warp with their loads in flight together (`attend_streamed`);
  - a sequence's whole context streamed by one warp (attention.attend_sequences, past SPLIT_BATCH).
The last two share `stream_tokens`, whose tokens go into the softmax a block at a time (`stream_block`). Each warp
ends with its (max, sum, output) state; attention.py merges the warps' states and writes the partials.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .ptx import (cp_async_shared, cp_async_wait_all, ex2, ld_bf16, ld_i32, ld_i64, ld_shared_f32x4,
                  load_global_b32x4, load_shared_b32, pack_bf16x2, unpack_bf16x2, warp_sum)

STREAM_ELEMS = 8           # streamed pass: elements of a token's k (and v) per lane, one 16-byte load each (8: the
                           # 16-byte stores of attend_sequences)
# ... tokens per lane group per iteration (their loads in flight together, folded into the softmax as one block),
# by (batch, head_dim): the batches compiled with the streamed pass, each as many as the 128 registers of its warps
# hold without spills on the real presets in every cache layout (the compile tests check them; 2 tokens spill at
# batch 4 and at head_dim 128; at the batches without the pass it pushes long-lived values of the loop out of
# registers)
STREAM_UNROLL = {(1, 64): 2, (1, 128): 1, (4, 64): 1, (4, 128): 1}
# ... where a sequence's own warps stream its whole context (warp_attention, past SPLIT_BATCH: 168 registers a thread;
# llama-3.2-1b at 64, 2 / 4 / 8: 1.803 / 1.770 / 1.757 ms, 8 within the rounds' spread of 4; qwen3-0.6b 2 / 4:
# 2.246 / 2.129; llama-3.1-8b 2 / 4: 8.263 / 8.248; profiles/RESULTS.md, 2026-12-04)
WARP_UNROLL = 4
LOG2E = 1.4426950408889634


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

    @cute.jit
    def attn_preload(self, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32, split: Int32,
                     num_splits: Int32, p, s):
        """Before ATTN_PARTIAL's wait: this warp's first cached token of the split (position lo + warp), its
        lane's bf16 k and v elements copied to the warp's preload slot by cp.async, when the warp has one."""
        pos = ld_i32(p.positions + Int64(b) * 4)
        if pos < 0 or pos >= self.max_seq_len:
            pos = Int32(0)                      # attn_partial reports it; no cached token is read
        lo, hi = self.split_bounds(pos, split, num_splits)
        if lo + warp < hi:
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

    def stream_unroll(self) -> int:
        """Tokens per lane group per iteration of the streamed pass (0: not compiled): STREAM_UNROLL up to
        SPLIT_BATCH; past it one (8 consumer warps of 168 registers)."""
        if self.wide:
            return 1
        return STREAM_UNROLL.get((self.B, self.D), 0)

    @cute.jit
    def attend_streamed(self, warp: Int32, lane: Int32, b: Int32, kvh: Int32, lo: Int32, hi: Int32,
                        last: cutlass.Boolean, k_base: Int64, v_base: Int64, p, s):
        """Phase B for a split of more tokens than warps: the warps take the split's iterations in turn
        (stream_tokens), the new token (the last split) warp 0's; the warp's (m, l, o) into s.m, s.l, s.o."""
        LPT = self.D // STREAM_ELEMS
        tg = lane // LPT
        m, lsum, o = self.stream_tokens(lane, b, kvh, lo, hi, warp, Int32(self.warps), self.stream_unroll(), False,
                                        last and warp == 0, Int32(0), Int32(0), k_base, v_base, p, s)
        self.store_softmax_state(warp, lane, m, lsum, o, STREAM_ELEMS, (lane - tg * LPT) * STREAM_ELEMS, tg == 0, s)

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
