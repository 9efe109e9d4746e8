"""ATTN_O: a layer's attention and O projection as one stage (StepLayout.fuse_attn_o), one global hop fewer per layer
than ATTN_PARTIAL -> O_PROJ.

Operands: a0 = first row of O (the hidden size), a1 = rows, a2 = the tile's index in its layer, k_part = kv head h,
k_parts = kv heads, seqs = the batch. Waits for QKV (every tile of the layer), signals the layer's O_PROJ counter.
For every sequence, the tile attends with kv head h's query heads over the whole cache and the new token (as
ATTN_PARTIAL with one split: QK-norm, RoPE, the new token added from registers), keeps the normalized output
o_h [G x D] to itself, and multiplies it by Wo's rows [a0, a0 + a1) over h's query columns (K range h of O_PROJ):
part_o[l, h, b, a0:a0 + a1]. The kv head's tile with a0 = 0 appends the new token's k and v to the cache; its other
tiles read only the cached positions before it. Every tile of a head repeats the head's attention, so the form
pays off only where the cache is short (the attention is a few round trips, not a stream).

No stage writes h[l] = x[l] + O . attn: its readers compute it themselves (`attention_residual`: the kv heads'
partials summed in head order, then added to x[l], as an MV_REDUCE of O_PROJ would), GATE_UP while staging its whole
input, DOWN for its residual rows: the same additions in the same order, so the same bits in both.
"""

from __future__ import annotations

import torch

from .attention import head_rows, split_attention
from .context import StageContext, matvec
from .layout import streamed_rows
from .opcodes import Opcode
from .record import Instruction

OPCODES = (Opcode.ATTN_O,)


def reads(ins: Instruction, layout) -> list:
    """Every sequence's position and its q, k and v rows of kv head k_part (the cache is not a tracked region)."""
    c = layout.config
    out = [("positions", 0, 0, layout.batch)]
    for b in range(layout.batch):
        out += [("qkv", ins.layer, b * c.qkv_rows + lo, b * c.qkv_rows + hi) for lo, hi in head_rows(c, ins.k_part)]
    return out


def writes(ins: Instruction, layout) -> list:
    from .matvec_stages import part_regions      # (it imports this module)
    return part_regions(Opcode.O_PROJ, ins.layer, ins.k_part, ins.a0, ins.a0 + ins.a1, layout)


def reference(ins: Instruction, ctx: StageContext) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, h, lo, hi = ins.layer, ins.k_part, ins.a0, ins.a0 + ins.a1
    width = c.gqa_group * c.head_dim
    rows = streamed_rows(w, w.o_proj[l, lo:hi])[:, h * width:(h + 1) * width]
    for b in range(ctx.layout.batch):
        pos = int(bufs.positions[b])
        _, o = split_attention(ctx, l, b, h, 0, pos, new_token=True, append=lo == 0)
        bufs.part_o[l, h, b, lo:hi] = matvec(rows, o.reshape(1, width))[0]


def fused(layout) -> bool:
    """Whether a layout fuses the attention and O_PROJ (only StepLayout can: the DeepSeek and Kimi Linear layouts,
    which share the GATE_UP and DOWN references, have no such field)."""
    return getattr(layout, "fuse_attn_o", False)


def attention_residual(ctx: StageContext, l: int, lo: int, hi: int) -> torch.Tensor:
    """h[l] rows [lo, hi) of every sequence, [B, hi - lo] float32: read from h, or where the layout fuses the
    attention and O_PROJ, x[l] plus the kv heads' partials of O added in head order (split_k.sum_ranges,
    MV_REDUCE's order)."""
    from .split_k import sum_ranges              # (it imports matvec_stages, which imports this module)
    bufs = ctx.bufs
    if not fused(ctx.layout):
        return bufs.h[l, :, lo:hi]
    return bufs.x[l, :, lo:hi] + sum_ranges(bufs.part_o, l, ctx.layout.config.num_kv_heads, slice(None),
                                            slice(lo, hi))


def residual_regions(layer: int, lo: int, hi: int, layout) -> list:
    """What `attention_residual` reads for rows [lo, hi)."""
    from .matvec_stages import part_regions, per_batch      # (it imports this module)
    c = layout.config
    if not fused(layout):
        return per_batch("h", layer, lo, hi, layout.batch, c.hidden_size)
    out = per_batch("x", layer, lo, hi, layout.batch, c.hidden_size)
    for h in range(c.num_kv_heads):
        out += part_regions(Opcode.O_PROJ, layer, h, lo, hi, layout)
    return out
