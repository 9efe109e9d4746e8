"""EXPERT_GATE_UP: a row tile of the gate/up projection of the routed expert in one (sequence, slot).

Operands: a0 = sequence b, a1 = slot k (< num_experts_per_tok), a2 = first row, a3 = row count.
The expert is read at run time: e = topk_ids[l][b, k], written by ROUTER_TOPK, so the instruction
stream is the same whatever the routing. Rows of `experts_gate_up[m, e]` [2 Fe, H], gate/up
interleaved by ROW_GROUP. Prologue: RMSNorm(h[l][b], mlp_norm[l]).
Epilogue: expert_act[l][b, k, rows / 2] = silu(gate) * up.
"""

from __future__ import annotations

from ..context import matvec, rms_normalize
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index, silu_mul_interleaved

OPCODE = Opcode.EXPERT_GATE_UP


def slot_index(ins: Instruction, layout) -> int:
    """Flat index b * K + k of the instruction's (sequence, slot)."""
    return ins.a0 * layout.config.num_experts_per_tok + ins.a1


def routed_expert(ctx, layer: int, b: int, slot: int) -> int:
    """The expert id ROUTER_TOPK wrote for (b, slot); an id out of range (the buffer is poisoned with
    -1 before each step) means the router has not run yet: an error, never a silent wrap-around."""
    c = ctx.layout.config
    e = int(ctx.bufs.topk_ids[moe_index(c, layer), b, slot])
    if not 0 <= e < c.n_routed_experts:
        raise RuntimeError(f"layer {layer} sequence {b} slot {slot}: expert id {e} outside [0, "
                           f"{c.n_routed_experts}) (read before ROUTER_TOPK wrote it?)")
    return e


def reads(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    s = slot_index(ins, layout)
    return [("topk_ids", ins.layer, s, s + 1), ("h", ins.layer, ins.a0 * h, (ins.a0 + 1) * h)]


def writes(ins: Instruction, layout) -> list:
    f = layout.config.moe_intermediate_size
    s = slot_index(ins, layout)
    return [("expert_act", ins.layer, s * f + ins.a2 // 2, s * f + (ins.a2 + ins.a3) // 2)]


def reference(ins: Instruction, ctx) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, b, slot, lo, hi = ins.layer, ins.a0, ins.a1, ins.a2, ins.a2 + ins.a3
    m = moe_index(c, l)
    e = routed_expert(ctx, l, b, slot)
    x = rms_normalize(bufs.h[l, b:b + 1], w.mlp_norm[l], c.rms_norm_eps)
    bufs.expert_act[m, b, slot, lo // 2:hi // 2] = silu_mul_interleaved(matvec(w.experts_gate_up[m, e, lo:hi], x))[0]
