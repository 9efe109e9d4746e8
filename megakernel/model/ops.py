"""Pure torch reference ops for one decode step.

Each op upcasts its inputs to float32 (float64 inputs stay float64, for a tighter reference) and
returns that dtype. Conventions follow transformers' Llama / Qwen3 modelling code so the reference
decoder can be checked against it: RoPE uses the duplicated-half layout (``rotate_half``).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalised by its root mean square over the last dim, times weight [H]."""
    xf = _up(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms) * weight.to(xf.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, float32 [head_dim // 2], with the config's rope_scaling applied."""
    d = config.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling.factor, scaling.low_freq_factor,
                             scaling.high_freq_factor, scaling.original_max_position_embeddings)
    raise ValueError(f"rope_scaling.rope_type={scaling.rope_type!r} is not supported")


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                  high_freq_factor: float, original_context: int) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths longer than original_context / low_freq_factor are stretched
    by `factor`; shorter than original_context / high_freq_factor are kept; the band between is a
    linear blend of the two in original_context / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_context / low_freq_factor
    short_wave = wavelen < original_context / high_freq_factor
    # Blend weight: 0 at the long end of the band, 1 at the short end.
    blend = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    stretched = torch.where(long_wave, inv_freq / factor, inv_freq)
    blended = (1 - blend) * stretched / factor + blend * stretched
    return torch.where(long_wave | short_wave, stretched, blended)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions Long [B] -> cos, sin each float32 [B, head_dim], both halves equal (HF layout)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n_heads, D] rotated by cos/sin [B, D] (one position per row)."""
    xf = _up(x)
    cos = cos.to(xf.dtype)[:, None, :]
    sin = sin.to(xf.dtype)[:, None, :]
    return xf * cos + _rotate_half(xf) * sin


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise."""
    g = _up(gate)
    return torch.nn.functional.silu(g) * _up(up).to(g.dtype)


def gather_kv(cache_layer: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from a paged cache layer.
    cache_layer [num_blocks, block_size, Hkv, D]; block_row int [max_blocks] -> [seq_len, Hkv, D]."""
    block_size = cache_layer.shape[1]
    n_blocks = -(-seq_len // block_size)
    blocks = block_row[:n_blocks].long()
    return cache_layer.index_select(0, blocks).reshape(-1, *cache_layer.shape[2:])[:seq_len]


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int [B], valid tokens including the current one
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending over its first seq_lens[b] cached tokens.
    Returns [B, Hq, D] float32. Only the valid tokens are read, so unused slots may hold NaN."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num query heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    qf = _up(q)
    out = torch.empty(batch, num_heads, head_dim, dtype=qf.dtype, device=q.device)
    lens = [int(n) for n in seq_lens.tolist()]
    for b, n in enumerate(lens):
        if n <= 0:
            raise ValueError(f"seq_lens[{b}]={n} must be >= 1")
        k = gather_kv(k_cache, block_table[b], n).to(qf.dtype)  # [n, Hkv, D]
        v = gather_kv(v_cache, block_table[b], n).to(qf.dtype)
        qb = qf[b].view(num_kv_heads, group, head_dim)  # query head h -> kv head h // group
        scores = torch.einsum("kgd,nkd->kgn", qb, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", probs, v).reshape(num_heads, head_dim)
    return out
