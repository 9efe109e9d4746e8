"""The five weight-streaming stages share one shape: a tile of ROW_GROUP-multiple consecutive rows of
a packed weight matrix times an activation vector per sequence, with a prologue (RMSNorm or none) and
an epilogue (store, residual add, SiLU-and-multiply, logits + tile argmax).

Operands of each: a0 = first row, a1 = row count, a2 = tile index (LM_HEAD's slot for its argmax);
O_PROJ's a3 = number of KV splits when it merges the attention splits itself (its input is then the
log-sum-exp merge of attn_part[l], what ATTN_REDUCE would have written to attn_out[l]), else 0.
QKV's a3 = 1 in layer 0 of a layout with the embedding folded in (StepLayout.embed_folded): its input
is then embed[token] (float32), what EMBED writes to x[0], read from the table directly.

| stage   | weight            | input (rows of)          | prologue            | epilogue                        |
|---------|-------------------|--------------------------|---------------------|---------------------------------|
| QKV     | qkv[l]            | x[l]                     | RMSNorm attn_norm   | qkv[l] = y                      |
| O_PROJ  | o_proj[l]         | attn_out[l]              | -                   | h[l] = x[l] + y                 |
| GATE_UP | gate_up[l]        | h[l]                     | RMSNorm mlp_norm    | act[l] = silu(y_gate) * y_up    |
| DOWN    | down[l]           | act[l]                   | -                   | x[l+1] = h[l] + y               |
| LM_HEAD | lm_head           | x[L]                     | RMSNorm final_norm  | logits = y; (max, argmax) tile  |
"""

from __future__ import annotations

import torch

from .attention import merge_splits
from .context import StageContext, f32, matvec, rms_normalize
from .layout import ROW_GROUP, streamed_rows
from .opcodes import Opcode
from .record import Instruction

MATVEC_OPCODES = (Opcode.QKV, Opcode.O_PROJ, Opcode.GATE_UP, Opcode.DOWN, Opcode.LM_HEAD)


def weight_rows(op: Opcode, layout) -> tuple[int, int]:
    """(rows, K) of the packed matrix a stage streams."""
    c = layout.config
    return {
        Opcode.QKV: (c.qkv_rows, c.hidden_size),
        Opcode.O_PROJ: (c.hidden_size, c.q_size),
        Opcode.GATE_UP: (2 * c.intermediate_size, c.hidden_size),
        Opcode.DOWN: (c.hidden_size, c.intermediate_size),
        Opcode.LM_HEAD: (c.vocab_size, c.hidden_size),
    }[op]


def _input_name(op: Opcode) -> str:
    return {Opcode.QKV: "x", Opcode.O_PROJ: "attn_out", Opcode.GATE_UP: "h", Opcode.DOWN: "act",
            Opcode.LM_HEAD: "x"}[op]


def per_batch(name: str, layer: int, lo: int, hi: int, batch: int, width: int) -> list:
    """Regions [lo, hi) of every sequence's row of a [.., B, width] buffer, indexed b * width + i."""
    return [(name, layer, b * width + lo, b * width + hi) for b in range(batch)]


def reads(ins: Instruction, layout) -> list:
    c, nb = layout.config, layout.batch
    op, l = ins.opcode, ins.layer
    in_layer = c.num_layers if op == Opcode.LM_HEAD else l
    _, k = weight_rows(op, layout)
    if op == Opcode.O_PROJ and ins.a3 > 0:
        out = [("attn_part", l, 0, nb * c.num_heads * ins.a3)]
    elif op == Opcode.QKV and ins.a3 == 1:
        out = [("tokens", 0, 0, nb)]
    else:
        out = per_batch(_input_name(op), in_layer, 0, k, nb, k)
    lo, hi = ins.a0, ins.a0 + ins.a1
    if op == Opcode.O_PROJ:
        out += per_batch("x", l, lo, hi, nb, c.hidden_size)
    if op == Opcode.DOWN:
        out += per_batch("h", l, lo, hi, nb, c.hidden_size)
    return out


def writes(ins: Instruction, layout) -> list:
    c, nb = layout.config, layout.batch
    op, l = ins.opcode, ins.layer
    lo, hi = ins.a0, ins.a0 + ins.a1
    if op == Opcode.QKV:
        return per_batch("qkv", l, lo, hi, nb, c.qkv_rows)
    if op == Opcode.O_PROJ:
        return per_batch("h", l, lo, hi, nb, c.hidden_size)
    if op == Opcode.GATE_UP:
        return per_batch("act", l, lo // 2, hi // 2, nb, c.intermediate_size)
    if op == Opcode.DOWN:
        return per_batch("x", l + 1, lo, hi, nb, c.hidden_size)
    return per_batch("logits", 0, lo, hi, nb, c.vocab_size) + [("lm_tile", 0, ins.a2, ins.a2 + 1)]


def reference(ins: Instruction, ctx: StageContext) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    op, l = ins.opcode, ins.layer
    lo, hi = ins.a0, ins.a0 + ins.a1
    eps = c.rms_norm_eps
    if op == Opcode.QKV:
        inp = f32(w.embed[b.tokens.long()]) if ins.a3 == 1 else b.x[l]
        b.qkv[l, :, lo:hi] = matvec(streamed_rows(w, w.qkv[l, lo:hi]), rms_normalize(inp, w.attn_norm[l], eps))
    elif op == Opcode.O_PROJ:
        if ins.a3 > 0:
            inp = merge_splits(b.attn_part_lse[l], b.attn_part_o[l]).reshape(b.h.shape[1], -1)
        else:
            inp = b.attn_out[l]
        b.h[l, :, lo:hi] = b.x[l, :, lo:hi] + matvec(streamed_rows(w, w.o_proj[l, lo:hi]), inp)
    elif op == Opcode.GATE_UP:
        y = matvec(streamed_rows(w, w.gate_up[l, lo:hi]), rms_normalize(b.h[l], w.mlp_norm[l], eps))
        y = y.view(y.shape[0], -1, 2, ROW_GROUP)          # [B, pairs, gate|up, ROW_GROUP]
        act = torch.nn.functional.silu(y[:, :, 0]) * y[:, :, 1]
        b.act[l, :, lo // 2:hi // 2] = act.reshape(y.shape[0], -1)
    elif op == Opcode.DOWN:
        b.x[l + 1, :, lo:hi] = b.h[l, :, lo:hi] + matvec(streamed_rows(w, w.down[l, lo:hi]), b.act[l])
    elif op == Opcode.LM_HEAD:
        xn = rms_normalize(b.x[c.num_layers], w.final_norm, eps)
        y = matvec(streamed_rows(w, w.lm_head[lo:hi]), xn)
        b.logits[:, lo:hi] = y
        m, i = y.max(dim=1)                # torch returns the first index among equal maxima
        b.lm_max[:, ins.a2] = m
        b.lm_idx[:, ins.a2] = (i + lo).to(torch.int32)
    else:
        raise ValueError(f"{op!r} is not a matvec stage")
