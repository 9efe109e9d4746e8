"""ROUTER: a tile of the MoE router's sigmoid scores.

Operands: a0 = first expert, a1 = expert count, a2 = tile index. Rows of `router[m]` [E, H] (float32,
as transformers keeps it; m = the layer's MoE index). Prologue: RMSNorm(h[l], mlp_norm[l]).
Epilogue: router_scores[l][b, experts] = sigmoid(y). The router of a large model (Kimi-K2: 384 x 7168
float32, 11 MB) is spread over many SMs like any other matrix; ROUTER_TOPK then chooses.
"""

from __future__ import annotations

import torch

from ..context import matvec, rms_normalize
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index

OPCODE = Opcode.ROUTER


def reads(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return per_batch("h", ins.layer, 0, h, layout.batch, h)


def writes(ins: Instruction, layout) -> list:
    e = layout.config.n_routed_experts
    return per_batch("router_scores", ins.layer, ins.a0, ins.a0 + ins.a1, layout.batch, e)


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    l, m, lo, hi = ins.layer, moe_index(c, ins.layer), ins.a0, ins.a0 + ins.a1
    x = rms_normalize(b.h[l], w.mlp_norm[l], c.rms_norm_eps)
    b.router_scores[m, :, lo:hi] = torch.sigmoid(matvec(w.router[m, lo:hi], x))
