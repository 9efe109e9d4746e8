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


# Counter stages, one counter per (layer, stage): a producer adds 1 per finished instruction,
# consumers wait for the stage's instruction count times the step's epoch.
class Stage(IntEnum):
    QKV = 0
    ATTN_PARTIAL = 1
    ATTN_REDUCE = 2
    O_PROJ = 3
    GATE_UP = 4
    DOWN = 5


NUM_LAYER_STAGES = len(Stage)


def counter_id(layer: int, stage: Stage) -> int:
    """Counters 0 .. L*6-1 are per layer and stage; the last three are EMBED, LM_HEAD and ARGMAX."""
    return layer * NUM_LAYER_STAGES + int(stage)


def embed_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES


def lm_head_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 1


def argmax_counter(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 2


def num_counters(num_layers: int) -> int:
    return num_layers * NUM_LAYER_STAGES + 3
