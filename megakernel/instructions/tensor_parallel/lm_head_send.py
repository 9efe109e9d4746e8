"""TP_LM_HEAD: rows of one rank's slice of the vocabulary, with the tile's (max, argmax) stored into every
rank's argmax slots.

Operands: a0 = first row (of the rank's LM head rows), a1 = row count, a2 = tile index, a3 = tiles per rank.

Like LM_HEAD: logits[:, rows] = Wlm[rows] . rmsnorm(x[L]) into the rank's own logits (its slice of the
vocabulary), and the tile's max with its argmax (the lowest row among equal maxima) as a vocabulary id
(rank * V/W + row). Those go to slot rank * a3 + a2 of lm_max / lm_idx of every rank, its own included, and
the signal to the exchange counter of every rank. The plain ARGMAX (a0 = world_size * a3) then reduces all
ranks' slots on each rank: the largest value, among equal ones the lowest vocabulary id, as on one GPU, so
every rank picks the same token and advances the same tokens and positions.
"""

from __future__ import annotations

import torch

from ..context import StageContext, matvec, rms_normalize
from ..layout import streamed_rows
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODE = Opcode.TP_LM_HEAD


def reads(ins: Instruction, layout) -> list:
    c = layout.config
    return per_batch("x", c.num_layers, 0, c.hidden_size, layout.batch, c.hidden_size)


def writes(ins: Instruction, layout) -> list:
    v = layout.config.vocab_size
    return per_batch("logits", 0, ins.a0, ins.a0 + ins.a1, layout.batch, v)


def peer_writes(ins: Instruction, layout) -> list:
    """Regions written on every rank (its own included): the tile's argmax slot."""
    slot = layout.rank * ins.a3 + ins.a2
    return [("lm_tile", 0, slot, slot + 1)]


def reference(ins: Instruction, ctx: StageContext) -> None:
    c, w, b, layout = ctx.layout.config, ctx.weights, ctx.bufs, ctx.layout
    lo, hi = ins.a0, ins.a0 + ins.a1
    y = matvec(streamed_rows(w, w.lm_head[lo:hi]), rms_normalize(b.x[c.num_layers], w.final_norm, c.rms_norm_eps))
    b.logits[:, lo:hi] = y
    m, i = y.max(dim=1)                # torch returns the first index among equal maxima
    ids = (i + lo + layout.vocab_offset).to(torch.int32)
    slot = layout.rank * ins.a3 + ins.a2
    for peer in ctx.peers:
        peer.lm_max[:, slot] = m
        peer.lm_idx[:, slot] = ids
