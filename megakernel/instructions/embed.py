"""EMBED: x[0][b] = embed[token[b]] in float32. One instruction for the whole batch.

Operands: none. Waits on nothing; signals the EMBED counter.
"""

from __future__ import annotations

from .context import StageContext, f32
from .opcodes import Opcode
from .record import Instruction

OPCODE = Opcode.EMBED


def reads(ins: Instruction, layout) -> list:
    return [("tokens", 0, 0, layout.batch)]


def writes(ins: Instruction, layout) -> list:
    return [("x", 0, 0, layout.batch * layout.config.hidden_size)]


def reference(ins: Instruction, ctx: StageContext) -> None:
    b = ctx.bufs
    b.x[0] = f32(ctx.weights.embed[b.tokens.long()])
