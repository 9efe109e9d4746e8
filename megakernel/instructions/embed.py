"""EMBED: x[0][b] = embed[token[b]] in float32 for sequences b of [a0, a0 + a1): the whole batch in one instruction
up to SPLIT_BATCH; past it EMBED_SEQUENCES sequences an instruction (embed_ranges), on as many SMs, so the step's
first stage is not one SM's work for 64 sequences.

Operands: a0 = first sequence, a1 = sequences. Waits on nothing; signals the EMBED counter (or, where the layout folds
the embedding into layer 0's QKV, that stage's counter).
"""

from __future__ import annotations

from .context import StageContext, f32
from .layout import SPLIT_BATCH
from .opcodes import Opcode
from .record import Instruction

OPCODE = Opcode.EMBED
EMBED_SEQUENCES = 1        # sequences of one EMBED instruction past SPLIT_BATCH


def embed_ranges(batch: int) -> list[tuple[int, int]]:
    """(first sequence, sequences) of each EMBED instruction of a step."""
    if batch <= SPLIT_BATCH:
        return [(0, batch)]
    return [(b, min(EMBED_SEQUENCES, batch - b)) for b in range(0, batch, EMBED_SEQUENCES)]


def reads(ins: Instruction, layout) -> list:
    return [("tokens", 0, ins.a0, ins.a0 + ins.a1)]


def writes(ins: Instruction, layout) -> list:
    h = layout.config.hidden_size
    return [("x", 0, ins.a0 * h, (ins.a0 + ins.a1) * h)]


def reference(ins: Instruction, ctx: StageContext) -> None:
    b, lo, hi = ctx.bufs, ins.a0, ins.a0 + ins.a1
    b.x[0, lo:hi] = f32(ctx.weights.embed[b.tokens[lo:hi].long()])
