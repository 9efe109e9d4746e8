"""Kimi Linear stages (KDA linear attention over a per-sequence recurrent state): one module per stage,
each with its record operands, reads(), writes() and torch reference(), as the dense and DeepSeek stages.

The NoPE MLA layers and the MLP / MoE of Kimi Linear reuse the DeepSeek stages (MLA_*, ROUTER*,
SHARED_*, EXPERT_*, MOE_COMBINE) and the dense GATE_UP / DOWN / EMBED / LM_HEAD / ARGMAX unchanged;
schedule.kimi_linear gives them a context whose per-kind stacks are addressed by the global layer.

KDA layer l, data flow (buffers in brackets):

    KDA_PROJ      [x] -> [kda_proj]
    KDA_STATE     [kda_proj, positions, kda_slots, kda_state, kda_conv] -> [kda_o, kda_gate, kda_state, kda_conv]
    KDA_OUT_NORM  [kda_o, kda_gate, x] -> [h]
"""

from __future__ import annotations

from . import kda_out_norm, kda_proj, kda_state
from ..opcodes import Opcode

KIMI_LINEAR_STAGE_MODULES = {
    Opcode.KDA_PROJ: kda_proj,
    Opcode.KDA_STATE: kda_state,
    Opcode.KDA_OUT_NORM: kda_out_norm,
}

__all__ = ["KIMI_LINEAR_STAGE_MODULES"]
