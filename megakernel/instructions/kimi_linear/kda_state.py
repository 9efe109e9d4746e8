"""KDA_STATE: one (sequence, head group) of a KDA layer's recurrent step: the short convolution with its
conv state, l2norm, the per-channel decay and the delta-rule update of the recurrent state, the head
outputs and the output gate.

Operands: a0 = sequence b, a1 = head group (heads [a1*g, (a1+1)*g), g = layout.kda_head_group).
The sequence's state slot s = kda_slots[b] and its position p = positions[b] are read at run time.

Per head h of the group (dk = dv = linear_head_dim; u = kda_proj[l][b], written by KDA_PROJ):

    window  = [conv_state[s, ch] | u[ch]]   ch: the head's q, k, v channels; conv_state = 0 when p == 0
    q, k, v = silu(sum_j conv_taps[ch, j] * window[:, j]);  conv_state[s, ch] = window[:, 1:]
    g       = -exp(A_log[h]) * softplus(f_b[h rows] . u[f_a] + dt_bias[h rows])   [dk]
    beta    = sigmoid(u[beta + h])
    q       = l2norm(q) / sqrt(dk);  k = l2norm(k)
    S       = state[s, h] (0 when p == 0);  S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T
    state[s, h] = S;  kda_o[l][b, h] = S^T q
    kda_gate[l][b, h] = sigmoid(g_b[h rows] . u[g_a])

The recurrent state [dk, dv] of (slot, head) and the conv state of its channels are read and written by
this one instruction, once per step: no other instruction of the step touches them (the decoder checks
that the sequences' slots are distinct), so there is no write-after-read to order. At p == 0 the old
contents are never read (a new sequence starts from an empty state, whatever the slot held before).
f_b and g_b are applied here, per head, rather than by a whole-batch stage: one dependency hop less per
layer, at the cost of streaming those [D, dk] matrices once per sequence (nothing is duplicated at
batch 1).
"""

from __future__ import annotations

import torch

from ...model.kimi_linear.reference import kda_decay, kda_recurrent_step, l2norm
from ..context import f32, matvec
from ..opcodes import Opcode
from ..record import Instruction
from .common import channel_spans, head_range, kda_offsets, kda_proj_rows

OPCODE = Opcode.KDA_STATE


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    b, heads, l = ins.a0, head_range(ins, layout), ins.layer
    nh, r, cd = c.linear_num_heads, kda_proj_rows(c), c.conv_dim
    off = kda_offsets(c)
    out = [("positions", 0, b, b + 1), ("kda_slots", 0, b, b + 1),
           ("kda_proj", l, b * r + off["f_a"], b * r + off["beta"]),          # f_a and g_a
           ("kda_proj", l, b * r + off["beta"] + heads.start, b * r + off["beta"] + heads.stop),
           ("kda_state", l, b * nh + heads.start, b * nh + heads.stop)]
    out += [("kda_proj", l, b * r + lo, b * r + hi) for lo, hi in channel_spans(c, heads)]
    out += [("kda_conv", l, b * cd + lo, b * cd + hi) for lo, hi in channel_spans(c, heads)]
    return out


def writes(ins: Instruction, layout) -> list:
    c = layout.config
    b, heads, l = ins.a0, head_range(ins, layout), ins.layer
    nh, dk, D, cd = c.linear_num_heads, c.linear_head_dim, c.kda_dim, c.conv_dim
    out = [("kda_o", l, b * D + heads.start * dk, b * D + heads.stop * dk),
           ("kda_gate", l, b * D + heads.start * dk, b * D + heads.stop * dk),
           ("kda_state", l, b * nh + heads.start, b * nh + heads.stop)]
    out += [("kda_conv", l, b * cd + lo, b * cd + hi) for lo, hi in channel_spans(c, heads)]
    return out


def reference(ins: Instruction, ctx) -> None:
    c, w, bufs = ctx.layout.config, ctx.weights, ctx.bufs
    l, b = ins.layer, ins.a0
    heads = head_range(ins, ctx.layout)
    hs = slice(heads.start, heads.stop)
    g, dk, off = len(heads), c.linear_head_dim, kda_offsets(c)
    rows = slice(heads.start * dk, heads.stop * dk)               # the heads' rows of f_b, g_b, dt_bias
    pos, slot = int(bufs.positions[b]), int(bufs.kda_slots[b])
    u = bufs.kda_proj[l, b]                                         # [R]
    ch = torch.cat([torch.arange(lo, hi) for lo, hi in channel_spans(c, heads)])   # [3 g dk]
    if pos == 0:
        prev = torch.zeros(ch.numel(), c.conv_state_len)
        state = torch.zeros(g, dk, dk)
    else:
        prev = bufs.kda_conv[l, slot, ch]
        state = bufs.kda_state[l, slot, hs]
    window = torch.cat([prev, u[ch, None]], dim=-1)                 # [3 g dk, K]
    qkv = torch.nn.functional.silu((window * f32(w.kda_conv_taps[l, ch])).sum(dim=-1))
    q, k, v = (t.view(g, dk) for t in qkv.split(g * dk))
    f_a = u[off["f_a"]:off["f_a"] + dk]
    gate_logits = matvec(w.kda_f_b[l, rows], f_a[None])[0] + f32(w.kda_dt_bias[l, rows])
    decay = kda_decay(gate_logits.view(g, dk), w.kda_a_log[l, hs])
    beta = torch.sigmoid(u[off["beta"] + heads.start:off["beta"] + heads.stop])
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)
    o, state = kda_recurrent_step(state[None], q[None], k[None], v[None], decay[None], beta[None])
    bufs.kda_conv[l, slot, ch] = window[:, 1:]
    bufs.kda_state[l, slot, hs] = state[0]
    bufs.kda_o[l, b, rows] = o[0].reshape(-1)
    g_a = u[off["g_a"]:off["g_a"] + dk]
    bufs.kda_gate[l, b, rows] = torch.sigmoid(matvec(w.kda_g_b[l, rows], g_a[None])[0])
