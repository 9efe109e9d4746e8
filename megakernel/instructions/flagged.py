"""Flagged hops: at batch 1 on one GPU the hops into a matvec's input carry their own readiness (NCCL's LL protocol).

x, h and act are float32 {value, step epoch} pairs, each stored as one 8-byte word (single-copy atomic), and the
consuming stage polls the words it stages until each carries this step's epoch, instead of a counter wait behind the
producer's release fence (megakernel.kernel.staging.stage_round_polled). The step buffers keep x, h and act as views
of the value halves (layout.allocate_buffers), so every reader indexes them as at any other batch; epoch_words gives
the other halves. Measured (profiles/RESULTS.md, 2026-12-06): 9% of qwen3-0.6b's step, level on the larger shapes,
slower from batch 2, where the polled inputs are B times as many words.
"""

from __future__ import annotations

import torch

FLAGGED_BUFFERS = ("x", "h", "act")


def flagged_hops(layout) -> bool:
    """Whether a step of `layout` hands x, h and act on as flagged data (FLAGGED_BUFFERS): batch 1, one GPU."""
    return layout.batch == 1 and getattr(layout, "world_size", 1) == 1


def epoch_words(values: torch.Tensor) -> torch.Tensor:
    """int32 view of the epoch halves beside a flagged buffer's values (a StepBuffers x, h or act where
    flagged_hops: the value halves of float32 [..., 2] pairs)."""
    if values.dim() == 0 or values.stride(-1) != 2:
        raise ValueError("epoch_words takes the value view of a flagged buffer (its last stride 2)")
    return values.as_strided(values.shape, values.stride(), values.storage_offset() + 1).view(torch.int32)
