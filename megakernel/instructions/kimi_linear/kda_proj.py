"""KDA_PROJ: a row tile of a KDA layer's fused input projection of the normed hidden state.

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `kda_in[l]` [R, H] (layout in
kimi_linear.common: [q | k | v | f_a | g_a | beta | pad]). Prologue: RMSNorm(x[l], attn_norm[l],
rms_norm_eps) (every tile recomputes it: cheaper than a sync). One instruction serves the whole batch.
Epilogue: kda_proj[l][b, rows] = y (raw: the convolution, gates and norms are KDA_STATE's).
"""

from __future__ import annotations

from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import kda_proj_rows

OPCODE = Opcode.KDA_PROJ


def reads(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("x", ins.layer, 0, h, layout.batch, h)


def writes(ins: Instruction, layout) -> list:
    r = kda_proj_rows(layout.config)
    return per_batch("kda_proj", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, r)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, lo, hi = ins.layer, ins.a0, ins.a0 + ins.a1
    b.kda_proj[l, :, lo:hi] = matvec(w.kda_in[l, lo:hi], rms_normalize(b.x[l], w.attn_norm[l], c.rms_norm_eps))
