"""MLA_REDUCE: merge the KV splits of one head for every sequence, then a tile of that head's W_UV.

Operands: a0 = first row, a1 = row count, a2 = tile index. Rows of `w_uv[l]` [num_heads * v, c]
(W_UV stacked per head); a tile never crosses a head (h = a0 // v). Each tile re-merges the head's
splits (S * c floats per sequence, cheaper than a sync): o_lat = sum_s exp(lse_s - LSE) * o_s,
LSE = logsumexp_s(lse_s); then attn_out[l][b, rows] = W_UV rows . o_lat. One instruction serves the
whole batch, so W_UV is streamed once per step.
"""

from __future__ import annotations

import torch

from ..context import matvec
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.MLA_REDUCE


def head_of(ins: Instruction, config) -> int:
    head = ins.a0 // config.v_head_dim
    if (ins.a0 + ins.a1 - 1) // config.v_head_dim != head:
        raise ValueError(f"MLA_REDUCE rows [{ins.a0}, {ins.a0 + ins.a1}) cross a head boundary "
                         f"(v_head_dim={config.v_head_dim})")
    return head


def reads(ins: Instruction, layout) -> list:
    c, s = layout.config, layout.kv_splits
    h = head_of(ins, c)
    return [("mla_part", ins.layer, (b * c.num_heads + h) * s, (b * c.num_heads + h + 1) * s)
            for b in range(layout.batch)]


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("attn_out", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, c.o_proj_cols)


def reference(ins: Instruction, ctx) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, h = ins.layer, head_of(ins, c)
    lse = bufs.mla_part_lse[l, :, h]                       # [B, S]
    o = bufs.mla_part_o[l, :, h]                           # [B, S, c]
    total = torch.logsumexp(lse, dim=-1, keepdim=True)     # the last split always holds the new token
    o_lat = (torch.exp(lse - total)[..., None] * o).sum(1)  # [B, c]
    bufs.attn_out[l, :, ins.a0:ins.a0 + ins.a1] = matvec(w.w_uv[l, ins.a0:ins.a0 + ins.a1], o_lat)
