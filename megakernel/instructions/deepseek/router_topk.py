"""ROUTER_TOPK: DeepSeek-V3's group-limited top-k (noaux_tc) for every sequence. One instruction.

Operands: none (all sequences). Reads router_scores[l] [B, E] and the bias e_score_correction_bias
[E]; writes, per (sequence b, slot k < num_experts_per_tok), the expert id topk_ids[l][b, k] (int32)
and its weight topk_w[l][b, k]. Those two buffers are what the routed-expert instructions read at run
time, so one schedule serves every routing.

Choice = score + bias (the bias only chooses); groups (n_group of E / n_group experts) are ranked by
the sum of their two best choices and the best topk_group kept; then num_experts_per_tok passes of
argmax over the kept experts pick the slots, best first. Ties go to the lowest index (each pass is
an argmax), where torch.topk leaves the order unspecified. Weights are the unbiased scores,
renormalised over the slots when norm_topk_prob, times routed_scaling_factor.
"""

from __future__ import annotations

import torch

from ..context import f32
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction
from .common import moe_index

OPCODE = Opcode.ROUTER_TOPK


def reads(ins: Instruction, layout) -> list:
    e = layout.config.n_routed_experts
    return per_batch("router_scores", ins.layer, 0, e, layout.batch, e)


def writes(ins: Instruction, layout) -> list:
    k = layout.config.num_experts_per_tok
    return (per_batch("topk_ids", ins.layer, 0, k, layout.batch, k)
            + per_batch("topk_w", ins.layer, 0, k, layout.batch, k))


def _argmax_passes(values: torch.Tensor, passes: int) -> torch.Tensor:
    """Indices of the `passes` largest entries of each row, best first, ties to the lowest index."""
    values = values.clone()
    picks = []
    for _ in range(passes):
        idx = values.argmax(dim=-1)          # the first maximal index
        picks.append(idx)
        values.scatter_(-1, idx[:, None], float("-inf"))
    return torch.stack(picks, dim=-1)


def select_experts(scores: torch.Tensor, bias: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """scores float32 [B, E] (sigmoid) -> (expert ids int32 [B, K], weights float32 [B, K])."""
    B, E = scores.shape
    G = config.n_group
    choice = scores + f32(bias)[None]
    grouped = choice.view(B, G, E // G)
    best2 = _argmax_passes(grouped.reshape(B * G, -1), 2)
    group_score = grouped.reshape(B * G, -1).gather(1, best2).sum(-1).view(B, G)
    kept = _argmax_passes(group_score, config.topk_group)                     # [B, topk_group]
    allowed = torch.zeros(B, G, dtype=torch.bool).scatter_(1, kept, True)
    masked = choice.masked_fill(~allowed.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = _argmax_passes(masked, config.num_experts_per_tok)                  # [B, K]
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * config.routed_scaling_factor


def reference(ins: Instruction, ctx) -> None:
    c, w, b = ctx.layout.config, ctx.weights, ctx.bufs
    m = moe_index(c, ins.layer)
    ids, weights = select_experts(b.router_scores[m], w.router_bias[m], c)
    b.topk_ids[m] = ids
    b.topk_w[m] = weights
