"""Flagged hops: at batch 1 on one GPU the hops into a matvec's input and the attention's carry their own readiness
(NCCL's LL protocol).

x, h, act and qkv are float32 {value, step epoch} pairs, each stored as one 8-byte word (single-copy atomic), and the
consuming stage polls the words it reads until each carries this step's epoch, instead of a counter wait behind the
producer's release fence (megakernel.kernel.staging: stage_round_polled for a matvec's input, poll_words for the
attention's q, k and v). The step buffers keep them as views of the value halves (layout.allocate_buffers), so every
reader indexes them as at any other batch; epoch_words gives the other halves. Measured (profiles/RESULTS.md,
2026-12-06): x, h and act 9% of qwen3-0.6b's step on an H100, level on the larger shapes, slower from batch 2, where
the polled inputs are B times as many words; qkv 2.5% of llama-3.2-1b's step on the H200 (2.2% at 8192 tokens).
The attention's output hop keeps its counter: O_PROJ merging the splits' partials by polling them lost (its polls of
every partial word, long before the splits write them, slow the attention).
"""

from __future__ import annotations

import torch

from .opcodes import Opcode

FLAGGED_BUFFERS = ("x", "h", "act", "qkv")
# the stages that poll their flagged input instead of waiting on their counter (but layer 0's QKV of a folded
# embedding, record a3 == 1, which reads embed[token]), and those whose output is polled and so signal nothing
POLLING = (Opcode.DOWN, Opcode.GATE_UP, Opcode.LM_HEAD, Opcode.QKV, Opcode.ATTN_PARTIAL)
UNSIGNALLED = (Opcode.GATE_UP, Opcode.DOWN, Opcode.O_PROJ, Opcode.QKV)


def flagged_hops(layout) -> bool:
    """Whether a step of `layout` hands x, h, act and qkv on as flagged data (FLAGGED_BUFFERS): batch 1, one GPU."""
    return layout.batch == 1 and getattr(layout, "world_size", 1) == 1


def epoch_words(values: torch.Tensor) -> torch.Tensor:
    """int32 view of the epoch halves beside a flagged buffer's values (a StepBuffers x, h, act or qkv where
    flagged_hops: the value halves of float32 [..., 2] pairs)."""
    if values.dim() == 0 or values.stride(-1) != 2:
        raise ValueError("epoch_words takes the value view of a flagged buffer (its last stride 2)")
    return values.as_strided(values.shape, values.stride(), values.storage_offset() + 1).view(torch.int32)
