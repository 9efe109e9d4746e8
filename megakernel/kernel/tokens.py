"""Device code of the stages at the ends of a step: EMBED (token -> x[0]) and ARGMAX (the LM head tiles'
(max, argmax) -> the next token, which also advances the step's inputs). Records and references:
megakernel.instructions.embed and .argmax."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .ptx import atomic_cas, ld_f32, ld_i32, load_bf16x8, st_f32, st_i32, store_relaxed, warp_max_index

ERR_TOKEN = 3
EMBED_UNROLL = 2           # rounds of EMBED's loads in flight per thread


class TokenStages:
    """EMBED and ARGMAX (a mixin of the interpreter)."""

    @cute.jit
    def embed(self, tidx: Int32, index: Int32, p):
        """x[0][b] = embed[token b] (float32), 8 columns per thread per round, EMBED_UNROLL rounds in flight;
        a token outside the vocabulary reads row 0 and is reported in the error word."""
        n8 = self.H // 8
        for t0 in range(tidx, self.B * n8, self.cthreads * EMBED_UNROLL):
            for v in cutlass.range_constexpr(EMBED_UNROLL):
                t = t0 + v * self.cthreads
                if t < self.B * n8:
                    b = t // n8
                    k = (t - b * n8) * 8
                    tok = ld_i32(p.tokens + Int64(b) * 4)
                    if tok < 0 or tok >= self.V:
                        if k == 0:
                            if atomic_cas(p.error, Int32(0), Int32(ERR_TOKEN)) == 0:
                                store_relaxed(p.error + 4, index)
                                store_relaxed(p.error + 12, tok)
                        tok = Int32(0)
                    w8 = load_bf16x8(p.w_embed + (Int64(tok) * self.H + Int64(k)) * 2)
                    for e in cutlass.range_constexpr(8):
                        st_f32(p.x + (Int64(b) * self.H + Int64(k + e)) * 4, w8[e])

    @cute.jit
    def argmax(self, tidx: Int32, warp: Int32, lane: Int32, num_tiles: Int32, p, s):
        """Per sequence, the (max, lowest index among equal maxima) over the LM head tiles' results, then
        the next token is written and the inputs advanced. Every consumer thread scans some tiles of every
        sequence and the warps' results are merged with the same comparison (associative: the same token as
        a serial scan)."""
        s_wi, s_wv = s.wi, s.wv
        for b in cutlass.range_constexpr(self.B):
            bv, bi = self.scan_tiles(b, tidx, self.cthreads, num_tiles, p)
            bv, bi = warp_max_index(bv, bi)
            if lane == 0:
                s_wv[warp * self.B + b] = bv
                s_wi[warp * self.B + b] = bi
        self.consumer_sync()
        if tidx < self.B:
            _, ci = self.merge_warp_maxima(tidx, Float32(-math.inf), Int32(0x7FFFFFFF), s)
            self.emit_token(tidx, ci, p)

    @cute.jit
    def scan_tiles(self, b: Int32, t0: Int32, step: int, num_tiles: Int32, p):
        """(max, lowest index among equal maxima) of sequence b over LM head tiles t0, t0 + step, ..."""
        bv = Float32(-math.inf)
        bi = Int32(0x7FFFFFFF)
        for t in range(t0, num_tiles, step):
            v = ld_f32(p.lm_max + (Int64(b) * self.T + Int64(t)) * 4)
            vi = ld_i32(p.lm_idx + (Int64(b) * self.T + Int64(t)) * 4)
            if v > bv or (v == bv and vi < bi):
                bv = v
                bi = vi
        return bv, bi

    @cute.jit
    def merge_warp_maxima(self, b: Int32, bv: Float32, bi: Int32, s):
        """(bv, bi) merged with every consumer warp's (max, index) of sequence b in s.wv / s.wi (slot
        warp * B + b): the larger value, the lower index among equal ones."""
        s_wi, s_wv = s.wi, s.wv
        for w in range(self.warps):
            v = s_wv[w * self.B + b]
            vi = s_wi[w * self.B + b]
            if v > bv or (v == bv and vi < bi):
                bv = v
                bi = vi
        return bv, bi

    @cute.jit
    def emit_token(self, b: Int32, token: Int32, p):
        st_i32(p.out_tokens + Int64(b) * 4, token)
        # advance the inputs: the next launch decodes the token just chosen, one position on
        st_i32(p.tokens + Int64(b) * 4, token)
        st_i32(p.positions + Int64(b) * 4, ld_i32(p.positions + Int64(b) * 4) + 1)
