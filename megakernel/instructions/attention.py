"""ATTN_PARTIAL and ATTN_REDUCE: flash-decoding over the paged KV cache.

ATTN_PARTIAL operands: a0 = sequence b, a1 = kv head, a2 = split index, a3 = number of splits; `seqs` sequences
b .. b + seqs - 1 (more than one only past SPLIT_BATCH with one split: `sequence_groups`, the consumer warps shared
out among them).
For each sequence it takes the raw q/k/v of the new token from qkv[l][b], applies QK-norm (Qwen3) and RoPE at
positions[b], and scores the group's query heads against the cached tokens of its split:
split s of n covers cached positions [s*c, min((s+1)*c, pos)) with c = ceil(pos / n). The new token
is never read back from the cache within the step: the last split adds it from registers and is the
one that appends its (bf16-rounded) k and v to the cache, so no split reads a slot another writes.
Outputs per query head and split: o normalized within the split, and lse = log(sum(exp(score))),
-inf for an empty split.

ATTN_REDUCE operands: a0 = b, a1 = kv head, a3 = number of splits. Merges the splits of the group's
query heads: out = sum_s exp(lse_s - LSE) * o_s, LSE = logsumexp_s(lse_s).
"""

from __future__ import annotations

import math

import torch

from .context import StageContext, f32, rms_normalize
from .layout import ROW_GROUP, SPLIT_BATCH
from .opcodes import Opcode
from .record import Instruction

OPCODES = (Opcode.ATTN_PARTIAL, Opcode.ATTN_REDUCE)


def warp_attention(layout) -> bool:
    """Whether an ATTN_PARTIAL takes several sequences, the consumer warps shared out among them: past SPLIT_BATCH
    with one split (StepLayout.fused_reduce there) and more (sequence, kv head) pairs than SMs. A CTA-wide item of a
    short context is a few dependent round trips and barriers of latency (~5 us), and with more pairs than SMs each
    SM would take several of them one after another; with at most one pair per SM, all the warps of an item are
    faster than one (profiles/RESULTS.md, 2026-12-04). Caches of any length: a sequence's own warps stream its whole
    context, and this was faster at every cache and context measured (H100, ms/step, CTA-wide items against these;
    2026-12-06, thirty-first session): llama-3.2-1b 64 1.870 / 1.632 with caches of 4096 positions (32-token
    contexts), 3.577 / 2.465 with 1024-token contexts, 8.793 / 4.890 with 4096; llama-3.2-1b 32 2.374 / 1.912 with
    1024-token contexts, 7.974 / 4.631 with 8192; llama-3.1-8b 64 12.151 / 10.032 with 512-token contexts."""
    return (layout.batch > SPLIT_BATCH and layout.fused_reduce
            and layout.batch * layout.config.num_kv_heads > layout.num_sms)


def sequence_groups(layout) -> list[tuple[int, int]]:
    """(first sequence, sequences) of each ATTN_PARTIAL of one (kv head, split): one sequence each, except where
    warp_attention, where an instruction takes up to ROW_GROUP sequences (the CTA's consumer warps), as few as
    spread a layer's (sequence, kv head) pairs over the SMs."""
    B = layout.batch
    if not warp_attention(layout):
        return [(b, 1) for b in range(B)]
    pairs = B * layout.config.num_kv_heads
    n = min(ROW_GROUP, -(-pairs // layout.num_sms))
    return [(b, min(n, B - b)) for b in range(0, B, n)]


def merge_splits(lse: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """lse [..., S], o [..., S, D] -> sum_s exp(lse_s - logsumexp(lse)) * o_s, [..., D]; -inf (empty) splits
    weigh nothing."""
    return (torch.softmax(lse, dim=-1)[..., None] * o).sum(dim=-2)


def split_range(pos: int, split: int, num_splits: int) -> tuple[int, int]:
    chunk = -(-pos // num_splits)
    lo = min(split * chunk, pos)
    return lo, min(lo + chunk, pos)


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    g = c.gqa_group
    if ins.opcode == Opcode.ATTN_PARTIAL:
        kvh = ins.a1
        out = [("positions", 0, ins.a0, ins.a0 + ins.seqs)]
        from .matvec_stages import part_regions, per_batch      # (they import this module)
        from .split_k import k_splits, qkv_reduce_folded
        if qkv_reduce_folded(layout):
            # the kv head's q, k and v rows of every K range's partials (all sequences: part_regions), and x[l]
            # for the RMS scale (its sums of squares, x_ssq, come with it)
            for e in range(k_splits(layout, Opcode.QKV)):
                for lo, hi in head_rows(c, kvh):
                    out += part_regions(Opcode.QKV, ins.layer, e, lo, hi, layout)
            return out + per_batch("x", ins.layer, 0, c.hidden_size, layout.batch, c.hidden_size)
        for b in range(ins.a0, ins.a0 + ins.seqs):
            row = b * c.qkv_rows
            out += [("qkv", ins.layer, row + lo, row + hi) for lo, hi in head_rows(c, kvh)]
        return out
    first = (ins.a0 * c.num_heads + ins.a1 * g) * ins.a3      # all splits of the group's heads
    return [("attn_part", ins.layer, first, first + g * ins.a3)]


def head_rows(c, kvh: int) -> list[tuple[int, int]]:
    """The qkv rows [lo, hi) of kv head kvh's group: its query heads, its key, its value."""
    g, d = c.gqa_group, c.head_dim
    return [(kvh * g * d, (kvh + 1) * g * d), (c.q_size + kvh * d, c.q_size + (kvh + 1) * d),
            (c.q_size + c.kv_size + kvh * d, c.q_size + c.kv_size + (kvh + 1) * d)]


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    g = c.gqa_group
    if ins.opcode == Opcode.ATTN_PARTIAL:
        # region index ((b * Hq + head) * splits + split): one slot per head of the group and sequence
        out = []
        for b in range(ins.a0, ins.a0 + ins.seqs):
            base = (b * c.num_heads + ins.a1 * g) * ins.a3 + ins.a2
            out += [("attn_part", ins.layer, base + h * ins.a3, base + h * ins.a3 + 1) for h in range(g)]
        return out
    row = ins.a0 * c.q_size
    return [("attn_out", ins.layer, row + ins.a1 * g * c.head_dim, row + (ins.a1 + 1) * g * c.head_dim)]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, D]; cos/sin [D/2] -> HF rotate-half RoPE."""
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def new_token_qkv(ctx: StageContext, layer: int, b: int, kvh: int):
    """(q [G, D], k [D], v [D]) of the current token for one kv head, after QK-norm and RoPE;
    k and v rounded to the cache dtype, as they will be read back in later steps."""
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    g, d = c.gqa_group, c.head_dim
    row = bufs.qkv[layer, b]
    q = row[kvh * g * d:(kvh + 1) * g * d].view(g, d)
    k = row[c.q_size + kvh * d:c.q_size + (kvh + 1) * d].view(1, d)
    v = row[c.q_size + c.kv_size + kvh * d:c.q_size + c.kv_size + (kvh + 1) * d]
    if c.qk_norm:
        q = rms_normalize(q, w.q_norm[layer], c.rms_norm_eps)
        k = rms_normalize(k, w.k_norm[layer], c.rms_norm_eps)
    pos = int(bufs.positions[b])
    cos, sin = w.rope_cos[pos], w.rope_sin[pos]
    q = _rope(q, cos, sin)
    k = _rope(k, cos, sin)[0]
    kdt = ctx.k_cache.dtype
    return q, f32(k.to(kdt)), f32(v.to(kdt)), k.to(kdt), v.to(kdt)


def reference(ins: Instruction, ctx: StageContext) -> None:
    c, bufs = ctx.layout.config, ctx.bufs
    g, d = c.gqa_group, c.head_dim
    l, b, kvh = ins.layer, ins.a0, ins.a1
    heads = slice(kvh * g, (kvh + 1) * g)
    if ins.opcode == Opcode.ATTN_REDUCE:
        merged = merge_splits(bufs.attn_part_lse[l, b, heads], bufs.attn_part_o[l, b, heads])   # [G, D]
        bufs.attn_out[l, b, kvh * g * d:(kvh + 1) * g * d] = merged.reshape(-1)
        return
    from .split_k import qkv_reduce_folded                     # (it imports this module)
    if qkv_reduce_folded(ctx.layout):
        fold_qkv_rows(ctx, l, b, b + ins.seqs, kvh)
    for seq in range(b, b + ins.seqs):
        partial_reference(ctx, l, seq, kvh, ins.a2, ins.a3)


def fold_qkv_rows(ctx: StageContext, l: int, b0: int, b1: int, kvh: int) -> None:
    """Where QKV's reduce is folded into the attention (split_k.qkv_reduce_folded): sequences b0 .. b1 - 1's q, k
    and v rows of kv head kvh (QKV's partials in range order, times the RMS scale) into qkv, which only these rows'
    readers read."""
    from .matvec_stages import PART_BUFFERS, rms_scale        # (they import this module)
    from .split_k import k_splits, sum_ranges
    c, bufs = ctx.layout.config, ctx.bufs
    parts = getattr(bufs, PART_BUFFERS[Opcode.QKV])
    scale = rms_scale(bufs.x[l, b0:b1], c.rms_norm_eps)
    for lo, hi in head_rows(c, kvh):
        y = sum_ranges(parts, l, k_splits(ctx.layout, Opcode.QKV), slice(b0, b1), slice(lo, hi))
        bufs.qkv[l, b0:b1, lo:hi] = y * scale


def partial_reference(ctx: StageContext, l: int, b: int, kvh: int, split: int, num_splits: int) -> None:
    """ATTN_PARTIAL's outputs for one sequence: split `split` of `num_splits` of kv head kvh."""
    c, bufs = ctx.layout.config, ctx.bufs
    g, d = c.gqa_group, c.head_dim
    heads = slice(kvh * g, (kvh + 1) * g)
    pos = int(bufs.positions[b])
    q, k_new, v_new, k_store, v_store = new_token_qkv(ctx, l, b, kvh)
    lo, hi = split_range(pos, split, num_splits)
    bs = ctx.layout.block_size
    t = torch.arange(lo, hi)
    blocks = bufs.block_table[b, t // bs].long()
    keys = f32(ctx.k_cache[l, blocks, t % bs, kvh])          # [n, D]
    vals = f32(ctx.v_cache[l, blocks, t % bs, kvh])
    if split == num_splits - 1:
        keys = torch.cat([keys, k_new[None]])
        vals = torch.cat([vals, v_new[None]])
        blk = int(bufs.block_table[b, pos // bs])
        ctx.k_cache[l, blk, pos % bs, kvh] = k_store
        ctx.v_cache[l, blk, pos % bs, kvh] = v_store
    if keys.shape[0] == 0:
        bufs.attn_part_lse[l, b, heads, split] = -math.inf
        bufs.attn_part_o[l, b, heads, split] = 0.0
        return
    scores = (q @ keys.T) / math.sqrt(d)                     # [G, n]
    lse = torch.logsumexp(scores, dim=-1)
    bufs.attn_part_lse[l, b, heads, split] = lse
    bufs.attn_part_o[l, b, heads, split] = torch.exp(scores - lse[:, None]) @ vals
