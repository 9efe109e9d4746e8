"""TP_REDUCE: rows of the residual stream after an exchange, the same on every rank.

Operands: a0 = first row, a1 = row count, a2 = tile index, a3 = the part of the layer it closes:
ATTENTION (0): h[l] = x[l] + sum_s recv_o[l][s];  FFN (1): x[l+1] = h[l] + sum_s recv_down[l][s].

The partials are summed in rank order (slot 0, then 1, ...), then added to the residual. Every rank holds
the same received values (each rank stored its partial into every rank's slot) and, by induction from
EMBED, the same residual, so every rank computes a bit-identical h and x whichever rank finished first:
the step is deterministic and the replicated RMS norms see the same input everywhere.
"""

from __future__ import annotations

from ..context import StageContext
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .partial_send import recv_regions

OPCODE = Opcode.TP_REDUCE
ATTENTION, FFN = 0, 1
# per part: (receive buffer, residual buffer and its layer offset, output buffer and its layer offset)
PARTS = {ATTENTION: ("recv_o", "x", 0, "h", 0), FFN: ("recv_down", "h", 0, "x", 1)}


def reads(ins: Instruction, layout) -> list:
    recv, residual, r_off, _, _ = PARTS[ins.a3]
    lo, hi, nb, h = ins.a0, ins.a0 + ins.a1, layout.batch, layout.config.hidden_size
    out = per_batch(residual, ins.layer + r_off, lo, hi, nb, h)
    for src in range(layout.world_size):
        out += recv_regions(recv, ins.layer, src, lo, hi, layout)
    return out


def writes(ins: Instruction, layout) -> list:
    _, _, _, dst, d_off = PARTS[ins.a3]
    return per_batch(dst, ins.layer + d_off, ins.a0, ins.a0 + ins.a1, layout.batch, layout.config.hidden_size)


def reference(ins: Instruction, ctx: StageContext) -> None:
    if ins.a3 not in PARTS:
        raise ValueError(f"TP_REDUCE #{ins.index} a3={ins.a3} names no part (ATTENTION 0, FFN 1)")
    recv_field, residual, r_off, dst, d_off = PARTS[ins.a3]
    b, l, lo, hi = ctx.bufs, ins.layer, ins.a0, ins.a0 + ins.a1
    recv = getattr(b, recv_field)
    total = recv[l, 0, :, lo:hi].clone()
    for src in range(1, recv.shape[1]):
        total += recv[l, src, :, lo:hi]
    getattr(b, dst)[l + d_off, :, lo:hi] = getattr(b, residual)[l + r_off, :, lo:hi] + total
