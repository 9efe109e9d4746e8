"""Device code of the five matvec stages (QKV, O_PROJ, GATE_UP, DOWN, LM_HEAD) on the consumer warps.

The stage's record, operands and torch reference are in megakernel.instructions.matvec_stages. Here:
  1. the input row of every sequence (x * norm weight, O_PROJ's merge of the attention splits, or layer
     0's embedding row) is staged in shared memory, whole or one column slab at a time, with sum(x^2) for the
     RMSNorm of the stages that have one (megakernel.kernel.staging);
  2. the tile's weight slots arrive in the ring (megakernel.kernel.stream); at batch 1-8 (past it:
     megakernel.kernel.matvec_wide) each slot's P parts (whole slots at batch 2-8, halves at batch 1:
     stream.slot_parts) go to P consumer warps, each of which waits for
     the slot, multiplies its part on the tensor cores (m16n8k16 MMAs, one per 8-row block and 4 sequences:
     the weights, fragment-packed at load time, are A, 16 bytes per lane as they lie; the batch, two N columns
     a sequence, is B, its input staged in bf16: consume_item) into one float32 partial per (row, slab, part,
     sequence), and frees its part;
  3. per chunk of rows, one thread per output adds its partials in a fixed order (the same bits every
     run) and runs the epilogue: store, residual add, SiLU-and-multiply, or logits + tile argmax.
At batch 1 on one GPU (instructions.flagged) x, h, act and qkv are {value, epoch} words: the epilogues of QKV,
O_PROJ, GATE_UP and DOWN store them with st_flagged, and the matvecs in POLLING stage their input by polling the
words (staging.stage_round_polled) instead of a counter wait; DOWN's residual h is read past that poll.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from ..instructions.flagged import POLLING
from ..instructions.layout import ROW_GROUP
from ..instructions.opcodes import Opcode
from .ptx import (ex2, globaltimer_lo, ld_f32, load_shared_b32, load_shared_raw, max_index, mbarrier_arrive,
                  mma_bf16_16816, rsqrt, st_f32, st_flagged, st_i32, warp_max_index, warp_sum)
from .ring_model import reader_warp
from .stream import (ITEM_ROWS, PEER_LM_IDX, PEER_LM_MAX, PEER_RECV_DOWN, PEER_RECV_O, SLAB_COLS, SLOT_BYTES,
                     TR_CONSUMED, TR_EPILOGUE, TR_LANDED_FIRST, TR_LANDED_LAST, TR_REACHED_LAST, TR_STAGED,
                     TR_STAGING, TR_WAIT_LANDED, X_PAD, mark_hop)

LOAD_KP = 4                # 32-column blocks whose weight loads are in flight at once (8 x 16 bytes per lane)

OP_QKV, OP_O_PROJ, OP_GATE_UP = int(Opcode.QKV), int(Opcode.O_PROJ), int(Opcode.GATE_UP)
OP_DOWN, OP_LM_HEAD = int(Opcode.DOWN), int(Opcode.LM_HEAD)
LOG2E = 1.4426950408889634


@cute.jit
def silu(g: Float32) -> Float32:
    """g * sigmoid(g) in float32 (GATE_UP's epilogue)."""
    return g / (Float32(1.0) + ex2(-g * Float32(LOG2E)))


@cute.jit
def opcode_in(op: Int32, opcodes: cutlass.Constexpr, qkv_from_embed: Boolean) -> Boolean:
    """Whether stage `op` is one of `opcodes` (instructions.flagged's POLLING or UNSIGNALLED), QKV not counted where
    qkv_from_embed (layer 0's QKV of a folded embedding, which reads embed[token] and polls nothing)."""
    hit = op == int(opcodes[0])
    for i in cutlass.range_constexpr(1, len(opcodes)):
        if cutlass.const_expr(opcodes[i] == Opcode.QKV):
            hit = hit or (op == OP_QKV and not qkv_from_embed)
        else:
            hit = hit or op == int(opcodes[i])
    return hit


class MatvecStage:
    """Consumer-side matvec (a mixin of the interpreter)."""

    @cute.jit
    def matvec(self, tidx: Int32, warp: Int32, lane: Int32, op: Int32, xch: Int32, layer: Int32, a0: Int32,
               a1: Int32, tile: Int32, a3: Int32, kpart: Int32, kparts: Int32, k_slot: Int32, ring: Int32,
               full: Int32, empty: Int32, p, s, rec: Int64) -> Int32:
        """One tile (rows a0 .. a0 + a1 - 1; columns of K range kpart of kparts) of a matvec stage; k_slot is
        the CTA's slot count before it, returned advanced by the tile's slots (up to SPLIT_BATCH modulo 2 x
        ring_slots: the ring index and the parity are all the consumers read of it). `p` holds the step's global
        addresses (StepArgs), `s` the shared-memory scratch (SharedScratch). xch != 0: a tensor-parallel
        exchange stage (stream.dense_opcode), whose partial sums (TP_O_PROJ, TP_DOWN; no residual) or tile maximum
        (TP_LM_HEAD, in slot rank x tiles per rank + tile) go to every rank (megakernel.kernel.tensor_parallel)."""
        B, H = self.B, self.H
        l64 = Int64(layer)
        _, k_row = self.weight_tile(op, layer, a0, p.w_qkv, p.w_o, p.w_gate_up, p.w_down, p.w_lm_head)
        split = kparts > 1
        K, slab, n_slab, rps, chunk, xsl = self.tile_geometry(op, split)
        k0 = kpart * K                  # the first column of the tile's K range (0 unless split)
        # input rows (one per sequence, width K), norm weights, output rows, residual rows
        in_addr = Int64(0)
        norm_addr = p.ones
        has_norm = Boolean(False)
        out_addr = Int64(0)
        out_w = Int32(0)
        res_addr = Int64(0)
        has_res = Boolean(False)
        # bytes per word of x, h, act and qkv: {value, epoch} pairs where the hops are flagged (instructions.flagged)
        xh = 8 if self.flagged else 4
        if op == OP_QKV:
            in_addr = p.x + l64 * (B * H * xh)
            norm_addr = p.attn_norm + l64 * (H * 2)
            has_norm = Boolean(True)
            out_addr = p.qkv + (l64 * (B * self.QKV) + Int64(a0)) * xh
            out_w = Int32(self.QKV)
        if op == OP_O_PROJ:
            in_addr = p.attn_out + l64 * (B * self.Q * 4)
            out_addr = p.h + (l64 * (B * H) + Int64(a0)) * xh
            out_w = Int32(H)
            res_addr = p.x + (l64 * (B * H) + Int64(a0)) * xh
            has_res = Boolean(True)
        if op == OP_GATE_UP:
            in_addr = p.h + l64 * (B * H * xh)
            norm_addr = p.mlp_norm + l64 * (H * 2)
            has_norm = Boolean(True)
            out_addr = p.act + (l64 * (B * self.F) + Int64(a0 // 2)) * xh
            out_w = Int32(self.F)
        if op == OP_DOWN:
            in_addr = p.act + l64 * (B * self.F * xh)
            out_addr = p.x + ((l64 + 1) * (B * H) + Int64(a0)) * xh
            out_w = Int32(H)
            res_addr = p.h + (l64 * (B * H) + Int64(a0)) * xh
            has_res = Boolean(True)
        if op == OP_LM_HEAD:
            in_addr = p.x + Int64(self.L) * (B * H * xh)
            norm_addr = p.final_norm
            has_norm = Boolean(True)
            out_addr = p.logits + Int64(a0) * 4
            out_w = Int32(self.V)
        if cutlass.const_expr(self.W > 1):
            if xch != 0:
                if op == OP_LM_HEAD:
                    tile = tile + self.rank * a3              # the rank's argmax slots follow the lower ranks'
                else:
                    # slot `rank` of every rank's receive buffer [L, W, B, H]: an offset from each rank's base
                    out_addr = ((l64 * self.W + self.rank) * (B * H) + Int64(a0)) * 4
                    has_res = Boolean(False)
        merge = op == OP_O_PROJ and a3 > 0      # O_PROJ's input is the merge of the attention splits
        from_embed = op == OP_QKV and a3 == 1   # layer 0's QKV reads embed[token] (embed_folded layouts)
        if cutlass.const_expr(self.wide):
            k_slot = self.matvec_wide(tidx, warp, lane, op, layer, a0, a1, tile, kpart, split, K, k0, slab, n_slab,
                                      chunk, xsl, has_norm, has_res, out_addr, out_w, res_addr, k_slot, ring, full,
                                      empty, p, s, rec)
        else:
            k_slot = self.matvec_narrow(tidx, warp, lane, op, xch, layer, a0, a1, tile, K, slab, n_slab, rps, chunk,
                                        xsl, merge, from_embed, has_norm, has_res, in_addr, norm_addr, out_addr,
                                        out_w, res_addr, k_slot, ring, full, empty, p, s, rec)
        return k_slot

    @cute.jit
    def matvec_narrow(self, tidx: Int32, warp: Int32, lane: Int32, op: Int32, xch: Int32, layer: Int32, a0: Int32,
                      a1: Int32, tile: Int32, K: Int32, slab: Int32, n_slab: Int32, rps: Int32, chunk: Int32, xsl: Int32,
                      merge: Boolean, from_embed: Boolean, has_norm: Boolean, has_res: Boolean, in_addr: Int64,
                      norm_addr: Int64, out_addr: Int64, out_w: Int32, res_addr: Int64, k_slot: Int32, ring: Int32,
                      full: Int32, empty: Int32, p, s, rec: Int64) -> Int32:
        """A tile at batch 1-8 (matvec's arguments, resolved; the module docstring's steps)."""
        B, H = self.B, self.H
        whole = xsl >= n_slab
        P = self.plan.parts
        n_seg = n_slab * P              # one partial sum per (row, slab, part, sequence)
        is_gate_up = op == OP_GATE_UP
        is_lm = op == OP_LM_HEAD
        # the residual of this thread's first output (O_PROJ, DOWN), loaded now: its round trip overlaps
        # the input's instead of ending the instruction
        res0 = Float32(0.0)
        n_res0 = a1 * B
        if a1 > chunk:
            n_res0 = chunk * B
        early = has_res
        xh = 8 if self.flagged else 4                 # (flagged hops: the residuals' words are {value, epoch} pairs)
        poll = Boolean(False)                         # (flagged hops: the input polled, as no counter was waited on)
        if cutlass.const_expr(self.flagged):
            early = has_res and op != OP_DOWN     # (DOWN waits for nothing: its residual h is read past the poll)
            poll = opcode_in(op, POLLING, from_embed)
        if early and tidx < n_res0:
            r0 = tidx // B
            res0 = ld_f32(res_addr + (Int64(tidx - r0 * B) * Int64(H) + Int64(r0)) * xh)
        ss = cute.make_rmem_tensor((B,), Float32)
        for b in cutlass.range_constexpr(B):
            ss[b] = Float32(0.0)
        t_staging = Int32(0)              # (trace mode) thread 0's time in the input's staging, ns
        if whole:
            if cutlass.const_expr(self.options.trace):
                t_st = globaltimer_lo()
            self.stage(tidx, layer, K, merge, from_embed, has_norm, poll, in_addr, norm_addr, p, s, ss,
                       Int32(0), K, K // 2 + X_PAD)
            if has_norm:
                self.rms_statistic(tidx, warp, lane, K, ss, s)
            self.consumer_sync()
            if tidx == 0:
                mark_hop(s, 0)                    # the input is staged: the stream's full cap again
            if cutlass.const_expr(self.options.trace):
                t_staging = globaltimer_lo() - t_st
                if tidx == 0:
                    st_i32(rec + TR_STAGED * 4, globaltimer_lo())       # the input staged
        if is_lm:
            self.reset_tile_maximum(tidx, s)
        x_base = s.x_addr
        t_landed = Int32(0)               # (trace mode) this warp's waits for its slots to land, ns
        # The walk's position is k_slot modulo 2 x ring_slots (a slot's ring index and its use's parity are all the
        # consumers need of it), counted along instead of divided out per slot part: every warp walks every part,
        # and at 15 warps a modulo is a chain of ~20 dependent instructions. A part's reader,
        # reader_warp(slot, part, P, readers), is then a subtraction at most where slot * P + part < 2 * readers
        # (every layout the engine builds: at most 12 slots, 2 parts at batch 1, 1 past it; the readers, the most
        # consumer warps that divide the ring's parts, number at least half the parts).
        # (k_slot arrives below 2 x ring_slots: the CTA's count starts at 0, and in a kernel of these batches only
        # this path advances it)
        R, W = self.ring_slots, self.readers     # (the warps that read ring parts: ring_model.ring_readers)
        one_sub = R * P <= 2 * W
        for c0 in range(0, a1, chunk):
            rows = a1 - c0
            if rows > chunk:
                rows = chunk
            if c0 > 0:
                self.consumer_sync()          # the last chunk's epilogue has read its partials
            for sl in range(n_slab):
                col0 = sl * slab          # x column of the slab's first in whole-staged inputs
                width = K - sl * slab     # the slab's columns (the last slab may be narrower)
                if width > slab:
                    width = slab
                xw = K // 2 + X_PAD       # words between two sequences' staged rows
                if not whole:
                    w0 = sl - sl % xsl            # the first slab of the staged window
                    col0 = (sl - w0) * slab
                    xw = xsl * slab // 2 + X_PAD
                    if sl == w0:
                        ww = K - w0 * slab
                        if ww > xsl * slab:
                            ww = xsl * slab
                        if cutlass.const_expr(self.options.trace):
                            t_st = globaltimer_lo()
                        self.consumer_sync()      # the previous window is read: this one may overwrite it
                        self.stage(tidx, layer, K, merge, from_embed, has_norm and c0 == 0, poll, in_addr,
                                   norm_addr, p, s, ss, w0 * slab, ww, xw)
                        self.consumer_sync()
                        if tidx == 0 and c0 == 0 and sl == 0:
                            mark_hop(s, 0)                # the first window is staged
                        if cutlass.const_expr(self.options.trace):
                            t_staging = t_staging + (globaltimer_lo() - t_st)
                            if tidx == 0 and c0 == 0 and sl == 0:
                                st_i32(rec + TR_STAGED * 4, globaltimer_lo())     # the first window staged
                for g0 in range(0, rows, rps):
                    slot = k_slot
                    phase = Int32(0)
                    if k_slot >= R:
                        slot = k_slot - R
                        phase = Int32(1)
                    # part p of ring slot r is read by warp (r * P + p) % warps in every use of the slot, in order,
                    # so a warp's wait for use u never sees the completed phase u - 2 of the same parity
                    for part in cutlass.range_constexpr(P):
                        reader = slot * P + part
                        if cutlass.const_expr(not one_sub):
                            reader = reader_warp(slot, part, P, W)
                        elif reader >= W:
                            reader = reader - W
                        if warp == reader:
                            nr = rows - g0
                            if nr > rps:
                                nr = rps
                            mb = slot * 8
                            if cutlass.const_expr(self.options.trace):
                                t0 = globaltimer_lo()
                            self.wait_full(full + mb, phase, p.error)
                            if cutlass.const_expr(self.options.trace):
                                t_landed = t_landed + (globaltimer_lo() - t0)
                                if lane == 0 and part == 0:
                                    # when the tile's first slot had landed, and its last (and when its reader
                                    # reached the wait)
                                    if c0 == 0 and sl == 0 and g0 == 0:
                                        st_i32(rec + TR_LANDED_FIRST * 4, globaltimer_lo())
                                    if c0 + rows >= a1 and sl == n_slab - 1 and g0 + rps >= rows:
                                        st_i32(rec + TR_LANDED_LAST * 4, globaltimer_lo())
                                        st_i32(rec + TR_REACHED_LAST * 4, t0)
                            for rg in range((nr + ITEM_ROWS - 1) // ITEM_ROWS):
                                if width == SLAB_COLS and rg * ITEM_ROWS + 8 < nr:
                                    # (the common item, every block present: a path without guards)
                                    self.consume_item(lane, rg, part, slab, width, ring + slot * SLOT_BYTES, x_base,
                                                      xw, col0, g0, nr, n_seg, sl, s, 2)
                                elif width == SLAB_COLS and rg * ITEM_ROWS + 8 == nr:
                                    # (a full-width item of one 8-row block, e.g. every item of an 8-row tile:
                                    # again no guards)
                                    self.consume_item(lane, rg, part, slab, width, ring + slot * SLOT_BYTES, x_base,
                                                      xw, col0, g0, nr, n_seg, sl, s, 1)
                                else:
                                    self.consume_item(lane, rg, part, slab, width, ring + slot * SLOT_BYTES, x_base,
                                                      xw, col0, g0, nr, n_seg, sl, s, 0)
                            # every lane of this part's reader releases its own reads of the slot (the
                            # empty barrier counts 32 arrivals a warp: stream.RELEASE_LANES)
                            mbarrier_arrive(empty + mb)
                    k_slot = k_slot + 1
                    if k_slot == 2 * R:
                        k_slot = Int32(0)
            if not whole and c0 == 0 and has_norm:
                self.rms_statistic(tidx, warp, lane, K, ss, s)
            self.consumer_sync()
            if tidx == 0 and c0 + rows >= a1:
                mark_hop(s, 1)                    # past the tile's last slot: the hop begins
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    st_i32(rec + TR_CONSUMED * 4, globaltimer_lo())     # every warp past the chunk's last slot
                    st_i32(rec + TR_WAIT_LANDED * 4, t_landed)          # warp 0's waits for its slots (so far)
                    st_i32(rec + TR_STAGING * 4, t_staging)             # thread 0's staging (so far)
            if cutlass.const_expr(self.flagged):
                if has_res and not early and c0 == 0 and tidx < n_res0:
                    # DOWN's residual, O_PROJ's output h: written before GATE_UP's outputs, which this tile polled
                    # (GATE_UP stages all of h)
                    r0 = tidx // B
                    res0 = ld_f32(res_addr + (Int64(tidx - r0 * B) * Int64(H) + Int64(r0)) * xh)
            self.epilogue(tidx, warp, lane, c0, rows, n_seg, a0, tile, is_gate_up, is_lm, has_norm, has_res,
                          res_addr, res0, out_addr, out_w, xch, op == OP_DOWN, p, s)
        if is_lm:
            self.store_tile_maximum(tidx, tile, xch, p, s)
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                st_i32(rec + TR_EPILOGUE * 4, globaltimer_lo())         # thread 0 past the last epilogue
        return k_slot

    @cute.jit
    def consume_item(self, lane: Int32, rg: Int32, part: int, slab: Int32, width: Int32, slot_addr: Int32,
                     x_base: Int32, xw: Int32, col0: Int32, g0: Int32, nr: Int32, n_seg: Int32, sl: Int32, s,
                     blocks: int):
        """Row group rg x part `part` of a slot of nr rows: 16 rows (the second 8-row block absent where the slot
        ends after the first) x slab / P columns of slab sl, against every sequence's staged input; one partial
        per (row, sequence) into s.part at ((row * n_seg + sl * P + part) * B + b).

        The slot holds, per 8-row block (slab * 16 bytes apart), 512-byte blocks of 32 columns in fragment order
        (fragment_pack): lane (g, t) = (l // 4, l % 4) of a warp finds row g's columns 2t, 2t + 1, 2t + 8, 2t + 9,
        then the same + 16, at 16 * l. Loaded as they lie, those 16 bytes are one m16n8k16 MMA's A registers when
        the MMA's 16 rows are the block's 8 rows twice over, its 16 k the 32 columns in pairs: MMA row g takes
        columns 0-7 and 16-23 of weight row g, row g + 8 columns 8-15 and 24-31. N column 2j holds sequence
        4G + j's input at row g's columns, 2j + 1 at row g + 8's (one MMA per group G of 4 sequences), so that
        sequence's row g is C[g][2j] + C[g + 8][2j + 1], both on lane (g, j). Each 8-row block is its own MMAs:
        no register moves, an absent block's MMAs skipped, not zeroed. The input is staged bf16 at row stride xw
        (words), the slab's first column at col0, in the order store_x_quad writes (per 16-column k-step, words
        2t and 2t + 1 of a row are columns (2t, 2t + 1) and (2t + 8, 2t + 9)): one 4-byte load per k-step and
        group. Lanes past the last sequence load their group's first: their C columns are never read. Columns past
        the slab's width (a narrower last slab) load nothing and add nothing. `blocks` (compile time): 2 or 1, the
        slab is SLAB_COLS wide and the item has both 8-row blocks, or only the first, so every block of it is loaded
        and multiplied without a guard (or the zeroing a guarded register needs to stay out of local memory); 0,
        the general item, each block guarded."""
        s_part = s.part
        B = self.B
        NG = self.seq_groups()
        P = self.plan.parts
        kp_slab = slab // 32                  # 512-byte blocks per 8-row block of the slot
        kp_item = kp_slab // P                # ... per work item
        kp0 = part * kp_item                  # the item's first block
        kp_w = width // 32 - kp0              # ... and how many of its blocks hold columns of this slab
        if kp_w > kp_item:
            kp_w = kp_item
        IKP = SLAB_COLS // 32 // P            # blocks of an item of the widest slab (the unrolled loop's length)
        two = rg * ITEM_ROWS + 8 < nr         # the item's second 8-row block is in the slot
        if cutlass.const_expr(blocks > 0):
            kp_w = Int32(IKP)
            two = Boolean(blocks == 2)
        n = lane // 4
        t = lane - n * 4
        top = slot_addr + (2 * rg * kp_slab + kp0) * 512 + lane * 16
        bot = top + kp_slab * 512
        xa = cute.make_rmem_tensor((NG,), Int32)      # the lane's input address of each group
        for G in cutlass.range_constexpr(NG):
            seq = G * 4 + n // 2
            if seq >= B:
                seq = Int32(G * 4)
            xa[G] = x_base + (seq * xw + (col0 + kp0 * 32) // 2 + 2 * t + n % 2) * 4
        # independent accumulator chains: (top, bottom block) x (even, odd 32-column block) x group, 4 each
        c = cute.make_rmem_tensor((16 * NG,), Float32)
        for i in cutlass.range_constexpr(16 * NG):
            c[i] = Float32(0.0)
        # groups of LOAD_KP blocks (all of an item's weights would not fit the registers beside the rest):
        # each group's weight and input loads, then its MMAs
        LK = min(LOAD_KP, IKP)
        for hf in cutlass.range_constexpr(IKP // LK):
            a = cute.make_rmem_tensor((LK * 8,), Int32)
            bx = cute.make_rmem_tensor((LK * 2 * NG,), Int32)
            if cutlass.const_expr(blocks == 0):
                # (the zeroing keeps the registers of a guarded load out of local memory)
                for e in cutlass.range_constexpr(LK * 8):
                    a[e] = Int32(0)
                for e in cutlass.range_constexpr(LK * 2 * NG):
                    bx[e] = Int32(0)
            for uu in cutlass.range_constexpr(LK):
                if hf * LK + uu < kp_w:           # (always, for a full-width item: kp_w and two are constants then)
                    self.load_block(a, bx, uu, top, bot, xa, hf * LK + uu, two)
            for uu in cutlass.range_constexpr(LK):
                if hf * LK + uu < kp_w:
                    self.mma_block(a, bx, c, uu, hf * LK + uu, two)
        row = g0 + rg * ITEM_ROWS + n
        seg = sl * P + part
        for G in cutlass.range_constexpr(NG):
            if G * 4 + t < B:
                e0 = G * 4                      # chain (top, even) of group G; (top, odd) is NG * 4 on
                out = (row * n_seg + seg) * B + G * 4 + t
                s_part[out] = (c[e0] + c[e0 + NG * 4]) + (c[e0 + 3] + c[e0 + NG * 4 + 3])
                if two:
                    e1 = e0 + NG * 8
                    s_part[out + 8 * n_seg * B] = (c[e1] + c[e1 + NG * 4]) + (c[e1 + 3] + c[e1 + NG * 4 + 3])

    def seq_groups(self) -> int:
        """consume_item's groups of 4 sequences (two N columns each): MMAs per 8-row block and 32 columns."""
        return (self.B + 3) // 4

    @cute.jit
    def load_block(self, a: cute.Tensor, bx: cute.Tensor, uu: int, top: Int32, bot: Int32, xa: cute.Tensor,
                   u: int, two: Boolean):
        """consume_item's loads of 32-column block u into a[uu * 8 ..] (top 8-row block, then bottom where
        `two`) and bx[uu * 2 * NG ..] (per group, the lane's input word of each k-step)."""
        NG = self.seq_groups()
        v = load_shared_raw(top + u * 512)
        for e in cutlass.range_constexpr(4):
            a[uu * 8 + e] = v[e]
        if two:
            v = load_shared_raw(bot + u * 512)
            for e in cutlass.range_constexpr(4):
                a[uu * 8 + 4 + e] = v[e]
        for G in cutlass.range_constexpr(NG):
            bx[(uu * NG + G) * 2] = load_shared_b32(xa[G] + u * 64)
            bx[(uu * NG + G) * 2 + 1] = load_shared_b32(xa[G] + u * 64 + 32)

    @cute.jit
    def mma_block(self, a: cute.Tensor, bx: cute.Tensor, c: cute.Tensor, uu: int, u: int, two: Boolean):
        """consume_item's MMAs of block u: the top 8-row block's into chains (u % 2) * NG + G, the bottom's (where
        `two`) 2 NG further on (chain i is c[4 i ..])."""
        self.mma_rows(a, bx, c, uu, uu * 8, (u % 2) * self.seq_groups())
        if two:
            self.mma_rows(a, bx, c, uu, uu * 8 + 4, (2 + u % 2) * self.seq_groups())

    @cute.jit
    def mma_rows(self, a: cute.Tensor, bx: cute.Tensor, c: cute.Tensor, uu: int, q: int, chain0: int):
        """One 8-row block's MMAs (its A registers a[q .. q + 3]), group G's into chain chain0 + G."""
        for G in cutlass.range_constexpr(self.seq_groups()):
            b = (uu * self.seq_groups() + G) * 2
            ch = (chain0 + G) * 4
            d = mma_bf16_16816(a[q], a[q + 1], a[q + 2], a[q + 3], bx[b], bx[b + 1], c[ch], c[ch + 1], c[ch + 2],
                               c[ch + 3])
            for i in cutlass.range_constexpr(4):
                c[ch + i] = d[i]

    @cute.jit
    def epilogue(self, tidx: Int32, warp: Int32, lane: Int32, c0: Int32, rows: Int32, n_seg: Int32, a0: Int32,
                 tile: Int32, is_gate_up: Boolean, is_lm: Boolean, has_norm: Boolean, has_res: Boolean,
                 res_addr: Int64, res0: Float32, out_addr: Int64, out_w: Int32, xch: Int32, is_down: Boolean, p,
                 s):
        """One chunk's outputs, one thread per (row, sequence): the row's partials summed in segment order,
        times the RMSNorm scale, then the stage's store; the LM head also reduces the chunk's (max, argmax)
        into the tile's per sequence (ties -> lowest row). No barrier at the end: the next chunk begins
        with one, and the instruction's signal follows one. A tensor-parallel exchange (xch != 0, not the LM
        head) stores into its slot of every rank's receive buffer (out_addr an offset from each one's base;
        is_down: recv_down, else recv_o)."""
        s_part, s_rstd, s_wi, s_wv = s.part, s.rstd, s.wi, s.wv
        B, H = self.B, self.H
        xh = 8 if self.flagged else 4                 # (flagged hops: x, h, act and qkv as {value, epoch} words)
        word = Int32(PEER_RECV_O)         # (an exchange: the receive buffer it stores into)
        if is_down:
            word = Int32(PEER_RECV_DOWN)
        n_out = rows * B
        if is_gate_up:
            n_out = (rows // 2) * B
        for t in range(tidx, n_out, self.cthreads):
            r = t // B
            b = t - r * B
            scale = Float32(1.0)
            if has_norm:
                scale = s_rstd[b]
            ob = out_addr + Int64(b) * Int64(out_w) * 4
            if cutlass.const_expr(self.flagged):
                if not is_lm:
                    ob = out_addr + Int64(b) * Int64(out_w) * 8      # (act, h, x, qkv: all but the logits)
            if is_gate_up:
                # output r = (pair p, row j): gate row p*16+j, up row p*16+8+j
                pr = r // ROW_GROUP
                jr = r - pr * ROW_GROUP
                gr = pr * (2 * ROW_GROUP) + jr
                g = Float32(0.0)
                up = Float32(0.0)
                for sg in range(n_seg):
                    g = g + s_part[(gr * n_seg + sg) * B + b]
                    up = up + s_part[((gr + ROW_GROUP) * n_seg + sg) * B + b]
                g = g * scale
                up = up * scale
                if cutlass.const_expr(self.flagged):
                    st_flagged(ob + Int64(c0 // 2 + r) * 8, silu(g) * up, s.ctrl[0] + 1)
                else:
                    st_f32(ob + Int64(c0 // 2 + r) * 4, silu(g) * up)
            else:
                y = Float32(0.0)
                for sg in range(n_seg):
                    y = y + s_part[(r * n_seg + sg) * B + b]
                y = y * scale
                if has_res:
                    if c0 == 0 and t == tidx:
                        y = y + res0
                    else:
                        y = y + ld_f32(res_addr + (Int64(b) * Int64(H) + Int64(c0 + r)) * xh)
                if xch != 0 and not is_lm:
                    for rk in cutlass.range_constexpr(self.W):
                        st_f32(self.peer_address(p, rk, word) + ob + Int64(c0 + r) * 4, y)
                else:
                    if cutlass.const_expr(self.flagged):
                        if is_lm:
                            st_f32(ob + Int64(c0 + r) * 4, y)
                        else:
                            st_flagged(ob + Int64(c0 + r) * 8, y, s.ctrl[0] + 1)     # (h, x, qkv)
                    else:
                        st_f32(ob + Int64(c0 + r) * 4, y)
                if is_lm:
                    s_part[(r * n_seg) * B + b] = y          # keep the logit for the argmax below
        if is_lm:
            self.consumer_sync()
            for b in cutlass.range_constexpr(B):
                bv = Float32(-math.inf)
                bi = Int32(0x7FFFFFFF)
                for r in range(tidx, rows, self.cthreads):
                    v = s_part[(r * n_seg) * B + b]
                    if v > bv:
                        bv = v
                        bi = a0 + c0 + r + self.rank * self.V     # a vocabulary id (tensor parallel: the rank's
                                                                   # rows follow the lower ranks')
                bv, bi = warp_max_index(bv, bi)
                if lane == 0:
                    s_wv[warp * B + b] = bv
                    s_wi[warp * B + b] = bi
            self.merge_chunk_maxima(tidx, s)

    @cute.jit
    def reset_tile_maximum(self, tidx: Int32, s):
        """The LM head tile's running (max, index) of every sequence (s.red / s.ired), before its first chunk."""
        s_ired, s_red = s.ired, s.red
        if tidx < self.B:
            s_red[tidx] = Float32(-math.inf)
            s_ired[tidx] = Int32(0x7FFFFFFF)

    @cute.jit
    def merge_chunk_maxima(self, tidx: Int32, s):
        """After a barrier, every warp's (max, index) of a chunk's rows per sequence (s.wv / s.wi) merged into the
        tile's running ones (s.red / s.ired), sequence b by thread b alone."""
        s_ired, s_red, s_wi, s_wv = s.ired, s.red, s.wi, s.wv
        self.consumer_sync()
        if tidx < self.B:
            bv = s_red[tidx]
            bi = s_ired[tidx]
            for w in range(self.warps):
                bv, bi = max_index(bv, bi, s_wv[w * self.B + tidx], s_wi[w * self.B + tidx])
            s_red[tidx] = bv
            s_ired[tidx] = bi

    @cute.jit
    def store_tile_maximum(self, tidx: Int32, tile: Int32, xch: Int32, p, s):
        """The LM head tile's (max, index) of every sequence into lm_max / lm_idx [B, T], slot `tile`; a
        tensor-parallel TP_LM_HEAD (xch != 0) into that slot of every rank's."""
        if tidx < self.B:
            off = (Int64(tidx) * self.T + Int64(tile)) * 4
            if xch != 0:
                for rk in cutlass.range_constexpr(self.W):
                    st_f32(self.peer_address(p, rk, Int32(PEER_LM_MAX)) + off, s.red[tidx])
                    st_i32(self.peer_address(p, rk, Int32(PEER_LM_IDX)) + off, s.ired[tidx])
            else:
                st_f32(p.lm_max + off, s.red[tidx])
                st_i32(p.lm_idx + off, s.ired[tidx])

    @cute.jit
    def rms_statistic(self, tidx: Int32, warp: Int32, lane: Int32, K: Int32, ss: cute.Tensor, s):
        """s_rstd[b] = rsqrt(mean(x^2) + eps) from every thread's partial sum(x^2) in ss (a barrier is
        needed before s.rstd is read)."""
        s_rstd, s_wv = s.rstd, s.wv
        for b in cutlass.range_constexpr(self.B):
            tot = warp_sum(ss[b])
            if lane == 0:
                s_wv[warp * self.B + b] = tot
        self.consumer_sync()
        if tidx < self.B:
            tot = Float32(0.0)
            for w in range(self.warps):
                tot = tot + s_wv[w * self.B + tidx]
            s_rstd[tidx] = rsqrt(tot / Float32(K) + Float32(self.eps))
