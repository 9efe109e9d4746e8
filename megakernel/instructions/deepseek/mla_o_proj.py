"""MLA_O_PROJ: a tile of the output projection plus the residual.

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `o_proj[l]` [H, num_heads * v].
Epilogue: h[l][b, rows] = x[l][b, rows] + y (a separate buffer: no CTA overwrites x[l] while another
still reads it).
"""

from __future__ import annotations

from ..context import matvec
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.MLA_O_PROJ


def reads(ins: Instruction, layout) -> list:
    c, nb = layout.config, layout.batch
    lo, hi = ins.a0, ins.a0 + ins.a1
    return (per_batch("attn_out", ins.layer, 0, c.o_proj_cols, nb, c.o_proj_cols)
            + per_batch("x", ins.layer, lo, hi, nb, c.hidden_size))


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("h", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.hidden_size)


def reference(ins: Instruction, ctx) -> None:
    w, b = ctx.weights, ctx.bufs
    l, lo, hi = ins.layer, ins.a0, ins.a0 + ins.a1
    b.h[l, :, lo:hi] = b.x[l, :, lo:hi] + matvec(w.o_proj[l, lo:hi], b.attn_out[l])
