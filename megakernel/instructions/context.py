"""What a stage's torch reference sees: the step layout, the packed weights, the buffers and the KV
cache. The VM and the single-stage GPU tests build one of these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import PackedWeights, StepBuffers, StepLayout


@dataclass
class StageContext:
    layout: StepLayout
    weights: PackedWeights
    bufs: StepBuffers
    k_cache: torch.Tensor   # [L, num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


def f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, K] float32 -> x * rsqrt(mean(x^2) + eps) * weight, in float32 as the kernel computes it."""
    x = f32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * f32(weight)


def matvec(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """rows of w [R, K] (bf16) times x [B, K] float32 -> [B, R] float32."""
    return x @ f32(w).T
