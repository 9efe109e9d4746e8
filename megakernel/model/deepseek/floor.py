"""Bandwidth floor of one DeepSeek-V3 / Kimi-K2 decode step: the bytes it must read, and the time at a bandwidth.

A decode step at batch b reads every weight of attention, dense layers, routers, shared experts
and the LM head once, one embedding row per token, and only the routed experts its tokens picked.
Under uniform routing (each token picks k of E experts uniformly) the expected number of distinct
experts b tokens touch in one MoE layer is E * (1 - (1 - k/E) ** b).
"""

from __future__ import annotations

from typing import Mapping

from .config import DeepseekConfig


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - k/E) ** b): expected distinct experts hit by b tokens each picking k of E uniformly."""
    if batch < 0:
        raise ValueError(f"batch={batch} must be >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_bytes(config: DeepseekConfig, batch: int, dtype_bytes: int = 2, kv_len: int = 0) -> dict[str, float]:
    """Bytes one decode step of `batch` tokens reads, by part (every tensor at dtype_bytes).

    Keys: attention (qkv_a, q_b, kv_b = W_UK + W_UV, o_proj of every layer), norms (every RMSNorm weight
    incl. the latent norms and the final norm), router (router weight + correction bias of every MoE
    layer), shared_experts, dense_mlp (the first_k_dense_replace layers), routed_experts (expected
    distinct experts per MoE layer times one expert's gate/up/down), lm_head, embedding (one row per
    token), kv_cache (the latent cache of `kv_len` tokens per sequence; 0 by default), total.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    c = config
    H, L, db = c.hidden_size, c.num_layers, dtype_bytes
    attn = c.qkv_a_rows * H + c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + H * c.o_proj_cols
    norms = 2 * H + c.kv_lora_rank
    if c.q_lora_rank is not None:
        attn += c.q_size * c.q_lora_rank
        norms += c.q_lora_rank
    out = {
        "attention": float(L * attn * db),
        "norms": float((L * norms + H) * db),
        "router": float(c.num_moe_layers * c.router_params * db),
        "shared_experts": float(c.num_moe_layers * c.shared_expert_params * db),
        "dense_mlp": float(c.num_dense_layers * c.dense_mlp_params * db),
        "routed_experts": float(
            c.num_moe_layers
            * expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
            * c.expert_params
            * db
        ),
        "lm_head": float(c.vocab_size * H * db),
        "embedding": float(batch * H * db),
        "kv_cache": float(batch * kv_len * L * c.latent_dim * db),
    }
    out["total"] = sum(out.values())
    return out


def floor_ms(nbytes: float | Mapping[str, float], bandwidth_bytes_per_s: float) -> float:
    """Milliseconds to read `nbytes` (a number, or a decode_bytes dict: its total) at the given bandwidth."""
    if isinstance(nbytes, Mapping):
        nbytes = nbytes["total"]
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s} must be > 0")
    return float(nbytes) / bandwidth_bytes_per_s * 1e3
