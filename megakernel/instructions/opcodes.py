"""The one opcode enum: the scheduler, the serializer, the device dispatch, the VM and the trace
names all read it, so a stage cannot be numbered differently in two places."""

from __future__ import annotations

from enum import IntEnum


class Opcode(IntEnum):
    NOP = 0
    EMBED = 1          # x[0][b] = embed[token[b]]
    QKV = 2            # rows of Wqkv . rmsnorm(x[l])
    ATTN_PARTIAL = 3   # one (sequence, kv head, KV split) of flash-decoding, + RoPE, QK-norm, KV append
    ATTN_REDUCE = 4    # merge the splits of one (sequence, kv head) by their log-sum-exp
    O_PROJ = 5         # rows of Wo . attn + residual
    GATE_UP = 6        # rows of [Wgate; Wup] . rmsnorm(h[l]) -> silu(gate) * up
    DOWN = 7           # rows of Wdown . act + residual
    LM_HEAD = 8        # rows of Wlm . rmsnorm(x[L]) -> logits and (max, argmax) of the tile
    ARGMAX = 9         # reduce the tiles' (max, argmax) -> next token
    # DeepSeek-V3 / Kimi-K2 (MLA + MoE); stage modules in megakernel/instructions/deepseek/
    MLA_QKV_A = 10       # rows of [q_a | kv_a] . rmsnorm(x[l])
    MLA_Q_B = 11         # rows of Wq_b . rmsnorm(q_a) (q LoRA only)
    MLA_ABSORB = 12      # rows of W_UK^T (per head) . q_nope -> query in the latent space
    MLA_PARTIAL = 13     # one (sequence, head group, KV split) over the latent cache, + latent append
    MLA_REDUCE = 14      # merge the splits of one head, then rows of W_UV -> attention output
    MLA_O_PROJ = 15      # rows of Wo . attn + residual
    ROUTER = 16          # rows (experts) of the router . rmsnorm(h[l]) -> sigmoid scores
    ROUTER_TOPK = 17     # group-limited top-k of the biased scores -> expert ids + weights per slot
    SHARED_GATE_UP = 18  # rows of the shared experts' [gate; up] . rmsnorm(h[l]) -> silu(gate) * up
    SHARED_DOWN = 19     # rows of the shared experts' down . act
    EXPERT_GATE_UP = 20  # one (sequence, slot, row tile) of the routed expert read from the router buffer
    EXPERT_DOWN = 21     # one (sequence, slot, row tile) of that expert's down projection
    MOE_COMBINE = 22     # rows: residual + shared + sum over slots of weight * routed, in slot order
    # Kimi Linear (KDA linear attention); stage modules in megakernel/instructions/kimi_linear/
    KDA_PROJ = 23        # rows of the fused [q | k | v | f_a | g_a | beta] projection . rmsnorm(x[l])
    KDA_STATE = 24       # one (sequence, head group): short conv, l2norm, decay + delta rule on the state
    KDA_OUT_NORM = 25    # rows of Wo . (rmsnorm(o) * sigmoid(gate)) + residual
    # Tensor parallel (dense models, several GPUs); stage modules in megakernel/instructions/tensor_parallel/
    TP_O_PROJ = 26       # rows of this rank's partial Wo . attn, stored into every rank's receive slot
    TP_DOWN = 27         # rows of this rank's partial Wdown . act, stored into every rank's receive slot
    TP_REDUCE = 28       # rows: residual + the received partials summed in rank order -> h[l] or x[l+1]
    TP_LM_HEAD = 29      # rows of this rank's vocabulary; the tile's (max, argmax) into every rank's slot
    # Batch 16-64 (megakernel/instructions/split_k.py): a matvec stage split over K ranges
    MV_REDUCE = 30       # rows of a K-split stage: its ranges' partial sums added in range order, then its epilogue


# Counter stages, one counter per (layer, stage): a producer adds 1 per finished instruction,
# consumers wait for the stage's instruction count times the step's epoch.
class Stage(IntEnum):
    QKV = 0
    ATTN_PARTIAL = 1
    ATTN_REDUCE = 2
    O_PROJ = 3
    GATE_UP = 4
    DOWN = 5
    # the K-range partials of a split stage (split_k.py), which the stage's MV_REDUCE instructions wait for
    QKV_PARTS = 6
    O_PROJ_PARTS = 7
    DOWN_PARTS = 8


NUM_LAYER_STAGES = len(Stage)


def counter_id(layer: int, stage: Stage) -> int:
    """Counters 0 .. L*NUM_LAYER_STAGES-1 are per layer and stage; the last three are EMBED, LM_HEAD and ARGMAX."""
    return layer * NUM_LAYER_STAGES + int(stage)


def embed_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES


def lm_head_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 1


def argmax_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 2


def num_counters(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 3
