"""SHARED_DOWN: a tile of the shared experts' down projection (an ordinary MLP tile).

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `shared_down[m]` [H, Fs].
Epilogue: shared_out[l][b, rows] = y (MOE_COMBINE adds it to the residual with the routed experts).
"""

from __future__ import annotations

from ..context import matvec
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index

OPCODE = Opcode.SHARED_DOWN


def reads(ins: Instruction, layout) -> list:
    fs = layout.config.shared_intermediate_size
    return per_batch("shared_act", ins.layer, 0, fs, layout.batch, fs)


def writes(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("shared_out", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, h)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    m, lo, hi = moe_index(c, ins.layer), ins.a0, ins.a0 + ins.a1
    b.shared_out[m, :, lo:hi] = matvec(w.shared_down[m, lo:hi], b.shared_act[m])
