"""Tensor-parallel stages of the dense models (several GPUs, one megakernel per GPU per step): one module per
stage, each with its record operands, reads(), writes() and torch reference(), as the dense stages; the
exchange stages also have peer_writes(): the regions they store on every rank, their own included.

Every rank runs the dense stages over its shard (instructions.tensor_parallel.layout.ShardLayout: its query
and kv heads, its slice of the FFN and of the vocabulary); these stages join the shards. Rank r, layer l
(buffers in brackets; recv_*[l][s] is slot s of rank r's receive buffer, which rank s stores into):

    QKV, ATTN_PARTIAL (, ATTN_REDUCE)   as on one GPU, over the rank's heads
    TP_O_PROJ    [attn_out | attn_part] -> recv_o[l][r] of every rank          signal: every rank
    TP_REDUCE    [x, recv_o[l][0..W-1]] -> [h]                  (a3 = ATTENTION)
    GATE_UP      as on one GPU, over the rank's FFN slice
    TP_DOWN      [act] -> recv_down[l][r] of every rank                        signal: every rank
    TP_REDUCE    [h, recv_down[l][0..W-1]] -> [x(l+1)]          (a3 = FFN)
  after the last layer:
    TP_LM_HEAD   [x(L)] -> [logits of the rank's vocabulary], (max, argmax) -> lm slot of every rank
    ARGMAX       over every rank's slots -> next token, tokens, positions (the dense stage, unchanged)

EXCHANGE_OPCODES are the stages whose signal lands on the same counter of every rank, not the rank's own
only: a consumer on any rank waits for world_size times the stage's instruction count.
"""

from __future__ import annotations

from . import lm_head_send, partial_send, reduce
from ..opcodes import Opcode

TP_STAGE_MODULES = {
    Opcode.TP_O_PROJ: partial_send,
    Opcode.TP_DOWN: partial_send,
    Opcode.TP_REDUCE: reduce,
    Opcode.TP_LM_HEAD: lm_head_send,
}

EXCHANGE_OPCODES = frozenset({Opcode.TP_O_PROJ, Opcode.TP_DOWN, Opcode.TP_LM_HEAD})

__all__ = ["TP_STAGE_MODULES", "EXCHANGE_OPCODES"]
