"""ARGMAX: the next token of each sequence from the LM head tiles' (max, argmax) pairs.

Operands: a0 = number of LM head tiles. Ties go to the lowest vocabulary index, as torch.argmax.

It also advances the step's inputs in place: tokens[b] = the new token, positions[b] += 1. Every
reader of tokens (EMBED) and positions (ATTN_PARTIAL) precedes ARGMAX in the DAG, so this is no race,
and a decode loop becomes back-to-back launches (or CUDA-graph replays) with no host work between.
"""

from __future__ import annotations

import torch

from .context import StageContext
from .opcodes import Opcode
from .record import Instruction

OPCODE = Opcode.ARGMAX


def reads(ins: Instruction, layout) -> list:
    return [("lm_tile", 0, 0, ins.a0)]


def writes(ins: Instruction, layout) -> list:
    return [("out_tokens", 0, 0, layout.batch), ("tokens", 0, 0, layout.batch),
            ("positions", 0, 0, layout.batch)]


def reference(ins: Instruction, ctx: StageContext) -> None:
    b = ctx.bufs
    vals, idx = b.lm_max[:, :ins.a0], b.lm_idx[:, :ins.a0]
    # the largest value; among equal ones the lowest row (whatever the slot that holds it)
    top = vals.max(dim=1, keepdim=True).values
    b.out_tokens.copy_(torch.where(vals == top, idx, torch.iinfo(torch.int32).max).min(dim=1).values)
    b.tokens.copy_(b.out_tokens)
    b.positions.add_(1)
