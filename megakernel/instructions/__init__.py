"""The fused instruction set: one module per stage (its record operands, what it reads and writes,
its torch reference), one opcode enum, one record format. The device code of each stage lives in
megakernel.kernel, dispatched on the same enum."""

from __future__ import annotations

from . import argmax, attention, embed, matvec_stages, split_k
from .deepseek import DEEPSEEK_STAGE_MODULES
from .kimi_linear import KIMI_LINEAR_STAGE_MODULES
from .tensor_parallel import TP_STAGE_MODULES
from .opcodes import Opcode, Stage
from .record import WORDS, Instruction, deserialize, serialize

STAGE_MODULES = {
    Opcode.EMBED: embed,
    Opcode.QKV: matvec_stages,
    Opcode.O_PROJ: matvec_stages,
    Opcode.GATE_UP: matvec_stages,
    Opcode.DOWN: matvec_stages,
    Opcode.LM_HEAD: matvec_stages,
    Opcode.ATTN_PARTIAL: attention,
    Opcode.ATTN_REDUCE: attention,
    Opcode.ARGMAX: argmax,
    Opcode.MV_REDUCE: split_k,
    **DEEPSEEK_STAGE_MODULES,
    **KIMI_LINEAR_STAGE_MODULES,
    **TP_STAGE_MODULES,
}

__all__ = ["Opcode", "Stage", "Instruction", "WORDS", "serialize", "deserialize", "STAGE_MODULES"]
