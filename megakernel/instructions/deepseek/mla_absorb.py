"""MLA_ABSORB: the query's no-rope part carried into the latent space, q_lat[h] = W_UK[h]^T q_nope[h].

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `w_uk_t[l]` [num_heads * c, nope]
(W_UK[h] transposed, stacked per head); a tile never crosses a head, so it multiplies the rows of
head a0 // c by that head's q_nope. One instruction serves every sequence of the batch and every KV
split: W_UK is streamed once per step, not once per (sequence, split).
Epilogue: q_lat[l][b, h, rows % c] = y (the softmax scale and RoPE of the rope part are applied by
MLA_PARTIAL).
"""

from __future__ import annotations

from ..context import matvec
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import query_rows, query_source

OPCODE = Opcode.MLA_ABSORB


def head_of(ins: Instruction, config) -> int:
    head = ins.a0 // config.kv_lora_rank
    if (ins.a0 + ins.a1 - 1) // config.kv_lora_rank != head:
        raise ValueError(f"MLA_ABSORB rows [{ins.a0}, {ins.a0 + ins.a1}) cross a head boundary "
                         f"(kv_lora_rank={config.kv_lora_rank})")
    return head


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    h = head_of(ins, c)
    name, width = query_source(c)
    return per_batch(name, ins.layer, h * c.qk_head_dim, h * c.qk_head_dim + c.qk_nope_head_dim, layout.batch, width)


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("q_lat", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.num_heads * c.kv_lora_rank)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, h = ins.layer, head_of(ins, c)
    q_nope = query_rows(ctx, l)[:, h * c.qk_head_dim:h * c.qk_head_dim + c.qk_nope_head_dim]   # [B, nope]
    lo = ins.a0 - h * c.kv_lora_rank
    b.q_lat[l, :, h, lo:lo + ins.a1] = matvec(w.w_uk_t[l, ins.a0:ins.a0 + ins.a1], q_nope)
