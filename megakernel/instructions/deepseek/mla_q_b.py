"""MLA_Q_B: a tile of the query up-projection (q LoRA models only: DeepSeek-V3, Kimi-K2).

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `q_b[l]` [num_heads * (nope + r),
q_lora_rank], head-major, each head [nope | rope].
Prologue: RMSNorm of the query part of qkv_a[l] (its first q_lora_rank rows) with q_a_norm[l] and the
latent eps 1e-6 (transformers' q_a_layernorm ignores rms_norm_eps).
Epilogue: q[l][b, rows] = y.
"""

from __future__ import annotations

from ...model.deepseek.config import LATENT_NORM_EPS
from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.MLA_Q_B


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("qkv_a", ins.layer, 0, c.q_lora_rank, layout.batch, c.qkv_a_rows)


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("q", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.q_size)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, lo, hi = ins.layer, ins.a0, ins.a0 + ins.a1
    q_a = rms_normalize(b.qkv_a[l, :, :c.q_lora_rank], w.q_a_norm[l], LATENT_NORM_EPS)
    b.q[l, :, lo:hi] = matvec(w.q_b[l, lo:hi], q_a)
