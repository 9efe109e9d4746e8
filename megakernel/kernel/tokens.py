"""Device code of the stages at the ends of a step: EMBED (token -> x[0]) and ARGMAX (the LM head tiles'
(max, argmax) -> the next token, which also advances the step's inputs). Records and references:
megakernel.instructions.embed and .argmax."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..instructions.layout import wide_x_byte
from .ptx import (atomic_cas, ld_f32, ld_i32, load_bf16x8, max_index, pack_bf16x2, st_b32x4, st_f32, st_f32x4,
                  st_flagged, st_i32, store_relaxed, warp_max_index)

ERR_TOKEN = 3
EMBED_UNROLL = 8           # rounds of EMBED's loads in flight per thread


class TokenStages:
    """EMBED and ARGMAX (a mixin of the interpreter)."""

    @cute.jit
    def embed(self, tidx: Int32, index: Int32, b0: Int32, nb: Int32, p, epoch: Int32):
        """x[0][b] = embed[token b] (float32) for the sequences b of [b0, b0 + nb), 8 columns per thread per round,
        EMBED_UNROLL rounds' loads issued before any of their stores (a store between two loads would make each
        round a memory round trip), each column octet stored as two 16-byte stores (eight 4-byte stores, one
        sector per lane each, took 57 us at batch 64 on one SM); a token outside the vocabulary reads row 0 and
        is reported in the error word. Past SPLIT_BATCH also x[0]'s pre-staged copy for layer 0's QKV (times
        attn_norm[0], bf16 at wide_x_byte: a thread's 8 columns are one 16-byte row of a core matrix) and their
        sum of squares (StepBuffers.x_wide, x_ssq: megakernel.kernel.matvec_wide). With flagged hops
        (instructions.flagged) x[0] as {value, `epoch`} words (st_flagged)."""
        n8 = self.H // 8
        U = EMBED_UNROLL
        if cutlass.const_expr(self.wide):
            # one 8-column load a round past SPLIT_BATCH: the pre-staged copy's norm weights double a round's
            # registers (EMBED_UNROLL rounds spilled ~100 on llama-3.1-8b at batch 64), and an instruction takes one
            # sequence (instructions.embed.EMBED_SEQUENCES), H / 8 / cthreads rounds
            U = 1
        else:
            b0, nb = 0, self.B            # (up to SPLIT_BATCH one EMBED takes the batch: its bounds compiled in)
        for t0 in range(tidx, nb * n8, self.cthreads * U):
            toks = cute.make_rmem_tensor((U,), Int32)
            for v in cutlass.range_constexpr(U):
                toks[v] = Int32(0)
                t = t0 + v * self.cthreads
                if t < nb * n8:
                    toks[v] = ld_i32(p.tokens + Int64(b0 + t // n8) * 4)
            w = cute.make_rmem_tensor((U * 8,), Float32)
            gam = cute.make_rmem_tensor((U * 8 if self.wide else 1,), Float32)   # attn_norm[0]
            for v in cutlass.range_constexpr(U):
                t = t0 + v * self.cthreads
                for e in cutlass.range_constexpr(8):
                    w[v * 8 + e] = Float32(0.0)
                if t < nb * n8:
                    bt = t // n8
                    k = (t - bt * n8) * 8
                    tok = toks[v]
                    if tok < 0 or tok >= self.vocab:
                        if k == 0:
                            if atomic_cas(p.error, Int32(0), Int32(ERR_TOKEN)) == 0:
                                store_relaxed(p.error + 4, index)
                                store_relaxed(p.error + 12, tok)
                        tok = Int32(0)
                    w8 = load_bf16x8(p.w_embed + (Int64(tok) * self.H + Int64(k)) * 2)
                    for e in cutlass.range_constexpr(8):
                        w[v * 8 + e] = w8[e]
                    if cutlass.const_expr(self.wide):
                        g8 = load_bf16x8(p.attn_norm + Int64(k) * 2)
                        for e in cutlass.range_constexpr(8):
                            gam[v * 8 + e] = g8[e]
            for v in cutlass.range_constexpr(U):
                t = t0 + v * self.cthreads
                if t < nb * n8:
                    bt = t // n8
                    k = (t - bt * n8) * 8
                    b = b0 + bt
                    if cutlass.const_expr(self.flagged):
                        # x[0] as {value, epoch} words (instructions.flagged), polled by layer 0's QKV
                        for e in cutlass.range_constexpr(8):
                            st_flagged(p.x + (Int64(b) * self.H + Int64(k + e)) * 8, w[v * 8 + e], epoch)
                    else:
                        for e in cutlass.range_constexpr(0, 8, 4):
                            st_f32x4(p.x + (Int64(b) * self.H + Int64(k + e)) * 4, w[v * 8 + e], w[v * 8 + e + 1],
                                     w[v * 8 + e + 2], w[v * 8 + e + 3])
                    if cutlass.const_expr(self.wide):
                        pk = cute.make_rmem_tensor((4,), Int32)
                        ss = Float32(0.0)
                        for e in cutlass.range_constexpr(4):
                            x0 = w[v * 8 + 2 * e]
                            x1 = w[v * 8 + 2 * e + 1]
                            pk[e] = pack_bf16x2(x0 * gam[v * 8 + 2 * e], x1 * gam[v * 8 + 2 * e + 1])
                            ss = ss + x0 * x0
                            ss = ss + x1 * x1
                        st_b32x4(p.x_wide + Int64(wide_x_byte(b, k, self.B)), pk[0], pk[1], pk[2], pk[3])
                        st_f32(p.x_ssq + (Int64(b) * (self.H // 8) + Int64(k // 8)) * 4, ss)

    @cute.jit
    def argmax(self, warp: Int32, lane: Int32, num_tiles: Int32, p):
        """Per sequence, the (max, lowest index among equal maxima) over the LM head tiles' results, then the next
        token is written and the inputs advanced. Warp w takes sequences w, w + warps, ...: its lanes load every
        tile's result of the sequence at once (tiles lane, lane + 32, ...) and one warp reduction merges them with
        the same comparison (associative: the same token as a serial scan). Before, one sequence at a time over
        every thread took a memory round trip per sequence: 60 us at batch 64 (profiles/RESULTS.md)."""
        TL = max(1, -(-self.T // 32))        # tiles per lane (a step without an LM head has none)
        for b in range(warp, self.B, self.warps):
            vs = cute.make_rmem_tensor((TL,), Float32)
            ids = cute.make_rmem_tensor((TL,), Int32)
            for j in cutlass.range_constexpr(TL):        # every load first
                vs[j] = Float32(-math.inf)
                ids[j] = Int32(0x7FFFFFFF)
                t = lane + 32 * j
                if t < num_tiles:
                    vs[j] = ld_f32(p.lm_max + (Int64(b) * self.T + Int64(t)) * 4)
                    ids[j] = ld_i32(p.lm_idx + (Int64(b) * self.T + Int64(t)) * 4)
            bv = vs[0]
            bi = ids[0]
            for j in cutlass.range_constexpr(1, TL):
                bv, bi = max_index(bv, bi, vs[j], ids[j])
            bv, bi = warp_max_index(bv, bi)
            if lane == 0:
                self.emit_token(b, bi, p)

    @cute.jit
    def emit_token(self, b: Int32, token: Int32, p):
        st_i32(p.out_tokens + Int64(b) * 4, token)
        # advance the inputs: the next launch decodes the token just chosen, one position on
        st_i32(p.tokens + Int64(b) * 4, token)
        st_i32(p.positions + Int64(b) * 4, ld_i32(p.positions + Int64(b) * 4) + 1)
