"""MOE_COMBINE: a row tile of an MoE layer's output, x[l+1] = h + shared + sum_k w_k * routed_k.

Operands: a0 = first row, a1 = row count, a2 = tile index (rows of H, every sequence). The terms are
added in a fixed order (residual, shared experts, then slots 0..K-1), so the result does not depend on
which SM finished first: the step is deterministic.
"""

from __future__ import annotations

from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index

OPCODE = Opcode.MOE_COMBINE


def reads(ins: Instruction, layout) -> list:
    c, nb = layout.config, layout.batch
    H, K = c.hidden_size, c.num_experts_per_tok
    lo, hi = ins.a0, ins.a0 + ins.a1
    out = per_batch("h", ins.layer, lo, hi, nb, H) + per_batch("topk_w", ins.layer, 0, K, nb, K)
    if c.n_shared_experts:
        out += per_batch("shared_out", ins.layer, lo, hi, nb, H)
    out += [("expert_out", ins.layer, s * H + lo, s * H + hi) for s in range(nb * K)]
    return out


def writes(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("x", ins.layer + 1, ins.a0, ins.a0 + ins.a1, layout.batch, h)


def reference(ins: Instruction, ctx) -> None:
    c, b = ctx.layout.config, ctx.bufs
    l, m, lo, hi = ins.layer, moe_index(c, ins.layer), ins.a0, ins.a0 + ins.a1
    acc = b.h[l, :, lo:hi].clone()
    if c.n_shared_experts:
        acc += b.shared_out[m, :, lo:hi]
    for k in range(c.num_experts_per_tok):
        acc += b.topk_w[m, :, k, None] * b.expert_out[m, :, k, lo:hi]
    b.x[l + 1, :, lo:hi] = acc
