"""SHARED_GATE_UP: a tile of the shared experts' gate/up projection (an ordinary MLP tile).

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `shared_gate_up[m]` [2 Fs, H]
(the n_shared_experts experts fused into one MLP of width Fs, gate/up interleaved by ROW_GROUP as
the dense GATE_UP, so a tile holds whole (gate, up) pairs). Prologue: RMSNorm(h[l], mlp_norm[l]).
Epilogue: shared_act[l][b, rows / 2] = silu(gate) * up.
"""

from __future__ import annotations

from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index, silu_mul_interleaved

OPCODE = Opcode.SHARED_GATE_UP


def reads(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("h", ins.layer, 0, h, layout.batch, h)


def writes(ins: Instruction, layout) -> list:
    fs = layout.config.shared_intermediate_size
    return per_batch("shared_act", ins.layer, ins.a0 // 2, (ins.a0 + ins.a1) // 2, layout.batch, fs)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, m, lo, hi = ins.layer, moe_index(c, ins.layer), ins.a0, ins.a0 + ins.a1
    y = matvec(w.shared_gate_up[m, lo:hi], rms_normalize(b.h[l], w.mlp_norm[l], c.rms_norm_eps))
    b.shared_act[m, :, lo // 2:hi // 2] = silu_mul_interleaved(y)
