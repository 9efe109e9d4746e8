"""MLA_PARTIAL: one (sequence, head group, KV split) of flash-decoding over the paged latent cache, in
the absorbed form (keys and values are the cached rows themselves; nothing is expanded per head).

Operands: a0 = sequence b, a1 = head group (heads [a1*g, (a1+1)*g), g = layout.head_group),
a2 = split index, a3 = number of splits. Split s of n covers cached positions [s*k, min((s+1)*k, pos))
with k = ceil(pos / n) (attention.split_range), pos = positions[b].

Per head h of the group: query = [q_lat[h] (c) | rope(q_rope[h]) (r)], a cache row is
[c_kv (c) | k_rope (r)], score = query . row * softmax_scale; outputs o = softmax-weighted sum of the
rows' c_kv within the split (normalised within it) and lse = log(sum(exp(score))) (-inf when empty).

The new token is never read back from the cache within the step: the last split of every group
builds its row from qkv_a (c_kv = RMSNorm(latent, kv_a_norm, 1e-6), k_rope = RoPE(rope key)) rounded
to the cache dtype, as later steps will read it; only the last split of group 0 stores it, at
positions[b], so the row has one writer and no split reads a slot another writes.
"""

from __future__ import annotations

import math

import torch

from ...model.deepseek.config import LATENT_NORM_EPS
from ..attention import split_range
from ..context import f32, rms_normalize
from ..opcodes import Opcode
from ..record import Instruction
from .common import query_rows, query_source, rope_half

OPCODE = Opcode.MLA_PARTIAL


def _heads(ins: Instruction, layout) -> range:
    g = layout.head_group
    return range(ins.a1 * g, (ins.a1 + 1) * g)


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    b, heads = ins.a0, _heads(ins, layout)
    n, lat = c.num_heads, c.kv_lora_rank
    name, width = query_source(c)
    out = [("positions", 0, b, b + 1), ("block_table", 0, b, b + 1),
           ("q_lat", ins.layer, (b * n + heads.start) * lat, (b * n + heads.stop) * lat)]
    out += [(name, ins.layer, b * width + h * c.qk_head_dim + c.qk_nope_head_dim, b * width + (h + 1) * c.qk_head_dim)
            for h in heads]
    if ins.a2 == ins.a3 - 1:   # the new token's latent row and rope key
        out.append(("qkv_a", ins.layer, b * c.qkv_a_rows + c.q_a_rows, (b + 1) * c.qkv_a_rows))
    return out


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    base = (ins.a0 * c.num_heads) * ins.a3 + ins.a2     # region index (b * n + head) * splits + split
    out = [("mla_part", ins.layer, base + h * ins.a3, base + h * ins.a3 + 1) for h in _heads(ins, layout)]
    if ins.a2 == ins.a3 - 1 and ins.a1 == 0:
        out.append(("latent_cache_append", ins.layer, ins.a0, ins.a0 + 1))
    return out


def new_latent_row(ctx, layer: int, b: int) -> torch.Tensor:
    """[c_kv | k_rope] of the current token, in the cache dtype (what later steps will read)."""
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    a = bufs.qkv_a[layer, b, c.q_a_rows:]
    c_kv = rms_normalize(a[None, :c.kv_lora_rank], w.kv_a_norm[layer], LATENT_NORM_EPS)[0]
    pos = int(bufs.positions[b])
    k_rope = rope_half(a[c.kv_lora_rank:], w.rope_cos[pos], w.rope_sin[pos])
    return torch.cat([c_kv, k_rope]).to(ctx.latent.dtype)


def reference(ins: Instruction, ctx) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, b, split, num_splits = ins.layer, ins.a0, ins.a2, ins.a3
    heads = _heads(ins, ctx.layout)
    hs = slice(heads.start, heads.stop)
    lat, qk, nope = c.kv_lora_rank, c.qk_head_dim, c.qk_nope_head_dim
    pos = int(bufs.positions[b])
    q_rope = query_rows(ctx, l)[b].view(c.num_heads, qk)[hs, nope:]                  # [g, r]
    query = torch.cat([bufs.q_lat[l, b, hs], rope_half(q_rope, w.rope_cos[pos], w.rope_sin[pos])], dim=-1)
    lo, hi = split_range(pos, split, num_splits)
    bs = ctx.layout.block_size
    t = torch.arange(lo, hi)
    rows = f32(ctx.latent[l, bufs.block_table[b, t // bs].long(), t % bs])         # [m, c + r]
    if split == num_splits - 1:
        new = new_latent_row(ctx, l, b)
        rows = torch.cat([rows, f32(new)[None]])
        if ins.a1 == 0:
            ctx.latent[l, int(bufs.block_table[b, pos // bs]), pos % bs] = new
    if rows.shape[0] == 0:
        bufs.mla_part_lse[l, b, hs, split] = -math.inf
        bufs.mla_part_o[l, b, hs, split] = 0.0
        return
    scores = (query @ rows.T) * c.softmax_scale                                      # [g, m]
    lse = torch.logsumexp(scores, dim=-1)
    bufs.mla_part_lse[l, b, hs, split] = lse
    bufs.mla_part_o[l, b, hs, split] = torch.exp(scores - lse[:, None]) @ rows[:, :lat]
