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

Past KERNEL_SPLIT_BATCH (split_k.py), QKV, O_PROJ and DOWN may be split over K: a tile of range k_part of
k_parts multiplies its rows over that range of columns only (QKV: the input times the norm weight, without the
row's RMS scale, which needs all of K) and stores the float32 partial into part_<stage>[l, k_part] instead of
running the epilogue; MV_REDUCE adds a row range's partials in range order and runs the epilogue
(`store_output`); QKV's partials are summed, times the RMS scale, by the attention that reads them
(split_k.qkv_reduce_folded).
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


# the partial-sum buffer of each stage that may be split over K: f32 [L, k_parts, B, rows]
PART_BUFFERS = {Opcode.QKV: "part_qkv", Opcode.O_PROJ: "part_o", Opcode.DOWN: "part_down"}


def k_range(ins: Instruction, layout) -> tuple[int, int]:
    """Columns [k0, k1) a tile multiplies: range k_part of k_parts equal ranges of K."""
    _, k = weight_rows(ins.opcode, layout)
    width = k // ins.k_parts
    return ins.k_part * width, (ins.k_part + 1) * width


def part_regions(op: Opcode, layer: int, e: int, lo: int, hi: int, layout) -> list:
    """Rows [lo, hi) of range e's partials of a split stage, every sequence: index (e * B + b) * rows + i."""
    rows, _ = weight_rows(op, layout)
    nb = layout.batch
    return [(PART_BUFFERS[op], layer, (e * nb + b) * rows + lo, (e * nb + b) * rows + hi) for b in range(nb)]


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
    if ins.k_parts > 1:
        return out              # (the residual is MV_REDUCE's)
    out += residual_reads(op, l, lo, hi, layout)
    return out


def residual_reads(op: Opcode, layer: int, lo: int, hi: int, layout) -> list:
    """The residual rows [lo, hi) a stage's epilogue adds (O_PROJ: x[l], DOWN: h[l]; the others none)."""
    c, nb = layout.config, layout.batch
    if op == Opcode.O_PROJ:
        return per_batch("x", layer, lo, hi, nb, c.hidden_size)
    if op == Opcode.DOWN:
        return per_batch("h", layer, lo, hi, nb, c.hidden_size)
    return []


def writes(ins: Instruction, layout) -> list:
    if ins.k_parts > 1:
        return part_regions(ins.opcode, ins.layer, ins.k_part, ins.a0, ins.a0 + ins.a1, layout)
    return output_regions(ins.opcode, ins.layer, ins.a0, ins.a0 + ins.a1, ins.a2, layout)


def output_regions(op: Opcode, l: int, lo: int, hi: int, tile: int, layout) -> list:
    """What a stage's epilogue writes for rows [lo, hi) (tile: the LM head's argmax slot)."""
    c, nb = layout.config, layout.batch
    if op == Opcode.QKV:
        return per_batch("qkv", l, lo, hi, nb, c.qkv_rows)
    if op == Opcode.O_PROJ:
        return per_batch("h", l, lo, hi, nb, c.hidden_size)
    if op == Opcode.GATE_UP:
        return per_batch("act", l, lo // 2, hi // 2, nb, c.intermediate_size)
    if op == Opcode.DOWN:
        return per_batch("x", l + 1, lo, hi, nb, c.hidden_size)
    return per_batch("logits", 0, lo, hi, nb, c.vocab_size) + [("lm_tile", 0, tile, tile + 1)]


def norm_input(op: Opcode, layer: int, embed_input: bool, ctx: StageContext):
    """(input rows [B, K] float32, norm weight or None) of a stage with an RMSNorm prologue, or of O_PROJ / DOWN
    (no norm: the input as it is). embed_input: layer 0's QKV reading embed[token] (StepLayout.embed_folded)."""
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    if op == Opcode.QKV:
        return (f32(w.embed[b.tokens.long()]) if embed_input else b.x[layer]), w.attn_norm[layer]
    if op == Opcode.GATE_UP:
        return b.h[layer], w.mlp_norm[layer]
    if op == Opcode.LM_HEAD:
        return b.x[c.num_layers], w.final_norm
    return (b.attn_out[layer] if op == Opcode.O_PROJ else b.act[layer]), None


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row of x [B, K], as [B, 1] float32."""
    return torch.rsqrt(f32(x).pow(2).mean(-1, keepdim=True) + eps)


def reference(ins: Instruction, ctx: StageContext) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    op, l = ins.opcode, ins.layer
    lo, hi = ins.a0, ins.a0 + ins.a1
    eps = c.rms_norm_eps
    if ins.k_parts > 1:
        # a K range's partial: the input times the norm weight, without the row's RMS scale (applied where the
        # ranges are summed)
        if op == Opcode.O_PROJ and ins.a3 > 0:
            inp = merge_splits(b.attn_part_lse[l], b.attn_part_o[l]).reshape(b.h.shape[1], -1)
        else:
            inp, nw = norm_input(op, l, op == Opcode.QKV and ins.a3 == 1, ctx)
            inp = f32(inp) * (f32(nw) if nw is not None else 1.0)
        k0, k1 = k_range(ins, ctx.layout)
        rows = streamed_rows(w, {Opcode.QKV: w.qkv[l], Opcode.O_PROJ: w.o_proj[l], Opcode.DOWN: w.down[l]}[op][lo:hi])
        getattr(b, PART_BUFFERS[op])[l, ins.k_part, :, lo:hi] = matvec(rows[:, k0:k1], inp[:, k0:k1])
        return
    if op == Opcode.QKV:
        inp = rms_normalize(f32(w.embed[b.tokens.long()]) if ins.a3 == 1 else b.x[l], w.attn_norm[l], eps)
        rows = w.qkv[l, lo:hi]
    elif op == Opcode.O_PROJ:
        if ins.a3 > 0:
            inp = merge_splits(b.attn_part_lse[l], b.attn_part_o[l]).reshape(b.h.shape[1], -1)
        else:
            inp = b.attn_out[l]
        rows = w.o_proj[l, lo:hi]
    elif op == Opcode.GATE_UP:
        inp = rms_normalize(b.h[l], w.mlp_norm[l], eps)
        rows = w.gate_up[l, lo:hi]
    elif op == Opcode.DOWN:
        inp = b.act[l]
        rows = w.down[l, lo:hi]
    elif op == Opcode.LM_HEAD:
        inp = rms_normalize(b.x[c.num_layers], w.final_norm, eps)
        rows = w.lm_head[lo:hi]
    else:
        raise ValueError(f"{op!r} is not a matvec stage")
    rows = streamed_rows(w, rows)
    store_output(op, l, lo, hi, ins.a2, matvec(rows, inp), ctx)


def store_output(op: Opcode, l: int, lo: int, hi: int, tile: int, y, ctx: StageContext) -> None:
    """A stage's epilogue for rows [lo, hi) of y = W . input ([B, hi - lo] float32): the QKV store, the residual
    add, SiLU(gate) * up, or the logits and the tile's (max, argmax) into slot `tile`."""
    b = ctx.bufs
    if op == Opcode.QKV:
        b.qkv[l, :, lo:hi] = y
    elif op == Opcode.O_PROJ:
        b.h[l, :, lo:hi] = b.x[l, :, lo:hi] + y
    elif op == Opcode.GATE_UP:
        y = y.view(y.shape[0], -1, 2, ROW_GROUP)          # [B, pairs, gate|up, ROW_GROUP]
        act = torch.nn.functional.silu(y[:, :, 0]) * y[:, :, 1]
        b.act[l, :, lo // 2:hi // 2] = act.reshape(y.shape[0], -1)
    elif op == Opcode.DOWN:
        b.x[l + 1, :, lo:hi] = b.h[l, :, lo:hi] + y
    elif op == Opcode.LM_HEAD:
        b.logits[:, lo:hi] = y
        m, i = y.max(dim=1)                # torch returns the first index among equal maxima
        b.lm_max[:, tile] = m
        b.lm_idx[:, tile] = (i + lo).to(torch.int32)
    else:
        raise ValueError(f"{op!r} is not a matvec stage")
