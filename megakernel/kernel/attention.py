"""Device code of ATTN_PARTIAL and ATTN_REDUCE on the consumer warps, and the split merge that O_PROJ's
input staging uses where the layout folds ATTN_REDUCE into it.

The records, split ranges and torch references are in megakernel.instructions.attention. ATTN_PARTIAL:
  A. the group's query heads and the new token's k, v (QK-norm, RoPE) into shared memory; the last split
     appends k, v to the paged cache unless that breaks the aliasing rule (`scan_aliasing`, once a step);
  B. an online softmax over the split's cached tokens (the new token last): a split of at most as many
     tokens as warps one token per warp, each warp's copied to shared memory by cp.async before the
     instruction's wait (`attn_preload`: the cache's history is a step input, nothing this step writes);
     a longer one (at the batches compiled with it, STREAM_UNROLL) streamed, several tokens per warp with
     their loads in flight together (`attend_streamed`);
  C. the warps' (max, sum, output) merged and the split's partial (output, log-sum-exp) written.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..instructions.layout import wide_x_byte
from .ptx import (atomic_cas, cp_async_shared, cp_async_wait_all, ex2, globaltimer_lo, ld_bf16, ld_f32, ld_i32, ld_i64,
                  lg2, ld_shared_f32x4, load_f32x4, load_global_b32x4, load_shared_b32, pack_bf16x2, round_bf16, rsqrt,
                  st_bf16, st_f32, st_i32, store_relaxed, unpack_bf16x2, warp_sum)
from .stream import TR_CONSUMED, TR_STAGED

MERGE_GROUP = 4            # attention splits whose partials one merge holds in registers at once
STREAM_ELEMS = 8           # streamed pass: elements of a token's k (and v) per lane, one 16-byte load each
# ... tokens per lane group per iteration (their loads in flight together, folded into the softmax as one block),
# by (batch, head_dim): the batches compiled with the streamed pass, each as many as the 128 registers of its warps
# hold without spills on the real presets in every cache layout (the compile tests check them; 2 tokens spill at
# batch 4 and at head_dim 128; at the batches without the pass it pushes long-lived values of the loop out of
# registers)
STREAM_UNROLL = {(1, 64): 2, (1, 128): 1, (4, 64): 1, (4, 128): 1}
LOG2E = 1.4426950408889634
ERR_POSITION = 2
ERR_ALIAS = 5           # a new token's KV slot is one this step reads or another sequence appends to
ALIAS_UNROLL = 4        # block-table entries per thread whose loads the aliasing scan issues together


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
    def attn_partial(self, tidx: Int32, warp: Int32, lane: Int32, layer: Int32, b: Int32, kvh: Int32,
                     split: Int32, num_splits: Int32, index: Int32, p, s, rec: Int64):
        """The instruction's phases A-C (the module docstring); s.alias[b] = 1 (scan_aliasing): the last split
        writes no K/V and reports ERR_ALIAS. With KernelOptions.trace past SPLIT_BATCH, the ends of phases A and B
        in its trace record (rec: TR_STAGED, TR_CONSUMED; at batch 1-8 the stamps' registers would spill)."""
        s_kv, s_l, s_m, s_o, s_q = s.kv, s.l, s.m, s.o, s.q
        D, E, G, half = self.D, self.E, self.G, self.D // 2
        pos = ld_i32(p.positions + Int64(b) * 4)
        bad = pos < 0 or pos >= self.max_seq_len
        last = split == num_splits - 1
        aliased = s.alias[b]
        # one report for both errors (a second atomic's block cost spilled registers)
        code = Int32(0)
        if aliased != 0 and last:
            code = Int32(ERR_ALIAS)
        if bad:
            code = Int32(ERR_POSITION)
        if code != 0 and tidx == 0:
            if atomic_cas(p.error, Int32(0), code) == 0:
                store_relaxed(p.error + 4, index)        # (the instruction names the sequence)
                store_relaxed(p.error + 12, pos)
        if bad:
            pos = Int32(0)
        row = p.qkv + (Int64(layer) * self.B + Int64(b)) * (self.QKV * 4)
        # the layer's K and V base addresses (a device table, so a bound cache can move without a
        # recompile or a new CUDA graph); element offset of (block, offset, kv head) from the strides
        k_base = ld_i64(p.kv_table + Int64(layer) * 16)
        v_base = ld_i64(p.kv_table + Int64(layer) * 16 + 8)
        # the new token's cache block: loaded now, its slot address computed where the last split appends, so
        # the load's round trip runs beside phase A's instead of before it
        blk = ld_i32(p.block_table + (Int64(b) * self.max_blocks + Int64(pos // self.bs)) * 4)

        # ---- phase A: q heads of the group, then k, then v of the new token -> smem
        for hh in range(warp, G + 2, self.warps):
            # where the q of head hh (hh < G), the k (G) or the v (G + 1) of this kv head start in the qkv row
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
                    if last and not bad and aliased == 0:
                        # (a step with a bad position or an aliased slot writes no cache slot: the error is
                        # raised, the cache kept)
                        st_bf16(cache + (self.token_offset(blk, kvh, pos) + Int64(lane * E + e)) * 2, rv)
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace and self.wide):
            if tidx == 0:
                st_i32(rec + TR_STAGED * 4, globaltimer_lo())

        lo, hi = self.split_bounds(pos, split, num_splits)
        if cutlass.const_expr(self.stream_unroll() > 0):
            if hi - lo > self.warps:
                # ---- phase B, more tokens than warps (a long context): several tokens per warp at a time
                cp_async_wait_all()           # (attn_preload's copies: this pass reads the cache itself)
                self.attend_streamed(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)
            else:
                # ---- phase B, at most a token per warp: the first copied before the wait
                self.attend_per_warp(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)
        else:
            self.attend_per_warp(warp, lane, b, kvh, lo, hi, last, k_base, v_base, p, s)

        # ---- phase C: merge the warps' (m, l, o) and write the split's partial
        self.consumer_sync()
        if cutlass.const_expr(self.options.trace and self.wide):
            if tidx == 0:
                st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
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
            if cutlass.const_expr(self.wide and self.layout.fused_reduce):
                # (past SPLIT_BATCH, a single split: its output is O_PROJ's input, pre-staged here for its bulk copy)
                self.store_attention_wide(layer, b, head * D + d, outv, p)
            if d == 0:
                st_f32(p.attn_part_lse + pidx * 4, lse)

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
        """Phase B for a split of more tokens than warps: a lane group of D / STREAM_ELEMS lanes takes one token
        per load (a lane: STREAM_ELEMS elements, one 16-byte load of k and one of v), so a warp takes
        32 * STREAM_ELEMS / D tokens per load and STREAM_UNROLL loads per iteration, all in flight together,
        folded into the online softmax as one block (`stream_block`); each token's cache block id is loaded just
        before its k and v (a split's few table entries stay in L1). Each lane group keeps its own online softmax
        (m, l, o), merged across the warp's groups by shuffles at the end; the new token (the last split) is lane
        group 0 of warp 0's. The warp's (m, l, o) into s.m, s.l, s.o."""
        s_kv = s.kv
        D, G, W, NE, UT = self.D, self.G, self.warps, STREAM_ELEMS, self.stream_unroll()
        NW = NE // 2                 # packed bf16 words of a lane's share of a token's k (and of its v)
        LPT = D // NE                # lanes per token
        TPW = 32 // LPT              # tokens per warp-wide load
        step = TPW * UT              # tokens per warp per iteration
        tg = lane // LPT
        c = lane - tg * LPT          # this lane's elements: NE c .. NE c + NE - 1 of a head
        qa = Int32(s.q.iterator.toint()) + c * (NE * 4)    # ... of head 0's query (shared memory)
        m, lsum, o = self.softmax_state(NE)
        bt = p.block_table + Int64(b) * (self.max_blocks * 4)
        lane_off = Int64(kvh) * self.kv_sh + Int64(c * NE)
        n_it = (hi - lo + W * step - 1) // (W * step)
        for it in range(n_it):
            t0 = lo + (it * W + warp) * step
            kw = cute.make_rmem_tensor((UT * NW,), Int32)
            vw = cute.make_rmem_tensor((UT * NW,), Int32)
            tb = cute.make_rmem_tensor((UT,), Int32)
            for u in cutlass.range_constexpr(UT):         # the tokens' blocks (the split's few table entries:
                t = t0 + u * TPW + tg                     # after the first warp's load, L1 hits)
                tb[u] = Int32(0)
                if t < hi:
                    tb[u] = ld_i32(bt + Int64(t // self.bs) * 4)
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
            # this lane group's tokens of the iteration below hi: u < n_valid
            n_valid = (hi - t0 - tg + TPW - 1) // TPW
            self.stream_block(n_valid, UT, qa, kw, vw, m, lsum, o)
        # the new token, from shared memory (every lane computes its score; lane group 0 of warp 0 adds it)
        kw = cute.make_rmem_tensor((NW,), Int32)
        vw = cute.make_rmem_tensor((NW,), Int32)
        for e in cutlass.range_constexpr(NW):
            kw[e] = pack_bf16x2(s_kv[c * NE + 2 * e], s_kv[c * NE + 2 * e + 1])
            vw[e] = pack_bf16x2(s_kv[D + c * NE + 2 * e], s_kv[D + c * NE + 2 * e + 1])
        mine = Int32(0)
        if last and warp == 0 and tg == 0:
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
        self.store_softmax_state(warp, lane, m, lsum, o, NE, c * NE, tg == 0, s)

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
