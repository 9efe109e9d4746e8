"""Device code of ATTN_PARTIAL and ATTN_REDUCE on the consumer warps, and the split merge that O_PROJ's
input staging uses where the layout folds ATTN_REDUCE into it.

The records, split ranges and torch references are in megakernel.instructions.attention. ATTN_PARTIAL:
  A. the group's query heads and the new token's k, v (QK-norm, RoPE) into shared memory; the last split
     appends k, v to the paged cache;
  B. an online softmax over the split's cached tokens, one token per warp at a time (the new token last);
     each warp's first token was copied to shared memory by cp.async before the instruction's wait
     (`attn_preload`: the cache's history is a step input, nothing this step writes);
  C. the warps' (max, sum, output) merged and the split's partial (output, log-sum-exp) written.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .ptx import (atomic_cas, cp_async_shared, cp_async_wait_all, ex2, ld_bf16, ld_f32, ld_i32, ld_i64, lg2,
                  load_f32x4, load_shared_b32, round_bf16, rsqrt, st_bf16, st_f32, store_relaxed, unpack_bf16x2,
                  warp_sum)

MERGE_GROUP = 8            # attention splits whose partials one merge holds in registers at once
LOG2E = 1.4426950408889634
ERR_POSITION = 2


class AttentionStage:
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
    def cached_token(self, b: Int32, kvh: Int32, t: Int32, block_table: Int64) -> Int64:
        """Element offset, in a layer's K (or V) cache, of sequence b's position t, kv head kvh: its block
        from the block table, then the cache's strides."""
        tb = ld_i32(block_table + (Int64(b) * self.max_blocks + Int64(t // self.bs)) * 4)
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
    def attn_partial(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32,
                     split: Int32, num_splits: Int32, index: Int32, p, s):
        s_kv, s_l, s_m, s_o, s_q = s.kv, s.l, s.m, s.o, s.q
        D, E, G, half = self.D, self.E, self.G, self.D // 2
        pos = ld_i32(p.positions + Int64(b) * 4)
        bad = pos < 0 or pos >= self.max_seq_len
        if bad:
            if tidx == 0:
                if atomic_cas(p.error, Int32(0), Int32(ERR_POSITION)) == 0:
                    store_relaxed(p.error + 4, index)
                    store_relaxed(p.error + 12, pos)
            pos = Int32(0)
        last = split == num_splits - 1
        row = p.qkv + (Int64(layer) * self.B + Int64(b)) * (self.QKV * 4)
        # the layer's K and V base addresses (a device table, so a bound cache can move without a
        # recompile or a new CUDA graph); element offset of (block, offset, kv head) from the strides
        k_base = ld_i64(p.kv_table + Int64(layer) * 16)
        v_base = ld_i64(p.kv_table + Int64(layer) * 16 + 8)
        slot = self.cached_token(b, kvh, pos, p.block_table)

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
                    ssq = Float32(0.0)
                    for e in cutlass.range_constexpr(E):
                        ssq = ssq + vals[e] * vals[e]
                    ssq = warp_sum(ssq)
                    r = rsqrt(ssq / Float32(D) + Float32(self.eps))
                    nbase = p.q_norm
                    if hh == G:
                        nbase = p.k_norm
                    for e in cutlass.range_constexpr(E):
                        vals[e] = vals[e] * r * ld_bf16(nbase + (Int64(layer) * D + Int64(lane * E + e)) * 2)
            if hh <= G:
                for e in cutlass.range_constexpr(E):
                    partner = cute.arch.shuffle_sync_bfly(vals[e], offset=16)
                    fi = (lane * E + e) % half
                    cs = ld_f32(p.rope_cos + (Int64(pos) * half + Int64(fi)) * 4)
                    sn = ld_f32(p.rope_sin + (Int64(pos) * half + Int64(fi)) * 4)
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
                    if last and not bad:
                        # (a step with a bad position writes no cache slot: the error is raised, the cache kept)
                        st_bf16(cache + (slot + Int64(lane * E + e)) * 2, rv)
        self.consumer_sync()

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

        # ---- phase C: merge the warps' (m, l, o) and write the split's partial
        for g in cutlass.range_constexpr(G):
            if lane == 0:
                s_m[warp * G + g] = m[g]
                s_l[warp * G + g] = lsum[g]
            for e in cutlass.range_constexpr(E):
                s_o[(warp * G + g) * D + lane * E + e] = o[g * E + e]
        self.consumer_sync()
        for t in range(tidx, G * D, self.cthreads):
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
            st_f32(p.attn_part_o + (pidx * D + Int64(d)) * 4, outv)
            if d == 0:
                st_f32(p.attn_part_lse + pidx * 4, lse)

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
            st_f32(p.attn_out + ((Int64(layer) * self.B + Int64(b)) * self.Q + Int64(head * D + d)) * 4, acc_o / tot)

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
