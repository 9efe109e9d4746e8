"""Device code of the matvec stages past SPLIT_BATCH (batch 9-64), and of MV_REDUCE.

At batch 1-8 (megakernel.kernel.matvec) each slot part goes to the warp that owns its ring slot, which stores one
partial sum per (row, slab, part, sequence) in shared memory; with 64 sequences those partials would leave chunks
of a few rows, each staging the input again. Here (docs/batch_path.md):
  - a chunk is G x WIDE_WARPS row groups of ITEM_ROWS rows (G = stream.wide_groups: 1 or 2), and consumer warp w
    owns row groups w, w + WIDE_WARPS, ... of every chunk: it multiplies those row groups' slots of every slab into
    float32 accumulators in its registers (m16n8k16 MMAs: the batch is M, in m-tiles of 16 sequences, its input
    staged as bf16 A fragments, one 16-byte load per lane and k-step (stream.wide_x_word); each 8-row block of the
    weights is N, the fragment-packed slot giving a lane its B registers of two k-steps in one 16-byte load;
    tools/activation_precision.py has what bf16 inputs cost in accuracy), so a chunk's input is staged once;
  - every consumer warp waits for every slot and arrives on its empty barrier (initialised to WIDE_WARPS), so each
    use of a ring slot is complete before any warp waits for the next one (the parity of an mbarrier wait is
    exact), whichever warp reads it;
  - at the chunk's end each warp runs the epilogue of its own rows from its registers: the stage's store, or,
    for a tile of a K range of a stage split over K (split_k.py), the float32 partial into part_<stage>, with
    the range's sum of squares of the input for the stages with a norm (part_ssq);
  - MV_REDUCE adds a row range's partials in range order, times the RMS scale from the ranges' sums of squares
    (added in range order too: the same bits every run), and runs the stage's epilogue.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from ..instructions.layout import ROW_GROUP
from ..instructions.matvec_stages import weight_rows
from ..instructions.opcodes import Opcode
from ..instructions.split_k import k_splits
from .matvec import LOAD_KP, silu
from .ptx import (globaltimer_lo, ld_f32, load_shared_raw, mbarrier_arrive, mma_bf16_16816, rsqrt, st_f32, st_f32x2,
                  st_i32, warp_max_index)
from .stream import (ITEM_ROWS, M_TILE, SLAB_COLS, SLOT_BYTES, TR_CONSUMED, TR_LANDED_FIRST, TR_LANDED_LAST, TR_STAGED,
                     WIDE_WARPS, m_tiles, wide_x_lane_word)

OP_QKV, OP_O_PROJ, OP_GATE_UP = int(Opcode.QKV), int(Opcode.O_PROJ), int(Opcode.GATE_UP)
OP_DOWN, OP_LM_HEAD = int(Opcode.DOWN), int(Opcode.LM_HEAD)


class WideMatvec:
    """Consumer-side matvec past SPLIT_BATCH and MV_REDUCE (a mixin of the interpreter)."""

    def chains(self) -> int:
        """Independent accumulator chains per (8-row block, m-tile): even and odd 32-column blocks where there is
        one m-tile, so an item is not two chains of dependent MMAs."""
        return 2 if m_tiles(self.B) == 1 else 1

    def group_accumulators(self) -> int:
        """float32 accumulators a lane holds for one owned row group: a C fragment (4) per chain, 8-row block and
        m-tile (wide_item's acc layout)."""
        return self.chains() * 2 * m_tiles(self.B) * 4

    def wide_load_kp(self) -> int:
        """32-column blocks whose B registers (8 words per lane) a warp loads at once: LOAD_KP, or 2 where a warp's
        accumulators take 64 registers (two row groups of 4 m-tiles), so that the MMA loop and the epilogue fit
        the registers without spills."""
        return 2 if self.wide_groups * self.group_accumulators() > 32 else LOAD_KP

    @cute.jit
    def matvec_wide(self, tidx: Int32, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, a1: Int32,
                    tile: Int32, kpart: Int32, split: Boolean, k_row: Int32, K: Int32, k0: Int32, slab: Int32,
                    n_slab: Int32, chunk: Int32, xsl: Int32, merge: Boolean, from_embed: Boolean,
                    has_norm: Boolean, has_res: Boolean, in_addr: Int64, norm_addr: Int64, out_addr: Int64,
                    out_w: Int32, res_addr: Int64, k_slot: Int32, ring: Int32, full: Int32, empty: Int32, p, s,
                    rec: Int64) -> Int32:
        """One tile past SPLIT_BATCH (matvec's arguments, resolved): columns k0 .. k0 + K of rows a0 .. a0 + a1
        (k_row columns per weight row and input row)."""
        B = self.B
        G = self.wide_groups
        NA = self.group_accumulators()
        is_lm = op == OP_LM_HEAD
        whole = xsl >= n_slab
        ss = cute.make_rmem_tensor((1,), Float32)      # (stage adds the sums of squares into s.wv instead)
        ss[0] = Float32(0.0)
        s_wv = s.wv
        if lane == 0:
            for b in range(B):
                s_wv[warp * B + b] = Float32(0.0)
        if whole:
            self.stage(tidx, layer, k_row, merge, from_embed, has_norm, in_addr, norm_addr, p, s, ss, k0, K,
                       Int32(0))
            if has_norm:
                self.norm_statistic(tidx, layer, op, kpart, split, k_row, p, s)
            self.consumer_sync()
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    st_i32(rec + TR_STAGED * 4, globaltimer_lo())
        if is_lm:
            self.reset_tile_maximum(tidx, s)
        x_base = s.x_addr
        g_own = warp * ITEM_ROWS          # the first row group this warp owns in every chunk (then every
        GS = WIDE_WARPS * ITEM_ROWS       # GS rows further: G in all)
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
                col0 = sl * slab
                width = K - sl * slab
                if width > slab:
                    width = slab
                if not whole:
                    w0 = sl - sl % xsl
                    col0 = (sl - w0) * slab
                    if sl == w0:
                        ww = K - w0 * slab
                        if ww > xsl * slab:
                            ww = xsl * slab
                        self.consumer_sync()      # the previous window is read: this one may overwrite it
                        self.stage(tidx, layer, k_row, merge, from_embed, has_norm and c0 == 0, in_addr, norm_addr,
                                   p, s, ss, k0 + w0 * slab, ww, Int32(0))
                        self.consumer_sync()
                        if cutlass.const_expr(self.options.trace):
                            if tidx == 0 and c0 == 0 and sl == 0:
                                st_i32(rec + TR_STAGED * 4, globaltimer_lo())
                for g0 in range(0, rows, ITEM_ROWS):
                    slot = k_slot % self.ring_slots
                    mb = slot * 8
                    self.wait_full(full + mb, (k_slot // self.ring_slots) % 2, p.error)
                    if cutlass.const_expr(self.options.trace):
                        if tidx == 0:
                            if c0 == 0 and sl == 0 and g0 == 0:
                                st_i32(rec + TR_LANDED_FIRST * 4, globaltimer_lo())
                            if c0 + rows >= a1 and sl == n_slab - 1 and g0 + ITEM_ROWS >= rows:
                                st_i32(rec + TR_LANDED_LAST * 4, globaltimer_lo())
                    for j in cutlass.range_constexpr(G):
                        if g0 == g_own + j * GS:
                            self.wide_item(lane, slab, width, ring + slot * SLOT_BYTES, x_base, col0, acc, j * NA)
                    cute.arch.sync_warp()
                    if lane == 0:
                        mbarrier_arrive(empty + mb)       # every consumer warp passes every slot
                    k_slot = k_slot + 1
            if not whole and c0 == 0 and has_norm:
                self.norm_statistic(tidx, layer, op, kpart, split, k_row, p, s)
            self.consumer_sync()
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())
            self.epilogue_wide(warp, lane, op, layer, a0, c0, rows - g_own, kpart, split, has_norm, has_res,
                               out_addr, out_w, res_addr, acc, p, s)
            if is_lm:
                self.merge_chunk_maxima(tidx, s)
        if is_lm:
            self.store_tile_maximum(tidx, tile, p, s)
        return k_slot

    @cute.jit
    def wide_item(self, lane: Int32, slab: Int32, width: Int32, slot_addr: Int32, x_base: Int32, col0: Int32,
                  acc: cute.Tensor, a_base: int):
        """A slot's row group (16 rows: two 8-row blocks, the second absent from a slot of 8 rows) times every
        sequence's staged input, added to acc: acc[a_base + ((ch * 2 + blk) * NM + mt) * 4 + i] is the C fragment i
        of chain ch, block blk, m-tile mt (sequences mt * 16 + lane // 4 and + 8, rows blk * 8 + 2 (lane % 4) and the
        next).
        The slot holds per 8-row block (slab * 16 bytes apart) 512-byte blocks of 32 columns in which lane l's 16
        bytes are its B registers (row l // 4) of the block's two k-steps; the staged input's k-steps from col0 (a
        multiple of 128 columns, so its k-step count is a multiple of 8 and wide_x_lane_word's lane permutation is
        that of the slab's own k-step) hold the A registers (stream.wide_x_lane_word)."""
        NM, CH = m_tiles(self.B), self.chains()
        KP = self.wide_load_kp()
        kp_w = width // 32
        IKP = SLAB_COLS // 32
        top = slot_addr + lane * 16
        bottom = top + slab * 16                        # the second 8-row block
        xa = x_base + (col0 // 16) * NM * 512          # the slab's first k-step of the staged input
        for hf in cutlass.range_constexpr(IKP // KP):
            # the B registers of KP blocks, loaded whatever the slot holds: blocks past the slab's width are
            # not multiplied, and an absent second 8-row block only gives the C columns of rows the tile does not
            # have, which the epilogue does not store (the loads stay inside the slot: 2 x 16 blocks of 512 bytes)
            w = cute.make_rmem_tensor((KP * 8,), Int32)
            for uu in cutlass.range_constexpr(KP):
                u = hf * KP + uu
                v = load_shared_raw(top + u * 512)
                for e in cutlass.range_constexpr(4):
                    w[uu * 8 + e] = v[e]
                v = load_shared_raw(bottom + u * 512)
                for e in cutlass.range_constexpr(4):
                    w[uu * 8 + 4 + e] = v[e]
            for uu in cutlass.range_constexpr(KP):
                u = hf * KP + uu
                if u < kp_w:
                    for kb in cutlass.range_constexpr(2):
                        for mt in cutlass.range_constexpr(NM):
                            a0, a1, a2, a3 = load_shared_raw(xa + wide_x_lane_word(2 * u + kb, mt, lane, NM) * 4)
                            for blk in cutlass.range_constexpr(2):
                                q = uu * 8 + blk * 4 + kb * 2
                                c = a_base + (((u % CH) * 2 + blk) * NM + mt) * 4
                                d = mma_bf16_16816(a0, a1, a2, a3, w[q], w[q + 1],
                                                   acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
                                for i in cutlass.range_constexpr(4):
                                    acc[c + i] = d[i]

    @cute.jit
    def norm_statistic(self, tidx: Int32, layer: Int32, op: Int32, kpart: Int32, split: Boolean, k_row: Int32, p, s):
        """Every sequence's sum of squares over the staged columns (each warp's share in s.wv): for a K range's
        tile, stored into part_ssq (MV_REDUCE scales), s.rstd = 1; else s.rstd = rsqrt(mean + eps). A barrier is
        needed before s.rstd is read."""
        s_rstd, s_wv = s.rstd, s.wv
        B = self.B
        self.consumer_sync()          # every warp's sums (stage: s.wv slot warp * B + b) are in
        if tidx < B:
            tot = Float32(0.0)
            for w in range(self.warps):
                tot = tot + s_wv[w * B + tidx]
            if split:
                st_f32(self.ssq_addr(p, layer, op, kpart, tidx), tot)
                s_rstd[tidx] = Float32(1.0)
            else:
                s_rstd[tidx] = rsqrt(tot / Float32(k_row) + Float32(self.eps))

    @cute.jit
    def ssq_addr(self, p, layer: Int32, op: Int32, e: Int32, b: Int32) -> Int64:
        """Address of K range e's sum of squares of sequence b's input to QKV or GATE_UP (part_ssq, f32
        [L, 2, E, B])."""
        st = Int32(0)
        if op == OP_GATE_UP:
            st = Int32(1)
        return p.part_ssq + (((Int64(layer) * 2 + Int64(st)) * self.E_ssq + Int64(e)) * self.B + Int64(b)) * 4

    @cute.jit
    def epilogue_wide(self, warp: Int32, lane: Int32, op: Int32, layer: Int32, a0: Int32, c0: Int32, nr0: Int32,
                      kpart: Int32, split: Boolean, has_norm: Boolean, has_res: Boolean, out_addr: Int64,
                      out_w: Int32, res_addr: Int64, acc: cute.Tensor, p, s):
        """The warp's rows of chunk c0 from its accumulators: owned group j (acc[j * NA ...]) is rows c0 + warp *
        ITEM_ROWS + j * WIDE_WARPS * ITEM_ROWS and the next ITEM_ROWS of the tile, of which nr0 - j * WIDE_WARPS *
        ITEM_ROWS exist (<= 0: none; a multiple of 8); lane (g, t) holds sequences mt * 16 + g and + 8, rows
        blk * 8 + 2t and the next (wide_item). A K range's partial into part_<stage>, else the stage's store (the
        RMS scale, the residual, SiLU(gate) * up: a row group's gate rows are its first 8, its up rows the next 8,
        so a lane holds both of its two outputs); the LM head also its (max, lowest index) per sequence over both
        groups into s.wv / s.wi slot warp * B + b."""
        s_rstd, s_wi, s_wv = s.rstd, s.wi, s.wv
        B, H = self.B, self.H
        NM, CH, G, NA = m_tiles(B), self.chains(), self.wide_groups, self.group_accumulators()
        GS = WIDE_WARPS * ITEM_ROWS
        g = lane // 4
        t = lane - g * 4
        is_gate_up = op == OP_GATE_UP
        is_lm = op == OP_LM_HEAD
        part_addr, part_rows, part_e = self.part_buffer(op, p)
        for mt in cutlass.range_constexpr(NM):
            for hf in cutlass.range_constexpr(2):
                b = mt * M_TILE + hf * 8 + g
                bv = Float32(-math.inf)
                bi = Int32(0x7FFFFFFF)
                for j in cutlass.range_constexpr(G):
                    r0 = c0 + warp * ITEM_ROWS + j * GS
                    nr = nr0 - j * GS
                    if nr > ITEM_ROWS:
                        nr = ITEM_ROWS
                    y = cute.make_rmem_tensor((4,), Float32)      # [block][row 2t, 2t + 1]
                    for blk in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            y[blk * 2 + e] = acc[j * NA + (blk * NM + mt) * 4 + hf * 2 + e]
                            for ch in cutlass.range_constexpr(1, CH):
                                y[blk * 2 + e] = (y[blk * 2 + e]
                                                  + acc[j * NA + ((ch * 2 + blk) * NM + mt) * 4 + hf * 2 + e])
                    if b < B:
                        scale = Float32(1.0)
                        if has_norm:
                            scale = s_rstd[b]
                        ob = out_addr + Int64(b) * Int64(out_w) * 4
                        if split:
                            for blk in cutlass.range_constexpr(2):
                                if blk * 8 < nr:
                                    st_f32x2(part_addr + (((Int64(layer) * part_e + Int64(kpart)) * B + Int64(b))
                                                          * part_rows + Int64(a0 + r0 + blk * 8 + 2 * t)) * 4,
                                             y[blk * 2], y[blk * 2 + 1])
                        elif is_gate_up:
                            if nr > 0:
                                st_f32x2(ob + Int64(r0 // 2 + 2 * t) * 4, silu(y[0] * scale) * (y[2] * scale),
                                         silu(y[1] * scale) * (y[3] * scale))
                        else:
                            for blk in cutlass.range_constexpr(2):
                                r = r0 + blk * 8 + 2 * t
                                if blk * 8 < nr:
                                    v0 = y[blk * 2] * scale
                                    v1 = y[blk * 2 + 1] * scale
                                    if has_res:
                                        rb = res_addr + (Int64(b) * Int64(H) + Int64(r)) * 4
                                        v0 = v0 + ld_f32(rb)
                                        v1 = v1 + ld_f32(rb + 4)
                                    st_f32x2(ob + Int64(r) * 4, v0, v1)
                                    if is_lm:
                                        # (groups in row order and a strict comparison: the lowest row among
                                        # equal maxima)
                                        if v0 > bv:
                                            bv = v0
                                            bi = a0 + r
                                        if v1 > bv:
                                            bv = v1
                                            bi = a0 + r + 1
                if is_lm:
                    # (every lane: the shuffles need the whole warp) the lowest row among equal maxima
                    bv, bi = warp_max_index(bv, bi, (2, 1))
                    if t == 0 and b < B:
                        s_wv[warp * B + b] = bv
                        s_wi[warp * B + b] = bi

    @cute.jit
    def part_buffer(self, op: Int32, p):
        """(address, rows, E) of a split stage's part buffer (f32 [L, E, B, rows]); (0, 1, 1) for others."""
        addr = Int64(0)
        rows = Int64(1)
        ranges = Int64(1)
        for code, name in ((OP_QKV, "part_qkv"), (OP_O_PROJ, "part_o"), (OP_GATE_UP, "part_gate_up"),
                           (OP_DOWN, "part_down")):
            if cutlass.const_expr(code in self.split_widths):
                if op == code:
                    addr = getattr(p, name)
                    rows = Int64(weight_rows(Opcode(code), self.layout)[0])
                    ranges = Int64(k_splits(self.layout, Opcode(code)))
        return addr, rows, ranges

    @cute.jit
    def mv_reduce(self, tidx: Int32, layer: Int32, a0: Int32, a1: Int32, op: Int32, E: Int32, p, s):
        """MV_REDUCE: rows a0 .. a0 + a1 of split stage `op`, its E ranges' partials added in range order, times
        the RMS scale from the ranges' sums of squares (QKV, GATE_UP), then the stage's epilogue; one thread per
        output, consecutive threads on consecutive rows of a sequence."""
        s_rstd = s.rstd
        B, H = self.B, self.H
        l64 = Int64(layer)
        part_addr, part_rows, _ = self.part_buffer(op, p)
        has_norm = op == OP_QKV or op == OP_GATE_UP
        if has_norm:
            if tidx < B:
                tot = Float32(0.0)
                for e in range(E):
                    tot = tot + ld_f32(self.ssq_addr(p, layer, op, e, tidx))
                s_rstd[tidx] = rsqrt(tot / Float32(self.H) + Float32(self.eps))
            self.consumer_sync()
        n_out = a1
        if op == OP_GATE_UP:
            n_out = a1 // 2
        for i in range(tidx, n_out * B, self.cthreads):
            b = i // n_out
            j = i - b * n_out
            scale = Float32(1.0)
            if has_norm:
                scale = s_rstd[b]
            base = (l64 * E * B + Int64(b)) * part_rows       # range 0 of sequence b; range e is e * B rows on
            step = Int64(B) * part_rows
            if op == OP_GATE_UP:
                pr = j // ROW_GROUP
                gr = a0 + pr * (2 * ROW_GROUP) + (j - pr * ROW_GROUP)
                g = Float32(0.0)
                up = Float32(0.0)
                for e in range(E):
                    g = g + ld_f32(part_addr + (base + Int64(e) * step + Int64(gr)) * 4)
                    up = up + ld_f32(part_addr + (base + Int64(e) * step + Int64(gr + ROW_GROUP)) * 4)
                st_f32(p.act + ((l64 * B + Int64(b)) * self.F + Int64(a0 // 2 + j)) * 4, silu(g * scale) * (up * scale))
            else:
                r = a0 + j
                y = Float32(0.0)
                for e in range(E):
                    y = y + ld_f32(part_addr + (base + Int64(e) * step + Int64(r)) * 4)
                y = y * scale
                if op == OP_QKV:
                    st_f32(p.qkv + ((l64 * B + Int64(b)) * self.QKV + Int64(r)) * 4, y)
                if op == OP_O_PROJ:
                    row = (l64 * B + Int64(b)) * H + Int64(r)
                    st_f32(p.h + row * 4, ld_f32(p.x + row * 4) + y)
                if op == OP_DOWN:
                    row = (l64 * B + Int64(b)) * H + Int64(r)
                    st_f32(p.x + (row + Int64(B * H)) * 4, ld_f32(p.h + row * 4) + y)
