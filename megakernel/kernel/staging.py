"""Device code that stages a matvec stage's input in shared memory up to SPLIT_BATCH, every sequence's row (or a
window of its columns) at once, before the weight slots are multiplied by it (megakernel.kernel.matvec; past
SPLIT_BATCH no consumer stages its input: the stage that produced it wrote it pre-staged, matvec_wide):
  - the input row x (times the norm weight, with sum(x^2) for the RMSNorm of the stages that have one), layer 0's
    embedding row where QKV stages it, or O_PROJ's merge of the attention splits;
  - rounded to bf16, in the B-register order of the consumers (store_x_quad): a bf16 input, as past SPLIT_BATCH,
    is one MMA per weight fragment and half the staged bytes of float32 split into bf16 hi + lo, which measured
    2-11% slower (profiles/RESULTS.md, 2026-12-04, fifteenth session) for ~1e-2 of relative logit error, inside the
    suite's bf16 bounds (tools/activation_precision.py);
  - every load of a round first, so a round is one memory round trip;
  - at batch 1 on one GPU a flagged input (instructions.flagged: x, h, act as {value, epoch} words) is polled until
    every word is this step's (stage_round_polled), in place of the counter wait; the attention's q, k and v (qkv)
    likewise (poll_words).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from .attention import LOG2E
from .ptx import (as_f32, ex2, ld_f32, ld_flagged_x2, ld_i32, load_f32x4, load_nc_b32x2, load_relaxed,
                  load_weights_bf16x4, pack_bf16x2, st_shared_b32, unpack_bf16x2)

X_LOADS = 8                # input quads (of all sequences) each thread loads per round when staging, at most
MERGE_PAIRS = 16           # O_PROJ's merge: (sequence, split) pairs whose lse and partial quad load in one round
                           # (half that with 15 consumer warps, whose 128 registers would spill)
POLL_WORD = 6              # the word of the CTA's control block (s_ctrl) a timed-out poll of a flagged input sets
POLL_ERROR_EVERY = 16      # a poll of a flagged input reads the error word and the clock every this many rounds


class InputStaging:
    """The matvec stages' input staging (a mixin of the interpreter)."""

    def x_unroll(self) -> int:
        """Input quads per thread per staging round: enough that the widest staged row is one round, at most
        X_LOADS loads (quads of every sequence) in flight per thread."""
        widest = max(g.x_cols for g in self.plan.by_k.values())
        return max(1, min(X_LOADS // self.B, -(-widest // (4 * self.cthreads))))

    @cute.jit
    def store_x_quad(self, s, b: Int32, c: Int32, stride: Int32, y: cute.Tensor):
        """Sequence b's input columns c .. c + 3 (float32 y; c a multiple of 4, counted from the staged window's
        first) rounded to bf16 and stored where consume_item's lanes read their B registers: per 16-column k-step
        (8 words of the row, which starts `stride` words after the previous sequence's), words 2t and 2t + 1 are
        the packed pairs (2t, 2t + 1) and (2t + 8, 2t + 9)."""
        r = c % 16
        h = r // 8                   # columns 8..15 of the k-step: the second word of the pair
        t0 = (r % 8) // 2            # the lane quad of the first pair (the second pair's is t0 + 1)
        base = s.x_addr + (b * stride + (c - r) // 2 + 2 * t0 + h) * 4
        st_shared_b32(base, pack_bf16x2(y[0], y[1]))
        st_shared_b32(base + 8, pack_bf16x2(y[2], y[3]))

    @cute.jit
    def zero_x(self, tidx: Int32, words: Int32, s):
        """The first `words` 32-bit words of s.x zeroed by the consumer threads (KernelOptions.diag_no_stage's input,
        for timing only: what the staging or the window's copy would have written)."""
        s_x = s.x
        for i in range(tidx, words, self.cthreads):
            s_x[i] = Float32(0.0)

    @cute.jit
    def stage(self, tidx: Int32, layer: Int32, K: Int32, merge: Boolean, from_embed: Boolean, gather: Boolean,
              poll: Boolean, in_addr: Int64, norm_addr: Int64, p, s, ss: cute.Tensor, s0: Int32,
              kw: Int32, stride: Int32):
        """Columns s0 .. s0 + kw of every sequence's matvec input into s.x (store_x_quad, row stride `stride`):
        O_PROJ's merged attention splits where `merge`, layer 0's embedding row where `from_embed`, else the input
        row; times the norm weight, with sum(x^2) into ss where `gather`."""
        if cutlass.const_expr(self.options.diag_no_stage):
            # (KernelOptions.diag_no_stage, for timing only: the window zeroed instead, wrong results but finite)
            self.zero_x(tidx, self.plan.x_floats, s)
            return
        polled = Boolean(False)
        if cutlass.const_expr(self.flagged):
            polled = poll
        if merge:
            self.stage_merged_attention(tidx, layer, p, s, s0, kw, stride)
        elif polled:
            # a flagged input (instructions.flagged): its words polled until every one is this step's
            U = self.x_unroll()
            for q0 in range(tidx, kw // 4, self.cthreads * U):
                self.stage_round_polled(q0, U, gather, K, in_addr, norm_addr, p, s, ss, s0, kw, stride)
        else:
            # the quads of a column of every sequence in one round (their loads in flight together), U columns per
            # thread per round
            U = self.x_unroll()
            for q0 in range(tidx, kw // 4, self.cthreads * U):
                self.stage_round(tidx, q0, U, from_embed, gather, K, in_addr, norm_addr, p, s, ss, s0, kw, stride)

    @cute.jit
    def load_norm_round(self, q0: Int32, U: int, norm_addr: Int64, s0: Int32, kw: Int32, nw: cute.Tensor):
        """A staging round's norm weights: quads q0, q0 + cthreads, ... (U of them) as packed bf16 pairs into nw
        (2 words a quad; 0 past the window)."""
        for v in cutlass.range_constexpr(U):
            nw[2 * v] = Int32(0)
            nw[2 * v + 1] = Int32(0)
            q = q0 + v * self.cthreads
            if q < kw // 4:
                nw[2 * v], nw[2 * v + 1] = load_nc_b32x2(norm_addr + Int64(s0 + q * 4) * 2)

    @cute.jit
    def scale_round(self, q0: Int32, U: int, gather: Boolean, nw: cute.Tensor, xv: cute.Tensor, s, ss: cute.Tensor,
                    kw: Int32, stride: Int32):
        """A staging round's loaded input quads xv (U x B x 4 float32) times the norm weights nw into s.x
        (store_x_quad), sequence b's sum of squares into ss[b] where `gather`."""
        nb = self.B
        for v in cutlass.range_constexpr(U):
            q = q0 + v * self.cthreads
            if q < kw // 4:
                nv = cute.make_rmem_tensor((4,), Float32)
                nv[0], nv[1] = unpack_bf16x2(nw[2 * v])
                nv[2], nv[3] = unpack_bf16x2(nw[2 * v + 1])
                for bb in cutlass.range_constexpr(nb):
                    j = v * nb + bb
                    y = cute.make_rmem_tensor((4,), Float32)
                    for e in cutlass.range_constexpr(4):
                        x = xv[4 * j + e]
                        if gather:
                            ss[bb] = ss[bb] + x * x
                        y[e] = x * nv[e]
                    self.store_x_quad(s, bb, q * 4, stride, y)

    @cute.jit
    def stage_round(self, tidx: Int32, q0: Int32, U: int, from_embed: Boolean, gather: Boolean, K: Int32,
                    in_addr: Int64, norm_addr: Int64, p, s, ss: cute.Tensor, s0: Int32, kw: Int32, stride: Int32):
        """One staging round (`stage`): quads q0, q0 + cthreads, ... (U of them) of every sequence, sequence b's sum
        of squares into ss[b]."""
        nb = self.B
        nw = cute.make_rmem_tensor((U * 2,), Int32)           # the norm weights' packed bf16
        self.load_norm_round(q0, U, norm_addr, s0, kw, nw)
        rows = cute.make_rmem_tensor((nb,), Int64)
        for bb in cutlass.range_constexpr(nb):
            rows[bb] = in_addr + Int64(bb) * Int64(K) * 4
            if cutlass.const_expr(self.layout.embed_folded):
                if from_embed:
                    tok = ld_i32(p.tokens + Int64(bb) * 4)
                    if tok < 0 or tok >= self.vocab:
                        tok = Int32(0)            # EMBED reports it in the error word
                    rows[bb] = p.w_embed + Int64(tok) * (self.H * 2)
        # every load of the round first (raw words: nothing uses a value before the last load is out), so the
        # round is one memory round trip; then the products, sums and stores
        xv = cute.make_rmem_tensor((U * nb * 4,), Float32)     # the input quads
        for i in cutlass.range_constexpr(U * nb * 4):
            xv[i] = Float32(0.0)
        for v in cutlass.range_constexpr(U):
            q = q0 + v * self.cthreads
            if q < kw // 4:
                k = s0 + q * 4
                for bb in cutlass.range_constexpr(nb):
                    j = v * nb + bb
                    if cutlass.const_expr(self.layout.embed_folded):
                        if from_embed:
                            # (layer 0's embedding row, unpacked as it lands: the step's first stage)
                            xe = load_weights_bf16x4(rows[bb] + Int64(k) * 2)
                            for e in cutlass.range_constexpr(4):
                                xv[4 * j + e] = xe[e]
                        else:
                            xg = load_f32x4(rows[bb] + Int64(k) * 4)
                            for e in cutlass.range_constexpr(4):
                                xv[4 * j + e] = xg[e]
                    else:
                        xg = load_f32x4(rows[bb] + Int64(k) * 4)
                        for e in cutlass.range_constexpr(4):
                            xv[4 * j + e] = xg[e]
        self.scale_round(q0, U, gather, nw, xv, s, ss, kw, stride)

    @cute.jit
    def poll_missed(self, spins: Int32, t0, p, s_ctrl: cute.Tensor) -> Int32:
        """A poll round of a flagged input that found a word not yet this step's: every POLL_ERROR_EVERY such
        rounds, if another CTA has failed (this step's words may never come) or options.timeout_ns has passed
        since t0, set s_ctrl[POLL_WORD], which ends the thread's polls (stage_round_polled, poll_words) and has
        the interpreter write ERR_TIMEOUT once the instruction ends. The rounds missed so far, this one counted."""
        spins = spins + 1
        if spins % POLL_ERROR_EVERY == 0:
            if load_relaxed(p.error) != 0 or cute.arch.globaltimer() - t0 > self.options.timeout_ns:
                s_ctrl[POLL_WORD] = Int32(1)
        return spins

    @cute.jit
    def stage_round_polled(self, q0: Int32, U: int, gather: Boolean, K: Int32, in_addr: Int64, norm_addr: Int64, p,
                           s, ss: cute.Tensor, s0: Int32, kw: Int32, stride: Int32):
        """stage_round of a flagged input (8-byte {value, epoch} words, st_flagged): every word of the round loaded,
        again until each carries this step's epoch (s.ctrl[0] + 1), then as stage_round: times the norm weight,
        sequence b's sum of squares into ss[b] where `gather`. A 64-bit load is single-copy atomic, so a word with
        the epoch holds this step's value: no counter, no fence. The polls end early once another CTA has written
        the error word or a thread of this one timed out; past options.timeout_ns the thread sets s.ctrl[POLL_WORD]
        (the interpreter writes ERR_TIMEOUT when the instruction ends)."""
        nb = self.B
        s_ctrl = s.ctrl
        epoch = s_ctrl[0] + 1
        nw = cute.make_rmem_tensor((U * 2,), Int32)           # the norm weights' packed bf16
        self.load_norm_round(q0, U, norm_addr, s0, kw, nw)
        xv = cute.make_rmem_tensor((U * nb * 4,), Float32)     # the input quads
        for i in cutlass.range_constexpr(U * nb * 4):
            xv[i] = Float32(0.0)
        t0 = cute.arch.globaltimer()
        ready = Boolean(False)
        spins = Int32(0)
        while not ready and s_ctrl[POLL_WORD] == 0:
            ready = Boolean(True)
            for v in cutlass.range_constexpr(U):
                q = q0 + v * self.cthreads
                if q < kw // 4:
                    k = s0 + q * 4
                    for bb in cutlass.range_constexpr(nb):
                        j = v * nb + bb
                        a = in_addr + (Int64(bb) * Int64(K) + Int64(k)) * 8
                        w0, f0, w1, f1 = ld_flagged_x2(a)
                        w2, f2, w3, f3 = ld_flagged_x2(a + 16)
                        xv[4 * j], xv[4 * j + 1] = as_f32(w0), as_f32(w1)
                        xv[4 * j + 2], xv[4 * j + 3] = as_f32(w2), as_f32(w3)
                        if f0 != epoch or f1 != epoch or f2 != epoch or f3 != epoch:
                            ready = Boolean(False)
            if not ready:
                spins = self.poll_missed(spins, t0, p, s_ctrl)
        self.scale_round(q0, U, gather, nw, xv, s, ss, kw, stride)

    @cute.jit
    def poll_words(self, addr: Int64, n: int, vals: cute.Tensor, at: int, p, s):
        """n flagged {value, epoch} words at addr (16-byte aligned, n even; the attention's q, k and v) into
        vals[at:], every word loaded again until each carries this step's epoch; as stage_round_polled, a thread
        past options.timeout_ns or seeing another CTA's error sets s.ctrl[POLL_WORD] and stops polling."""
        s_ctrl = s.ctrl
        epoch = s_ctrl[0] + 1
        raw = cute.make_rmem_tensor((n,), Int32)
        for e in cutlass.range_constexpr(n):
            raw[e] = Int32(0)          # (set before the loop: else the polled words live in local memory)
        t0 = cute.arch.globaltimer()
        ready = Boolean(False)
        spins = Int32(0)
        while not ready and s_ctrl[POLL_WORD] == 0:
            ready = Boolean(True)
            for j in cutlass.range_constexpr(n // 2):
                w0, f0, w1, f1 = ld_flagged_x2(addr + j * 16)
                raw[2 * j], raw[2 * j + 1] = w0, w1
                if f0 != epoch or f1 != epoch:
                    ready = Boolean(False)
            if not ready:
                spins = self.poll_missed(spins, t0, p, s_ctrl)
        for e in cutlass.range_constexpr(n):
            vals[at + e] = as_f32(raw[e])

    @cute.jit
    def stage_merged_attention(self, tidx: Int32, layer: Int32, p, s, s0: Int32,
                               kw: Int32, stride: Int32):
        """O_PROJ folded with the attention merge: s.x = the merged attention output of every sequence, one
        quad per thread at a time. Up to MERGE_PAIRS splits: the lse values and partials of as many sequences
        as fit MERGE_PAIRS (sequence, split) pairs load in one round (merge_round), and a batch of more sequences
        than a round holds deals its (quad, round) items over the threads as one list; more splits: one sequence
        at a time (merge_quad)."""
        S = self.S
        # sequences per round (0: more splits than a round holds; half the pairs with 15 consumer warps, whose 128
        # registers would spill)
        GB = (MERGE_PAIRS if self.warps <= 8 else MERGE_PAIRS // 2) // S
        NBG = -(-self.B // GB) if GB > 0 else 0          # rounds of GB sequences
        if cutlass.const_expr(NBG > 1):
            # several rounds of sequences: the (quad, round) items dealt over the threads as one list, quads fastest
            # (a warp's loads stay coalesced), so the slowest thread makes ceil(quads x NBG / threads) dependent round
            # trips, not ceil(quads / threads) x NBG (batch 8 with 2 splits, 2,048 columns: 3, not 4). Each item's
            # merge is merge_round's own arithmetic (H100, 2026-12-07: O_PROJ's ready -> staged 4.20 -> 3.56 us at
            # llama-3.2-1b 8, qwen3-0.6b 8 -3.0%, logits bit for bit; profiles/RESULTS.md)
            Q = kw // 4
            for it in range(tidx, Q * NBG, self.cthreads):
                g = it // Q
                q = it - g * Q
                for gg in cutlass.range_constexpr(NBG):
                    if g == gg:
                        self.merge_round(layer, p, s, s0, q, gg * GB, min(GB, self.B - gg * GB), 1, kw, stride)
        else:
            # one round holds every sequence (or, GB == 0, one sequence at a time): quads per thread per round, two
            # where one round's loads of both fit the registers (at most 8 pairs: the widest input, 2048 columns, is
            # 512 quads over 480 threads, whose second round of one quad a thread kept the CTA waiting on 32
            # threads), their loads out together
            UQ = 2 if GB > 0 and self.B * S <= 8 else 1
            for q0 in range(tidx, kw // 4, self.cthreads * UQ):
                if cutlass.const_expr(GB == 0):
                    q = q0
                    k = s0 + q * 4
                    for b in cutlass.range_constexpr(self.B):
                        xv = cute.make_rmem_tensor((4,), Float32)
                        self.merge_quad(layer, b, k, p.attn_part_o, p.attn_part_lse, xv)
                        self.store_x_quad(s, b, q * 4, stride, xv)
                else:
                    self.merge_round(layer, p, s, s0, q0, 0, self.B, UQ, kw, stride)

    @cute.jit
    def merge_round(self, layer: Int32, p, s, s0: Int32, q0: Int32, b0: Int32, nb: int, UQ: int, kw: Int32,
                    stride: Int32):
        """One round of stage_merged_attention: quads q0, q0 + cthreads, ... (UQ of them) of sequences b0 .. b0 +
        nb, every load first, then the merge without a branch (an empty split's lse is -inf, its weight ex2(-inf) =
        0; a sequence has at least one token, so the maximum is finite)."""
        S, D = self.S, self.D
        n = nb * S                       # (sequence, split) pairs of a quad
        lse = cute.make_rmem_tensor((UQ * n,), Float32)
        ov = cute.make_rmem_tensor((UQ * n * 4,), Float32)
        for i in cutlass.range_constexpr(UQ * n):
            lse[i] = Float32(0.0)
            for e in cutlass.range_constexpr(4):
                ov[i * 4 + e] = Float32(0.0)
        for u in cutlass.range_constexpr(UQ):        # every load of the round first
            qu = q0 + u * self.cthreads
            if qu < kw // 4:
                ku = s0 + qu * 4
                head = ku // D
                d = ku - head * D
                for bb in cutlass.range_constexpr(nb):
                    base = ((Int64(layer) * self.B + Int64(b0 + bb)) * self.Hq + Int64(head)) * S
                    for sp in cutlass.range_constexpr(S):
                        i = u * n + bb * S + sp
                        lse[i] = ld_f32(p.attn_part_lse + (base + sp) * 4)
                        o4 = load_f32x4(p.attn_part_o + ((base + sp) * D + Int64(d)) * 4)
                        for e in cutlass.range_constexpr(4):
                            ov[i * 4 + e] = o4[e]
        for u in cutlass.range_constexpr(UQ):
            qu = q0 + u * self.cthreads
            if qu < kw // 4:
                for bb in cutlass.range_constexpr(nb):
                    i0 = u * n + bb * S
                    mx = lse[i0]
                    for sp in cutlass.range_constexpr(1, S):
                        mx = cute.arch.fmax(mx, lse[i0 + sp])
                    tot = Float32(0.0)
                    acc = cute.make_rmem_tensor((4,), Float32)
                    for e in cutlass.range_constexpr(4):
                        acc[e] = Float32(0.0)
                    for sp in cutlass.range_constexpr(S):
                        f = ex2((lse[i0 + sp] - mx) * Float32(LOG2E))
                        tot = tot + f
                        for e in cutlass.range_constexpr(4):
                            acc[e] = acc[e] + f * ov[(i0 + sp) * 4 + e]
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] / tot
                    self.store_x_quad(s, b0 + bb, qu * 4, stride, acc)
