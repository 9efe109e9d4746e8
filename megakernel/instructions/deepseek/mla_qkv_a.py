"""MLA_QKV_A: a tile of the fused projection of the normed hidden state.

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `qkv_a[l]` [q_a_rows + c + r, H]:
the query part (q_a_proj with q LoRA, else the whole q_proj), the latent (c) and the shared rope key (r).
Prologue: RMSNorm(x[l], attn_norm[l]) (every tile recomputes it: cheaper than a sync).
Epilogue: qkv_a[l][b, rows] = y (raw: the latent norm and RoPE are applied by their consumers).
"""

from __future__ import annotations

from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.MLA_QKV_A


def reads(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("x", ins.layer, 0, h, layout.batch, h)


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("qkv_a", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.qkv_a_rows)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, lo, hi = ins.layer, ins.a0, ins.a0 + ins.a1
    b.qkv_a[l, :, lo:hi] = matvec(w.qkv_a[l, lo:hi], rms_normalize(b.x[l], w.attn_norm[l], c.rms_norm_eps))
