"""Named Kimi Linear shapes: the published Kimi-Linear-48B-A3B, a few-layer slice of it, and tiny
debug ones for CPU tests (weights are seeded, see weights.random_weights)."""

from __future__ import annotations

from dataclasses import replace

from .config import DENSE, KDA, MLA, SPARSE, KimiLinearConfig

# Kimi-Linear-48B-A3B(-Instruct): the shapes are transformers' KimiLinearConfig defaults (its docs name
# moonshotai/Kimi-Linear-48B-A3B-Instruct as the reference checkpoint). The layer lists are the published
# config.json's linear_attn_config: full_attn_layers [4, 8, 12, 16, 20, 24, 27], kda_layers the other 20
# (1-based), a 3:1 KDA:MLA pattern ending in MLA (transformers' own default pattern, MLA at 0-based 4, 8, ...,
# 24, differs). The hub file is not reachable from here; four public repositories that quote it agree on these
# lists and on the token ids below, and tests/unit/test_kimi_linear_config.py parses that file's fields into
# this preset.
_KIMI_48B_FULL_1BASED = (4, 8, 12, 16, 20, 24, 27)
_KIMI_48B_LAYERS = 27
KIMI_LINEAR_48B_A3B = KimiLinearConfig(
    name="kimi-linear-48b-a3b",
    hidden_size=2304,
    num_layers=_KIMI_48B_LAYERS,
    vocab_size=163840,
    intermediate_size=9216,
    layer_types=tuple(MLA if i + 1 in _KIMI_48B_FULL_1BASED else KDA for i in range(_KIMI_48B_LAYERS)),
    mlp_layer_types=tuple(DENSE if i < 1 else SPARSE for i in range(_KIMI_48B_LAYERS)),  # first_k_dense_replace 1
    num_heads=32,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    linear_num_heads=32,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=1024,
    routed_scaling_factor=2.446,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=1048576,
    pad_token_id=163839,
    bos_token_id=163584,
    eos_token_id=163586,
)


def kimi_linear_slice(num_layers: int = 4) -> KimiLinearConfig:
    """Kimi-Linear-48B-A3B's first `num_layers` layers (real per-layer shapes): 4 gives KDA, KDA, KDA, MLA
    with layer 0 dense and the rest MoE, the model's 3:1 pattern."""
    if not 1 <= num_layers <= KIMI_LINEAR_48B_A3B.num_layers:
        raise ValueError(f"num_layers={num_layers} outside [1, {KIMI_LINEAR_48B_A3B.num_layers}]")
    c = KIMI_LINEAR_48B_A3B
    return replace(c, num_layers=num_layers, layer_types=c.layer_types[:num_layers],
                   mlp_layer_types=c.mlp_layer_types[:num_layers], name=f"kimi-linear-slice-{num_layers}")


# Tiny debug shapes: every code path of the real one (3:1 KDA:MLA, a dense layer first, shared + routed).
TINY_KIMI_LINEAR = KimiLinearConfig(
    name="tiny-kimi-linear",
    hidden_size=128,
    num_layers=4,
    vocab_size=512,
    intermediate_size=192,
    layer_types=(KDA, KDA, KDA, MLA),
    mlp_layer_types=(DENSE, SPARSE, SPARSE, SPARSE),
    num_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.446,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# q LoRA, two MLA layers (one in the middle, one last), kernel 3, 2 dense layers, 2 shared experts,
# group-limited routing (4 groups of 2, 2 kept), no renormalisation, a large rms_norm_eps (the latent
# norms must keep 1e-6).
TINY_KIMI_LINEAR_QLORA = KimiLinearConfig(
    name="tiny-kimi-linear-qlora",
    hidden_size=96,
    num_layers=5,
    vocab_size=384,
    intermediate_size=160,
    layer_types=(KDA, MLA, KDA, KDA, MLA),
    mlp_layer_types=(DENSE, DENSE, SPARSE, SPARSE, SPARSE),
    num_heads=3,
    q_lora_rank=48,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    linear_num_heads=2,
    linear_head_dim=32,
    linear_conv_kernel_dim=3,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    moe_intermediate_size=24,
    routed_scaling_factor=1.5,
    n_group=4,
    topk_group=2,
    norm_topk_prob=False,
    rms_norm_eps=0.05,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=(2, 3),
)

PRESETS: dict[str, KimiLinearConfig] = {
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B,
    "kimi-linear-slice": kimi_linear_slice(4),
    "tiny-kimi-linear": TINY_KIMI_LINEAR,
    "tiny-kimi-linear-qlora": TINY_KIMI_LINEAR_QLORA,
}


def get_preset(name: str, num_layers: int | None = None) -> KimiLinearConfig:
    """A preset by name; `num_layers` re-slices "kimi-linear-slice" (and truncates any other preset)."""
    if name not in PRESETS:
        raise ValueError(f"unknown Kimi Linear preset {name!r}; known: {sorted(PRESETS)}")
    if num_layers is None:
        return PRESETS[name]
    if name == "kimi-linear-slice":
        return kimi_linear_slice(num_layers)
    cfg = PRESETS[name]
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} outside [1, {cfg.num_layers}] for preset {name!r}")
    return replace(cfg, num_layers=num_layers, layer_types=cfg.layer_types[:num_layers],
                   mlp_layer_types=cfg.mlp_layer_types[:num_layers])
