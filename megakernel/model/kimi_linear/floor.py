"""Bandwidth floor of one Kimi Linear decode step: the bytes it must move, and the time at a bandwidth.

A decode step at batch b reads every weight of the KDA and MLA layers, the dense MLPs, the routers, the
shared experts and the LM head once, one embedding row per token, the routed experts its tokens picked
(expected distinct experts under uniform routing, as for DeepSeek), the MLA layers' latent cache of the
context, and the KDA layers' state: the recurrent state [heads, dk, dv] and the convolution's last
kernel - 1 inputs of each sequence, in float32, which the step reads and writes back (counted twice).
"""

from __future__ import annotations

from ..deepseek.floor import expected_distinct_experts, floor_ms
from .config import KimiLinearConfig

__all__ = ["decode_bytes", "expected_distinct_experts", "floor_ms", "kda_state_bytes"]

STATE_BYTES = 4        # the KDA recurrent and convolution states are float32


def kda_state_bytes(config: KimiLinearConfig, batch: int) -> int:
    """Bytes of KDA state one step reads (and as many it writes): per KDA layer and sequence, the recurrent
    state heads x dk x dv and the convolution's kernel - 1 inputs of q, k and v."""
    c = config
    per_seq = c.linear_num_heads * c.linear_head_dim * c.linear_head_dim + c.conv_dim * c.conv_state_len
    return batch * c.num_kda_layers * per_seq * STATE_BYTES


def decode_bytes(config: KimiLinearConfig, batch: int, dtype_bytes: int = 2, kv_len: int = 0) -> dict[str, float]:
    """Bytes one decode step of `batch` tokens moves, by part (weights at dtype_bytes; the router and the
    other tensors transformers keeps in float32 at 4 bytes).

    Keys: kda (the KDA layers' projections, convolution, gates, output norm and o_proj), mla (q, kv_a,
    kv_b = W_UK + W_UV, o_proj, the latent norms), norms (the layers' two RMSNorms and the final norm),
    router (weight + correction bias of every MoE layer), shared_experts, dense_mlp, routed_experts
    (expected distinct experts per MoE layer times one expert's gate/up/down), lm_head, embedding (one row
    per token), kv_cache (the MLA layers' latent rows of `kv_len` tokens per sequence), kda_state_read and
    kda_state_written, total.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if kv_len < 0:
        raise ValueError(f"kv_len={kv_len} must be >= 0")
    c = config
    H, db = c.hidden_size, dtype_bytes
    expert = 3 * H * c.moe_intermediate_size
    fp32_kda = c.kda_dim          # dt_bias, which the weights keep in float32 (weights.FP32_FIELDS)
    state = float(kda_state_bytes(c, batch))
    out = {
        "kda": float(c.num_kda_layers * ((c.kda_params - fp32_kda) * db + fp32_kda * 4)),
        "mla": float(c.num_mla_layers * c.mla_params * db),
        "norms": float((c.num_layers * 2 * H + H) * db),
        "router": float(c.num_moe_layers * c.n_routed_experts * (H + 1) * 4),
        "shared_experts": float(c.num_moe_layers * 3 * H * c.shared_intermediate_size * db),
        "dense_mlp": float((c.num_layers - c.num_moe_layers) * 3 * H * c.intermediate_size * db),
        "routed_experts": float(c.num_moe_layers * expected_distinct_experts(c.n_routed_experts,
                                                                             c.num_experts_per_tok, batch)
                                * expert * db),
        "lm_head": float(c.vocab_size * H * db),
        "embedding": float(batch * H * db),
        "kv_cache": float(batch * kv_len * c.num_mla_layers * c.latent_dim * db),
        "kda_state_read": state,
        "kda_state_written": state,
    }
    out["total"] = sum(out.values())
    return out
