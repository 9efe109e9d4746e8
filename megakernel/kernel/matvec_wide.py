"""Device code of the matvec stages past SPLIT_BATCH (batch 9-64), and of MV_REDUCE.

At batch 1-8 (megakernel.kernel.matvec) each slot part goes to the warp that owns its ring slot, which stores one
partial sum per (row, slab, part, sequence) in shared memory; with 64 sequences those partials would leave chunks
of a few rows, each staging the input again. Here (docs/batch_path.md):
  - a chunk is G x WIDE_WARPS row groups of ITEM_ROWS rows (G = stream.wide_groups: 1 or 2), and consumer warp w
    owns row groups w, w + WIDE_WARPS, ... of every chunk; the two consumer warpgroups (warps 0-3, 4-7) multiply
    sets of four consecutive row groups (set S: warpgroup S % 2, owned group S // 2) by wgmma m64nNk16: the 64
    weight rows are M, each warp's A registers loaded from its own row group's fragment-packed slot (the layout
    the batch 1-8 consumers read), every sequence's input is B (N = the batch padded to m-tiles of 16), in
    shared memory once per chunk as bf16 core matrices (layout.wide_x_byte) that the wgmma reads through a
    descriptor, and the float32 accumulators stay in the warps' registers across the tile's slabs
    (tools/activation_precision.py has what bf16 inputs cost in accuracy);
  - every consumer warp waits for every slot in order; the other warpgroup's warps arrive on a slot's empty
    barrier (initialised to WIDE_WARPS x RELEASE_LANES: every lane arrives) at once, the set's own warps once
    their A registers are loaded, so each use of a ring slot is complete before any warp waits for the next one
    (the parity of an mbarrier wait is exact);
  - the input is not staged by the consumers: the stage that produced it wrote it a second time, already in the
    B operand's layout and times this stage's norm weight (StepBuffers.x_wide, h_wide, attn_wide, act_wide, from
    the wide epilogue, MV_REDUCE, EMBED and the attention: ATTN_PARTIAL of a single split, else ATTN_REDUCE), with
    the sums of squares of every 8 of its columns (x_ssq, h_ssq); a window of it is one bulk copy, and the RMS
    scale per sequence, taken from those sums while the copy runs, goes to the epilogue (the norm is linear in it);
  - at the chunk's end each warp runs the epilogue of its own rows from its registers: the stage's store and its
    pre-staged copy for the next stage, or, for a tile of a K range of a stage split over K (split_k.py), the
    float32 partial into part_<stage>;
  - MV_REDUCE adds a row range's partials in range order and runs the stage's epilogue (O_PROJ, DOWN; QKV's
    partials are summed by the attention that reads them; GATE_UP is never split).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from ..instructions.layout import wide_x_byte
from ..instructions.matvec_stages import weight_rows
from ..instructions.opcodes import Opcode
from ..instructions.split_k import REDUCED_STAGES, k_splits
from .matvec import silu
from .ptx import (bulk_copy_g2s, globaltimer_lo, ld_bf16, ld_f32, load_f32x4, load_nc_b32x2, load_shared_raw,
                  mbarrier_arrive, mbarrier_arrive_expect_tx, pack_bf16x2, policy_evict_last, rsqrt, st_b32x2, st_bf16,
                  st_f32, st_f32x4, st_i32, unpack_bf16x2, warp_max_index, wgmma_bf16_rs, wgmma_desc)
from .stream import (ITEM_ROWS, M_TILE, SLAB_COLS, SLOT_BYTES, TR_CONSUMED, TR_LANDED_FIRST, TR_LANDED_LAST, TR_STAGED,
                     TR_REACHED_LAST, TR_STAGING, TR_WAIT_LANDED, WGMMA_LBO, WGMMA_SBO, WIDE_WARPS, m_tiles, mark_hop,
                     wide_ks_bytes)

OP_QKV, OP_O_PROJ, OP_GATE_UP = int(Opcode.QKV), int(Opcode.O_PROJ), int(Opcode.GATE_UP)
OP_DOWN, OP_LM_HEAD = int(Opcode.DOWN), int(Opcode.LM_HEAD)
WG_KP = 2          # 32-column blocks (two k-steps each) whose A registers a warp loads per wgmma group; the next
                   # group's loads go out while the previous group's wgmmas run (two register buffers)


class WideMatvec:
    """Consumer-side matvec past SPLIT_BATCH and MV_REDUCE (a mixin of the interpreter)."""

    def wgmma_n(self) -> int:
        """The wgmma's N: the batch padded to whole m-tiles of M_TILE sequences."""
        return m_tiles(self.B) * M_TILE

    def group_accumulators(self) -> int:
        """float32 accumulators a lane holds for one owned row group: its share of the m64nNk16 D (N / 2)."""
        return self.wgmma_n() // 2

    @cute.jit
    def matvec_wide(self, tidx: Int32, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, a1: Int32,
                    tile: Int32, kpart: Int32, split: Boolean, K: Int32, k0: Int32, slab: Int32, n_slab: Int32,
                    chunk: Int32, xsl: Int32, has_norm: Boolean, has_res: Boolean, out_addr: Int64, out_w: Int32,
                    res_addr: Int64, k_slot: Int32, ring: Int32, full: Int32, empty: Int32, p, s,
                    rec: Int64) -> Int32:
        """One tile past SPLIT_BATCH (matvec's arguments, resolved): columns k0 .. k0 + K of rows a0 .. a0 + a1
        (the input pre-staged by the stage that produced it: wide_source)."""
        G = self.wide_groups
        NA = self.group_accumulators()
        is_lm = op == OP_LM_HEAD
        whole = xsl >= n_slab
        # the input was pre-staged by the stage that produced it (past SPLIT_BATCH the embedding is never folded
        # into QKV: StepLayout.embed_folded), times this stage's norm weight
        src, ssq = self.wide_source(op, layer, p)
        rstd = has_norm and not split     # (QKV's K-range partials are scaled by the attention that sums them)
        if is_lm:
            self.reset_tile_maximum(tidx, s)
        x_base = s.x_addr
        wg = warp // 4                    # the consumer warpgroup
        g_own = warp * ITEM_ROWS          # the first row group this warp owns in every chunk (then every
        GS = WIDE_WARPS * ITEM_ROWS       # GS rows further: G in all)
        t_landed = Int32(0)               # (trace mode) this warp's waits for its slots to land, ns
        t_staging = Int32(0)              # (trace mode) thread 0's time in the input windows, ns
        for c0 in range(0, a1, chunk):
            rows = a1 - c0
            if rows > chunk:
                rows = chunk
            if c0 > 0:
                self.consumer_sync()      # the last chunk's argmax merge has read s.wv and s.wi
            acc = cute.make_rmem_tensor((G * NA,), Float32)
            for i in cutlass.range_constexpr(G * NA):
                acc[i] = Float32(0.0)
            for sl in range(n_slab):
                width = K - sl * slab
                if width > slab:
                    width = slab
                # the input window of xsl slabs holding slab sl (the whole input where it fits: window 0, staged
                # once per instruction; else once per chunk)
                w0 = sl - sl % xsl
                col0 = (sl - w0) * slab
                if sl == w0 and (c0 == 0 or not whole):
                    ww = K - w0 * slab
                    if ww > xsl * slab:
                        ww = xsl * slab
                    if cutlass.const_expr(self.options.trace):
                        t_st = globaltimer_lo()
                    if c0 > 0 or sl > 0:
                        self.consumer_sync()      # the previous window is read: this one may overwrite it
                    self.input_window(tidx, src, ssq, rstd and c0 == 0 and sl == 0, k0 + w0 * slab, ww, p, s)
                    if cutlass.const_expr(self.options.trace):
                        t_staging = t_staging + (globaltimer_lo() - t_st)
                    if tidx == 0 and c0 == 0 and sl == 0:
                        mark_hop(s, 0)                # the first window is staged
                    if cutlass.const_expr(self.options.trace):
                        if tidx == 0 and c0 == 0 and sl == 0:
                            st_i32(rec + TR_STAGED * 4, globaltimer_lo())
                for g0 in range(0, rows, ITEM_ROWS):
                    slot = k_slot % self.ring_slots
                    mb = slot * 8
                    if cutlass.const_expr(self.options.trace):
                        t0 = globaltimer_lo()
                    self.wait_full(full + mb, (k_slot // self.ring_slots) % 2, p.error)
                    if cutlass.const_expr(self.options.trace):
                        t_landed = t_landed + (globaltimer_lo() - t0)
                        if tidx == 0:
                            if c0 == 0 and sl == 0 and g0 == 0:
                                st_i32(rec + TR_LANDED_FIRST * 4, globaltimer_lo())
                            if c0 + rows >= a1 and sl == n_slab - 1 and g0 + ITEM_ROWS >= rows:
                                st_i32(rec + TR_LANDED_LAST * 4, globaltimer_lo())
                                st_i32(rec + TR_REACHED_LAST * 4, t0)
                    rg = g0 // ITEM_ROWS
                    S = rg // 4                   # the set of row groups 4 S .. 4 S + 3
                    cute.arch.sync_warp()
                    if S % 2 != wg:
                        mbarrier_arrive(empty + mb)       # not this warpgroup's: passed at once (every lane)
                    elif rg % 4 == 3 or g0 + ITEM_ROWS >= rows:
                        # the set's last slot has landed: the warpgroup multiplies the set, each warp its own row
                        # group's slot (a warp past the chunk's rows: the set's first slot's weights, times zero)
                        first = k_slot - rg % 4
                        i = warp % 4
                        own = i <= rg % 4
                        a_slot = first
                        if own:
                            a_slot = first + i
                        a_addr = ring + (a_slot % self.ring_slots) * SLOT_BYTES
                        for j in cutlass.range_constexpr(G):
                            if S // 2 == j:
                                self.wgmma_set(lane, own, slab, width, a_addr, x_base, col0, acc, j * NA)
                        # every lane releases its own A loads of the set's slots (RELEASE_LANES arrivals a warp)
                        for m in range(rg % 4 + 1):
                            mbarrier_arrive(empty + ((first + m) % self.ring_slots) * 8)
                    k_slot = k_slot + 1
            self.consumer_sync()
            if tidx == 0 and c0 + rows >= a1:
                mark_hop(s, 1)                        # past the tile's last slot: the hop begins
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
                    st_i32(rec + TR_WAIT_LANDED * 4, t_landed)
                    st_i32(rec + TR_STAGING * 4, t_staging)
            self.epilogue_wide(warp, lane, op, layer, a0, c0, rows - g_own, kpart, split, has_norm, has_res,
                               out_addr, out_w, res_addr, acc, p, s)
            if is_lm:
                self.merge_chunk_maxima(tidx, s)
        if is_lm:
            self.store_tile_maximum(tidx, tile, Int32(0), p, s)
        return k_slot

    @cute.jit
    def wgmma_set(self, lane: Int32, own: Boolean, slab: Int32, width: Int32, slot_addr: Int32, x_base: Int32,
                  col0: Int32, acc: cute.Tensor, a_base: int):
        """The warpgroup's set of four row groups (64 rows: M) of one slab times every sequence's staged input
        (N), added to acc[a_base ..] (wgmma_bf16_rs's layout: rows lane // 4 and + 8 of the warp's row group,
        sequences 8 i + 2 (lane % 4) and + 1). The warp's A registers come from its slot (zero where `own` is
        false): per 8-row block (slab * 16 bytes apart) 512-byte blocks of 32 columns in which lane l's 16 bytes
        are row l // 4's columns 2t, 2t + 1, 2t + 8, 2t + 9 of the block's two k-steps, which is the A fragment
        of its rows (a0, a2 from the first block, a1, a3 from the second); B is the staged input's k-step blocks
        from col0 (layout.wide_x_byte). Groups of WG_KP blocks: the loads of one while the other's wgmmas run;
        every wgmma is complete when this returns (the window may then be restaged)."""
        N = self.wgmma_n()
        KSB = wide_ks_bytes(self.B)
        kp_w = width // 32
        top = slot_addr + lane * 16
        bottom = top + slab * 16                        # the second 8-row block
        xk = x_base + (col0 // 16) * KSB                # the slab's first k-step of the staged input
        bufs = [cute.make_rmem_tensor((WG_KP * 8,), Int32) for _ in range(2)]
        for hf in cutlass.range_constexpr(SLAB_COLS // 32 // WG_KP):
            # the A registers of WG_KP blocks, loaded whatever the slot holds: blocks past the slab's width are
            # not multiplied, and an absent second 8-row block only gives rows the tile does not have, which the
            # epilogue does not store (the loads stay inside the slot: 2 x 16 blocks of 512 bytes)
            w = bufs[hf % 2]
            for uu in cutlass.range_constexpr(WG_KP):
                u = hf * WG_KP + uu
                v = load_shared_raw(top + u * 512)
                for e in cutlass.range_constexpr(4):
                    w[uu * 8 + e] = v[e]
                v = load_shared_raw(bottom + u * 512)
                for e in cutlass.range_constexpr(4):
                    w[uu * 8 + 4 + e] = v[e]
            if not own:
                for e in cutlass.range_constexpr(WG_KP * 8):
                    w[e] = Int32(0)
            warpgroup.fence()
            for uu in cutlass.range_constexpr(WG_KP):
                u = hf * WG_KP + uu
                if u < kp_w:
                    for kb in cutlass.range_constexpr(2):
                        q = uu * 8 + kb * 2
                        wgmma_bf16_rs(N, acc, a_base, w[q], w[q + 4], w[q + 1], w[q + 5],
                                      wgmma_desc(xk + (2 * u + kb) * KSB, WGMMA_LBO, WGMMA_SBO))
            warpgroup.commit_group()
            if cutlass.const_expr(hf >= 1):
                warpgroup.wait_group(1)               # the other buffer's wgmmas are done: it may be reloaded
        warpgroup.wait_group(0)

    def wide_bytes(self, k: int) -> int:
        """Bytes of one layer's pre-staged input of width k (StepBuffers.x_wide ..): a block per k-step."""
        return k // 16 * wide_ks_bytes(self.B)

    def ssq_bytes(self) -> int:
        """Bytes of one layer's sums of squares of x or h (StepBuffers.x_ssq, h_ssq: f32 [B, H / 8])."""
        return self.B * (self.H // 8) * 4

    @cute.jit
    def wide_source(self, op: Int32, layer: Int32, p):
        """(pre-staged input, its sums of squares) of a matvec stage past SPLIT_BATCH: QKV x_wide[l] and x_ssq[l],
        O_PROJ attn_wide[l] (no norm), GATE_UP h_wide[l] and h_ssq[l], DOWN act_wide[l] (no norm), the LM head
        x_wide[L] and x_ssq[L]."""
        l64 = Int64(layer)
        src = Int64(0)
        ssq = Int64(0)
        if op == OP_QKV:
            src = p.x_wide + l64 * self.wide_bytes(self.H)
            ssq = p.x_ssq + l64 * self.ssq_bytes()
        if op == OP_O_PROJ:
            src = p.attn_wide + l64 * self.wide_bytes(self.Q)
        if op == OP_GATE_UP:
            src = p.h_wide + l64 * self.wide_bytes(self.H)
            ssq = p.h_ssq + l64 * self.ssq_bytes()
        if op == OP_DOWN:
            src = p.act_wide + l64 * self.wide_bytes(self.F)
        if op == OP_LM_HEAD:
            src = p.x_wide + Int64(self.L) * self.wide_bytes(self.H)
            ssq = p.x_ssq + Int64(self.L) * self.ssq_bytes()
        return src, ssq

    @cute.jit
    def wide_output(self, op: Int32, layer: Int32, p):
        """(pre-staged copy, norm weight of its reader, sums of squares) that a stage past SPLIT_BATCH writes beside
        its output: O_PROJ h_wide[l] (mlp_norm[l]) and h_ssq[l], GATE_UP act_wide[l] (no norm: ones, no sums),
        DOWN x_wide[l + 1] (attn_norm[l + 1], final_norm after the last layer) and x_ssq[l + 1]; (0, ones, 0) for
        the others."""
        l64 = Int64(layer)
        out = Int64(0)
        gamma = p.ones
        ssq = Int64(0)
        if op == OP_O_PROJ:
            out = p.h_wide + l64 * self.wide_bytes(self.H)
            gamma = p.mlp_norm + l64 * (self.H * 2)
            ssq = p.h_ssq + l64 * self.ssq_bytes()
        if op == OP_GATE_UP:
            out = p.act_wide + l64 * self.wide_bytes(self.F)
        if op == OP_DOWN:
            out = p.x_wide + (l64 + 1) * self.wide_bytes(self.H)
            gamma = p.final_norm
            if layer + 1 < self.L:
                gamma = p.attn_norm + (l64 + 1) * (self.H * 2)
            ssq = p.x_ssq + (l64 + 1) * self.ssq_bytes()
        return out, gamma, ssq

    @cute.jit
    def input_window(self, tidx: Int32, src: Int64, ssq: Int64, rstd: Boolean, col: Int32, ncols: Int32, p, s):
        """Columns col .. col + ncols of every sequence's pre-staged input (at src) into s.x as the wgmma's B
        operand, ready when this returns (it ends with a consumer barrier): one bulk copy of its k-step blocks
        (thread 0 arms the mbarrier s.xbar_addr; the copy of number s_ctrl[4] completes its phase of that parity),
        and where `rstd` the RMS scales from its sums of squares (at ssq) while the copy runs."""
        nbytes = ncols // 16 * wide_ks_bytes(self.B)
        if cutlass.const_expr(self.options.diag_no_stage):
            # (KernelOptions.diag_no_stage, for timing only: the window zeroed instead of copied, wrong results but
            # finite)
            self.zero_x(tidx, nbytes // 4, s)
            if rstd:
                self.rstd_from_ssq(tidx, ssq, s)
            self.consumer_sync()
            return
        s_ctrl = s.ctrl
        if tidx == 0:
            # the producing stages stored it through the generic proxy (this thread acquired their counter), and
            # the consumers' last accesses to s.x (before the barrier that precedes this) were generic too; the
            # copy engine reads and writes through the async proxy
            cute.arch.fence_proxy("async")
            mbarrier_arrive_expect_tx(s.xbar_addr, nbytes)
            bulk_copy_g2s(s.x_addr, src + Int64(col // 16) * wide_ks_bytes(self.B), nbytes, s.xbar_addr,
                          policy_evict_last())
        if rstd:
            self.rstd_from_ssq(tidx, ssq, s)
        self.wait_full(s.xbar_addr, s_ctrl[4] % 2, p.error)
        self.consumer_sync()
        if tidx == 0:
            s_ctrl[4] = s_ctrl[4] + 1        # (read again only after another consumer barrier)

    def ssq_threads(self) -> int:
        """Threads per sequence that add its sums of squares (rstd_from_ssq): a power of two, at most 32, with
        every sequence's share a whole number of 4-float loads."""
        n = 1
        while n < 32 and 2 * n * self.B <= self.cthreads and (self.H // 8) % (8 * n) == 0:
            n *= 2
        return n

    def ssq_offsets(self) -> tuple:
        """The butterfly's lane offsets over ssq_threads() lanes: P / 2, ..., 1."""
        P = self.ssq_threads()
        return tuple(P >> (i + 1) for i in range(P.bit_length() - 1))

    @cute.jit
    def ssq_sum(self, row: Int64, t: Int32, active: Boolean) -> Float32:
        """One sequence's sum of squares from the H / 8 sums per 8 columns its producers wrote (f32 at `row`), by
        its P = ssq_threads() threads (this one: t < P, lanes of one butterfly group): thread t adds 16-byte words
        t, t + P, t + 2 P, ... in that order (a warp's loads in runs of P x 16 consecutive bytes: 2.0 us less than
        a consecutive share per thread at llama-3.2-1b 64, profiles/RESULTS.md 2026-12-04), 16 loads a round, then
        the P sums go together pairwise (a butterfly: the same bits on every lane of the group and in every run).
        An inactive thread adds nothing (and loads nothing) but takes part in the butterfly."""
        NG = self.H // 8
        P = self.ssq_threads()
        per = NG // P
        tot = Float32(0.0)
        if active:
            base = row + Int64(t) * 16
            for r0 in cutlass.range_constexpr(0, per // 4, 16):
                n4 = min(16, per // 4 - r0)
                v = cute.make_rmem_tensor((4 * n4,), Float32)
                for i in cutlass.range_constexpr(n4):
                    q = load_f32x4(base + (r0 + i) * (16 * P))
                    for e in cutlass.range_constexpr(4):
                        v[4 * i + e] = q[e]
                for i in cutlass.range_constexpr(4 * n4):
                    tot = tot + v[i]
        for off in self.ssq_offsets():
            tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=off)
        return tot

    @cute.jit
    def rstd_from_ssq(self, tidx: Int32, ssq: Int64, s):
        """s.rstd[b] = rsqrt(sequence b's sum of squares / H + eps) from its sums per 8 columns (f32 [B, H / 8] at
        ssq), P threads per sequence (ssq_sum). Read after a consumer barrier."""
        s_rstd = s.rstd
        P = self.ssq_threads()
        b = tidx // P
        tot = self.ssq_sum(ssq + Int64(b) * (self.H // 8 * 4), tidx - b * P, b < self.B)
        if b < self.B and tidx == b * P:
            s_rstd[b] = rsqrt(tot / Float32(self.H) + Float32(self.eps))

    @cute.jit
    def epilogue_wide(self, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, c0: Int32, nr0: Int32,
                      kpart: Int32, split: Boolean, has_norm: Boolean, has_res: Boolean, out_addr: Int64,
                      out_w: Int32, res_addr: Int64, acc: cute.Tensor, p, s):
        """The warp's rows of chunk c0 from its accumulators: owned group j (acc[j * NA ...]) is rows c0 + warp *
        ITEM_ROWS + j * WIDE_WARPS * ITEM_ROWS and the next ITEM_ROWS of the tile, of which nr0 - j * WIDE_WARPS *
        ITEM_ROWS exist (<= 0: none; a multiple of 8); lane (g, t) holds rows g and g + 8 of the group for
        sequences 8 i + 2t and + 1 (wgmma_set). One unrolled body per kind, so a tile runs through its own code
        only: a K range's partials (epilogue_partials), GATE_UP's SiLU(gate) * up (epilogue_gate_up), the other
        stages' rows (epilogue_rows)."""
        if split:
            self.epilogue_partials(warp, lane, op, layer, a0, c0, nr0, kpart, acc, p)
        elif op == OP_GATE_UP:
            self.epilogue_gate_up(warp, lane, layer, a0, c0, nr0, out_addr, acc, p, s)
        else:
            self.epilogue_rows(warp, lane, op, layer, a0, c0, nr0, has_norm, has_res, out_addr, out_w, res_addr,
                               acc, p, s)

    @cute.jit
    def epilogue_partials(self, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, c0: Int32, nr0: Int32,
                          kpart: Int32, acc: cute.Tensor, p):
        """A K range's tile: its float32 partials into part_<stage>[l, kpart] (MV_REDUCE closes O_PROJ's and
        DOWN's; the attention sums QKV's, times the RMS scale)."""
        B, G, NA = self.B, self.wide_groups, self.group_accumulators()
        GS = WIDE_WARPS * ITEM_ROWS
        g = lane // 4
        t = lane - g * 4
        part_addr, part_rows, part_e = self.part_buffer(op, p)
        for ci in cutlass.range_constexpr(self.wgmma_n() // 8):
            for e in cutlass.range_constexpr(2):
                b = ci * 8 + 2 * t + e
                for j in cutlass.range_constexpr(G):
                    r0 = c0 + warp * ITEM_ROWS + j * GS
                    nr = nr0 - j * GS
                    if b < B and nr > 0:
                        for blk in cutlass.range_constexpr(2):
                            if blk * 8 < nr:
                                st_f32(part_addr + (((Int64(layer) * part_e + Int64(kpart)) * B + Int64(b)) * part_rows
                                                    + Int64(a0 + r0 + blk * 8 + g)) * 4,
                                       acc[j * NA + ci * 4 + 2 * blk + e])

    @cute.jit
    def epilogue_gate_up(self, warp: Int32, lane: Int32, layer: Int32, a0: Int32, c0: Int32, nr0: Int32,
                         out_addr: Int64, acc: cute.Tensor, p, s):
        """GATE_UP: act = SiLU(gate * rstd) * (up * rstd) (a row group's gate rows are its first 8, its up rows the
        next 8, so a lane holds both of its outputs), and its pre-staged copy for DOWN (no norm: bf16 as is)."""
        s_rstd = s.rstd
        B, G, NA = self.B, self.wide_groups, self.group_accumulators()
        GS = WIDE_WARPS * ITEM_ROWS
        g = lane // 4
        t = lane - g * 4
        wout, _, _ = self.wide_output(Int32(OP_GATE_UP), layer, p)
        for ci in cutlass.range_constexpr(self.wgmma_n() // 8):
            for e in cutlass.range_constexpr(2):
                b = ci * 8 + 2 * t + e
                for j in cutlass.range_constexpr(G):
                    r0 = c0 + warp * ITEM_ROWS + j * GS
                    if b < B and nr0 - j * GS > 0:
                        scale = s_rstd[b]
                        v = silu(acc[j * NA + ci * 4 + e] * scale) * (acc[j * NA + ci * 4 + 2 + e] * scale)
                        st_f32(out_addr + (Int64(b) * self.F + Int64(r0 // 2 + g)) * 4, v)
                        st_bf16(wout + Int64(wide_x_byte(b, a0 // 2 + r0 // 2 + g, B)), v)

    @cute.jit
    def epilogue_rows(self, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, c0: Int32, nr0: Int32,
                      has_norm: Boolean, has_res: Boolean, out_addr: Int64, out_w: Int32, res_addr: Int64,
                      acc: cute.Tensor, p, s):
        """QKV, O_PROJ, DOWN and the LM head over the whole K: each row times the RMS scale (QKV, LM head), plus the
        residual (O_PROJ, DOWN), stored; for O_PROJ and DOWN also the pre-staged copy for the next stage
        (wide_output: times its norm weight, bf16 at wide_x_byte) and the sums of squares of every 8 rows (a
        shuffle sum over the lanes g); the LM head also its (max, lowest index) per sequence over both groups into
        s.wv / s.wi slot warp * B + b."""
        s_rstd, s_wi, s_wv = s.rstd, s.wi, s.wv
        B, H = self.B, self.H
        G, NA = self.wide_groups, self.group_accumulators()
        GS = WIDE_WARPS * ITEM_ROWS
        g = lane // 4
        t = lane - g * 4
        is_lm = op == OP_LM_HEAD
        wout, gamma, ssq_out = self.wide_output(op, layer, p)
        pre = has_res                     # O_PROJ, DOWN
        # the norm weights of the lane's rows in the next stage, loaded once for every sequence
        gv = cute.make_rmem_tensor((2 * G,), Float32)
        for j in cutlass.range_constexpr(G):
            for blk in cutlass.range_constexpr(2):
                gv[2 * j + blk] = Float32(1.0)
                if pre and blk * 8 < nr0 - j * GS:
                    gv[2 * j + blk] = ld_bf16(gamma + Int64(a0 + c0 + warp * ITEM_ROWS + j * GS + blk * 8 + g) * 2)
        for ci in cutlass.range_constexpr(self.wgmma_n() // 8):
            for e in cutlass.range_constexpr(2):
                b = ci * 8 + 2 * t + e
                bv = Float32(-math.inf)
                bi = Int32(0x7FFFFFFF)
                for j in cutlass.range_constexpr(G):
                    r0 = c0 + warp * ITEM_ROWS + j * GS
                    nr = nr0 - j * GS
                    sq = cute.make_rmem_tensor((2,), Float32)     # the rows' squares, for the sums per 8 rows
                    sq[0] = Float32(0.0)
                    sq[1] = Float32(0.0)
                    if b < B and nr > 0:
                        scale = Float32(1.0)
                        if has_norm:
                            scale = s_rstd[b]
                        ob = out_addr + Int64(b) * Int64(out_w) * 4
                        for blk in cutlass.range_constexpr(2):
                            r = r0 + blk * 8 + g
                            if blk * 8 < nr:
                                v = acc[j * NA + ci * 4 + 2 * blk + e] * scale
                                if has_res:
                                    v = v + ld_f32(res_addr + (Int64(b) * Int64(H) + Int64(r)) * 4)
                                st_f32(ob + Int64(r) * 4, v)
                                if pre:
                                    st_bf16(wout + Int64(wide_x_byte(b, a0 + r, B)), v * gv[2 * j + blk])
                                    sq[blk] = v * v
                                if is_lm:
                                    # (rows in increasing order and a strict comparison: the lowest row among
                                    # equal maxima)
                                    if v > bv:
                                        bv = v
                                        bi = a0 + r
                    if pre:
                        # (every lane: the shuffles need the whole warp) the 8 rows of each block, lanes g
                        for blk in cutlass.range_constexpr(2):
                            tot = sq[blk]
                            for off in (4, 8, 16):
                                tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=off)
                            if g == 0 and b < B and blk * 8 < nr:
                                st_f32(ssq_out + (Int64(b) * (H // 8) + Int64((a0 + r0) // 8 + blk)) * 4, tot)
                if is_lm:
                    # (every lane: the shuffles need the whole warp) over the lanes of the same sequences
                    bv, bi = warp_max_index(bv, bi, (16, 8, 4))
                    if g == 0 and b < B:
                        s_wv[warp * B + b] = bv
                        s_wi[warp * B + b] = bi

    @cute.jit
    def part_buffer(self, op: Int32, p):
        """(address, rows, E) of a split stage's part buffer (f32 [L, E, B, rows]); (0, 1, 1) for others."""
        addr = Int64(0)
        rows = Int64(1)
        ranges = Int64(1)
        for code, name in ((OP_QKV, "part_qkv"), (OP_O_PROJ, "part_o"), (OP_DOWN, "part_down")):
            if cutlass.const_expr(code in self.split_widths):
                if op == code:
                    addr = getattr(p, name)
                    rows = Int64(weight_rows(Opcode(code), self.layout)[0])
                    ranges = Int64(k_splits(self.layout, Opcode(code)))
        return addr, rows, ranges

    @cute.jit
    def mv_reduce(self, tidx: Int32, layer: Int32, a0: Int32, a1: Int32, op: Int32, E: Int32, p, rec: Int64):
        """MV_REDUCE: rows a0 .. a0 + a1 of split stage `op` (O_PROJ or DOWN), its E ranges' partials added in range
        order, the residual added, then the stage's epilogue with the pre-staged copy of its output (wide_output)
        and the sums of squares of every 8 rows. A thread takes a quad of consecutive rows of a sequence: each
        range's partials of the quad are one 16-byte load, issued with the residual's (16 bytes) and the norm
        weight's (8) before any sum, so a round is one memory round trip for 4 x the threads' outputs whatever E is;
        the stores are 16 bytes (h or x) and 8 (the pre-staged copy: 4 columns of a sequence are 8 contiguous bytes
        of its core-matrix row). An 8-row sum of squares is a quad's (s0 + s1) + (s2 + s3) plus the neighbour lane's
        (a0 and a1 are multiples of 8, so a quad pair starts on an even lane). One row a thread took 16 // E outputs
        a thread a round: the quads made MV_REDUCE 4.2 -> 2.4 us (O_PROJ) and 4.3 -> 2.9 us (DOWN) a layer at
        llama-3.2-1b 64, and the step 1.660 -> 1.608 ms there, llama-3.1-8b 64 7.545 -> 7.310, 32 6.600 -> 6.476,
        llama-3.2-1b 32 1.448 -> 1.419, qwen3-0.6b 64 1.685 -> 1.659, level at qwen3-0.6b 32 (one round either way;
        H100, profiles/RESULTS.md, 2026-12-08). The same additions in the same order as one row a thread, but not
        the same bits (logits 2-4e-3 apart, relative): PTX's mul.f32 and add.f32 leave ptxas free to fuse a square
        into its first addition, which it does in the quad's own sums; the stage tests hold either to float64. A
        warp's lanes take every round together (the shuffle needs the whole warp). With KernelOptions.trace: when
        it starts (TR_STAGED) and when the last round's stores are issued (TR_CONSUMED) in its trace record (rec)."""
        B, H = self.B, self.H
        EM = max(k_splits(self.layout, code) for code in REDUCED_STAGES)
        l64 = Int64(layer)
        part_addr, part_rows, _ = self.part_buffer(op, p)
        res_addr = p.x                                    # the residual: O_PROJ x[l], DOWN h[l]
        if op == OP_DOWN:
            res_addr = p.h
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                st_i32(rec + TR_STAGED * 4, globaltimer_lo())
        wout, gamma, ssq_out = self.wide_output(op, layer, p)
        q1 = a1 // 4                                      # quads of a sequence's rows (even: a1 is a multiple of 8)
        nq = q1 * B
        step = Int64(B) * part_rows                       # range e of a row is e * B rows of part further on
        for q in range(tidx, (nq + 31) // 32 * 32, self.cthreads):
            pv = cute.make_rmem_tensor((4 * EM,), Float32)   # the partials, range by range
            rv = cute.make_rmem_tensor((4,), Float32)        # the residual
            nw = cute.make_rmem_tensor((2,), Int32)          # the next stage's norm weight, 4 packed bf16
            for c in cutlass.range_constexpr(4):
                rv[c] = Float32(0.0)
                for e in cutlass.range_constexpr(EM):
                    pv[e * 4 + c] = Float32(0.0)
            nw[0] = Int32(0)
            nw[1] = Int32(0)
            b = q // q1
            r = a0 + 4 * (q - b * q1)
            if q < nq:
                w = load_nc_b32x2(gamma + Int64(r) * 2)
                nw[0] = w[0]
                nw[1] = w[1]
                x = load_f32x4(res_addr + ((l64 * B + Int64(b)) * H + Int64(r)) * 4)
                for c in cutlass.range_constexpr(4):
                    rv[c] = x[c]
                at = part_addr + ((l64 * E * B + Int64(b)) * part_rows + Int64(r)) * 4
                for e in cutlass.range_constexpr(EM):
                    if e < E:
                        y4 = load_f32x4(at + Int64(e) * step * 4)
                        for c in cutlass.range_constexpr(4):
                            pv[e * 4 + c] = y4[c]
            sq = cute.make_rmem_tensor((4,), Float32)        # the outputs' squares
            for c in cutlass.range_constexpr(4):
                sq[c] = Float32(0.0)
            if q < nq:
                g01 = unpack_bf16x2(nw[0])
                g23 = unpack_bf16x2(nw[1])
                v = cute.make_rmem_tensor((4,), Float32)
                for c in cutlass.range_constexpr(4):
                    y = Float32(0.0)
                    for e in cutlass.range_constexpr(EM):
                        if e < E:
                            y = y + pv[e * 4 + c]
                    v[c] = rv[c] + y
                    sq[c] = v[c] * v[c]
                hrow = (l64 * B + Int64(b)) * H + Int64(r)
                if op == OP_O_PROJ:
                    st_f32x4(p.h + hrow * 4, v[0], v[1], v[2], v[3])
                if op == OP_DOWN:
                    st_f32x4(p.x + (hrow + Int64(B * H)) * 4, v[0], v[1], v[2], v[3])
                st_b32x2(wout + Int64(wide_x_byte(b, r, B)), pack_bf16x2(v[0] * g01[0], v[1] * g01[1]),
                         pack_bf16x2(v[2] * g23[0], v[3] * g23[1]))
            # the sums of squares of every 8 rows: this quad's, then its neighbour lane's
            tot = (sq[0] + sq[1]) + (sq[2] + sq[3])
            tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=1)
            if q < nq and q % 2 == 0:
                st_f32(ssq_out + (Int64(b) * (H // 8) + Int64(r // 8)) * 4, tot)
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
