"""Functions the DeepSeek stages share: which buffer holds the query, the MoE index of a layer, RoPE on
half tables, SiLU-and-multiply of a gate/up-interleaved tile."""

from __future__ import annotations

import torch

from ..layout import ROW_GROUP


def moe_index(config, layer: int) -> int:
    """Index of an MoE layer among the MoE layers (their weights and buffers are stacked that way)."""
    if not config.is_moe_layer(layer):
        raise ValueError(f"layer {layer} is a dense layer (first_k_dense_replace={config.first_k_dense_replace})")
    return layer - config.first_k_dense_replace


def query_source(config) -> tuple[str, int]:
    """(buffer, row width) holding the full query [num_heads * (nope + rope)] of each sequence:
    `q` (q_b's output) with q LoRA, else the first q_size rows of `qkv_a`."""
    if config.q_lora_rank is not None:
        return "q", config.q_size
    return "qkv_a", config.qkv_a_rows


def query_rows(ctx, layer: int) -> torch.Tensor:
    """[B, q_size] float32 view of the query of every sequence (head-major, each head [nope | rope])."""
    c = ctx.layout.config
    if c.q_lora_rank is not None:
        return ctx.bufs.q[layer]
    return ctx.bufs.qkv_a[layer, :, :c.q_size]


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [..., r], cos/sin [r/2] (one position) -> [..., r]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_mul_interleaved(y: torch.Tensor) -> torch.Tensor:
    """y [B, rows] of a gate/up tile interleaved by ROW_GROUP (gate group, up group, ...) -> [B, rows/2]."""
    y = y.view(y.shape[0], -1, 2, ROW_GROUP)
    return (torch.nn.functional.silu(y[:, :, 0]) * y[:, :, 1]).reshape(y.shape[0], -1)
