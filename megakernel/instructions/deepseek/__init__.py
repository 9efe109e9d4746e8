"""DeepSeek-V3 / Kimi-K2 stages (MLA attention over a latent cache, sigmoid-routed MoE): one module per
stage, each with its record operands, reads(), writes() and torch reference(), as the dense stages.

The stages see a context with `layout` (schedule.deepseek.DeepseekStepLayout), `weights`
(DeepseekPackedWeights), `bufs` (DeepseekStepBuffers) and `latent` (the paged latent cache
[L, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]). The dense stages EMBED, GATE_UP / DOWN
(dense layers), LM_HEAD and ARGMAX are reused unchanged: the DeepSeek weights and buffers carry the
fields they read under the same names.

Layer l, data flow (buffers in brackets; every stage writes its own per-layer buffer):

    MLA_QKV_A   [x] -> [qkv_a]                  MLA_Q_B (q LoRA)  [qkv_a] -> [q]
    MLA_ABSORB  [q | qkv_a] -> [q_lat]          MLA_PARTIAL  [q_lat, q, qkv_a, latent cache] -> [mla_part]
    MLA_REDUCE  [mla_part] -> [attn_out]        MLA_O_PROJ   [attn_out, x] -> [h]
    dense layer: GATE_UP [h] -> [act];  DOWN [act, h] -> [x(l+1)]
    MoE layer:   ROUTER [h] -> [router_scores];  ROUTER_TOPK -> [topk_ids, topk_w]
                 SHARED_GATE_UP [h] -> [shared_act];  SHARED_DOWN -> [shared_out]
                 EXPERT_GATE_UP [topk_ids, h] -> [expert_act];  EXPERT_DOWN [topk_ids, expert_act] -> [expert_out]
                 MOE_COMBINE [h, shared_out, topk_w, expert_out] -> [x(l+1)]
"""

from __future__ import annotations

from . import (expert_down, expert_gate_up, mla_absorb, mla_o_proj, mla_partial, mla_q_b, mla_qkv_a, mla_reduce,
               moe_combine, router, router_topk, shared_down, shared_gate_up)
from ..opcodes import Opcode

DEEPSEEK_STAGE_MODULES = {
    Opcode.MLA_QKV_A: mla_qkv_a,
    Opcode.MLA_Q_B: mla_q_b,
    Opcode.MLA_ABSORB: mla_absorb,
    Opcode.MLA_PARTIAL: mla_partial,
    Opcode.MLA_REDUCE: mla_reduce,
    Opcode.MLA_O_PROJ: mla_o_proj,
    Opcode.ROUTER: router,
    Opcode.ROUTER_TOPK: router_topk,
    Opcode.SHARED_GATE_UP: shared_gate_up,
    Opcode.SHARED_DOWN: shared_down,
    Opcode.EXPERT_GATE_UP: expert_gate_up,
    Opcode.EXPERT_DOWN: expert_down,
    Opcode.MOE_COMBINE: moe_combine,
}

__all__ = ["DEEPSEEK_STAGE_MODULES"]
