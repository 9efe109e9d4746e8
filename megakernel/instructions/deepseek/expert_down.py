"""EXPERT_DOWN: a row tile of the down projection of the routed expert in one (sequence, slot).

Operands: a0 = sequence b, a1 = slot k, a2 = first row, a3 = row count. e = topk_ids[l][b, k] read at
run time, as EXPERT_GATE_UP. Rows of `experts_down[m, e]` [H, Fe].
Epilogue: expert_out[l][b, k, rows] = y (unweighted; MOE_COMBINE applies the routing weight).
"""

from __future__ import annotations

from ..context import matvec
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index
from .expert_gate_up import routed_expert, slot_index

OPCODE = Opcode.EXPERT_DOWN


def reads(ins: Instruction, layout) -> list:
    f = layout.config.moe_intermediate_size
    s = slot_index(ins, layout)
    return [("topk_ids", ins.layer, s, s + 1), ("expert_act", ins.layer, s * f, (s + 1) * f)]


def writes(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    s = slot_index(ins, layout)
    return [("expert_out", ins.layer, s * h + ins.a2, s * h + ins.a2 + ins.a3)]


def reference(ins: Instruction, ctx) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, b, slot, lo, hi = ins.layer, ins.a0, ins.a1, ins.a2, ins.a2 + ins.a3
    m = moe_index(c, l)
    e = routed_expert(ctx, l, b, slot)
    bufs.expert_out[m, b, slot, lo:hi] = matvec(w.experts_down[m, e, lo:hi], bufs.expert_act[m, b, slot][None])[0]
