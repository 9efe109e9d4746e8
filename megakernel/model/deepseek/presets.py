"""Named DeepSeek-V3-architecture shapes: real models (weights are seeded, see weights.random_weights)
and tiny debug ones."""

from __future__ import annotations

from dataclasses import replace

from .config import DeepseekConfig, YarnScaling

# Moonshot's Moonlight-16B-A3B (model_type deepseek_v3): no q LoRA, 64 experts, top-6, 2 shared.
MOONLIGHT_16B_A3B = DeepseekConfig(
    name="moonlight-16b-a3b",
    hidden_size=2048,
    num_layers=27,
    num_heads=16,
    vocab_size=163840,
    intermediate_size=11264,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    rope_theta=50000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    bos_token_id=163584,
    eos_token_id=163585,
)

# Kimi-K2 (model_type kimi_k2): 61 layers, 384 experts, top-8, 1 shared, q LoRA 1536, YaRN to 128k.
_KIMI_K2 = DeepseekConfig(
    name="kimi-k2",
    hidden_size=7168,
    num_layers=61,
    num_heads=64,
    vocab_size=163840,
    intermediate_size=18432,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    rope_theta=50000.0,
    rope_scaling=YarnScaling(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    bos_token_id=163584,
    eos_token_id=163585,
    model_type="kimi_k2",
)


def kimi_k2_slice(num_layers: int = 2) -> DeepseekConfig:
    """Kimi-K2 with its first `num_layers` layers (layer 0 dense, the rest MoE): real per-layer shapes."""
    if num_layers < 1 or num_layers > _KIMI_K2.num_layers:
        raise ValueError(f"num_layers={num_layers} outside [1, {_KIMI_K2.num_layers}]")
    return replace(_KIMI_K2, num_layers=num_layers, name=f"kimi-k2-slice-{num_layers}")


# Tiny debug shapes: fast on CPU, every code path of the real ones (dense layer first, shared + routed).
TINY_DEEPSEEK = DeepseekConfig(
    name="tiny-deepseek",
    hidden_size=256,
    num_layers=3,
    num_heads=4,
    vocab_size=1024,
    intermediate_size=384,
    q_lora_rank=None,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
)

# q LoRA, group-limited routing (4 groups of 2, 2 groups kept) and YaRN as DeepSeek-V3 configures it.
TINY_DEEPSEEK_QLORA = DeepseekConfig(
    name="tiny-deepseek-qlora",
    hidden_size=256,
    num_layers=3,
    num_heads=4,
    vocab_size=1024,
    intermediate_size=384,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    rope_theta=10000.0,
    rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)

PRESETS: dict[str, DeepseekConfig] = {
    "moonlight-16b-a3b": MOONLIGHT_16B_A3B,
    "kimi-k2-slice": kimi_k2_slice(2),
    "tiny-deepseek": TINY_DEEPSEEK,
    "tiny-deepseek-qlora": TINY_DEEPSEEK_QLORA,
}


def get_preset(name: str, num_layers: int | None = None) -> DeepseekConfig:
    """A preset by name; `num_layers` re-slices "kimi-k2-slice" (and truncates any other preset)."""
    if name not in PRESETS:
        raise ValueError(f"unknown DeepSeek preset {name!r}; known: {sorted(PRESETS)}")
    if num_layers is None:
        return PRESETS[name]
    if name == "kimi-k2-slice":
        return kimi_k2_slice(num_layers)
    cfg = PRESETS[name]
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} outside [1, {cfg.num_layers}] for preset {name!r}")
    return replace(cfg, num_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))
