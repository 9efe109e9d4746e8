"""KDA_OUT_NORM: the gated output norm of a KDA layer fused with a row tile of its output projection
plus the residual.

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `kda_o_proj[l]` [H, D].
Prologue (every tile recomputes it for the whole batch: B * D elementwise, cheaper than a sync):
o' = RMSNorm per head of kda_o[l] (over dv, weight o_norm[l] shared by the heads, rms_norm_eps)
times kda_gate[l]. Epilogue: h[l][b, rows] = x[l][b, rows] + y.
"""

from __future__ import annotations

from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.KDA_OUT_NORM


def reads(ins: Instruction, layout) -> list:
    c, nb = layout.config, layout.batch
    D = c.kda_dim
    return (per_batch("kda_o", ins.layer, 0, D, nb, D) + per_batch("kda_gate", ins.layer, 0, D, nb, D)
            + per_batch("x", ins.layer, ins.a0, ins.a0 + ins.a1, nb, c.hidden_size))


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("h", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.hidden_size)


def gated_output(ctx, layer: int):
    """[B, D] float32: rms_norm(o, o_norm) * gate, per head."""
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    B = b.x.shape[1]
    o = b.kda_o[layer].view(B, c.linear_num_heads, c.linear_head_dim)
    normed = rms_normalize(o, w.kda_o_norm[layer], c.rms_norm_eps).reshape(B, c.kda_dim)
    return normed * b.kda_gate[layer]


def reference(ins: Instruction, ctx) -> None:
    w, b = ctx.weights, ctx.bufs
    l, lo, hi = ins.layer, ins.a0, ins.a0 + ins.a1
    b.h[l, :, lo:hi] = b.x[l, :, lo:hi] + matvec(w.kda_o_proj[l, lo:hi], gated_output(ctx, l))
