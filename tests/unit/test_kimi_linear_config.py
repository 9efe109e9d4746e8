"""KimiLinearConfig: config.json read exactly as transformers' KimiLinearConfig reads it (every field, its
defaults and aliases), presets' shapes and parameter counts against transformers' model, rejected configs."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from megakernel.model.kimi_linear import KimiLinearConfig, get_preset, kimi_linear_slice
from megakernel.model.kimi_linear.config import KDA, MLA
from megakernel.model.kimi_linear.presets import PRESETS

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, KimiLinearForCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

_FULL_1BASED = [4, 8, 12, 16, 20, 24, 27]
# Kimi-Linear-48B-A3B-Instruct's config.json as the hub writes it (the checkpoint's own field names, every field
# of the published file: the hub is not reachable from here, and four public repositories that quote the file
# agree on these values, the layer lists and token ids included)
KIMI_LINEAR_48B_JSON = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "model_max_length": 1048576,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "linear_attn_config": {
        "full_attn_layers": _FULL_1BASED,
        "kda_layers": [i for i in range(1, 28) if i not in _FULL_1BASED],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "torch_dtype": "bfloat16",
    "head_dim": 72,
    "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "use_cache": True,
}

_TINY = get_preset("tiny-kimi-linear").to_hf_config()

CASES = {
    "kimi-linear-48b-json": KIMI_LINEAR_48B_JSON,
    # transformers' defaults for everything but the MoE counts the project requires
    "defaults": {"model_type": "kimi_linear", "num_experts": 256, "num_experts_per_token": 8},
    "tiny-kimi-linear": _TINY,
    "tiny-kimi-linear-qlora": get_preset("tiny-kimi-linear-qlora").to_hf_config(),
    # the transformers field names (aliases of the stored ones), top-level linear sizes, no linear_attn_config:
    # transformers' default layer pattern; first_k_dense_replace 2
    "aliases": {
        **{k: v for k, v in _TINY.items() if k not in ("num_experts", "num_experts_per_token", "num_shared_experts",
                                                         "moe_renormalize", "num_expert_group", "model_max_length",
                                                         "linear_attn_config", "mlp_layer_types")},
        "num_hidden_layers": 9, "num_local_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 2,
        "norm_topk_prob": False, "n_group": 2, "topk_group": 1, "max_position_embeddings": 777,
        "linear_head_dim": 32, "linear_num_heads": 3, "linear_conv_kernel_dim": 2, "first_k_dense_replace": 2,
    },
    # both spellings in one dict: the stored name wins; linear_attn_config overrides the top-level sizes
    "both-spellings": {**_TINY, "num_local_experts": 4, "num_experts": 8, "num_experts_per_tok": 1,
                       "n_group": 4, "num_expert_group": 2, "linear_head_dim": 64},
    # explicit layer_types (with legacy names) win over linear_attn_config's lists; explicit mlp_layer_types
    "layer-types": {**_TINY, "layer_types": ["mamba", "attention", "linear_attention", "full_attention"],
                    "mlp_layer_types": ["sparse", "dense", "sparse", "dense"], "eos_token_id": [2, 5]},
}


def _hf(d: dict, tmp_path, name: str):
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    return AutoConfig.from_pretrained(path)


def _fields_vs_hf(cfg: KimiLinearConfig, hf) -> dict:
    eos = hf.eos_token_id
    return {
        "hidden_size": (cfg.hidden_size, hf.hidden_size),
        "num_layers": (cfg.num_layers, hf.num_hidden_layers),
        "vocab_size": (cfg.vocab_size, hf.vocab_size),
        "intermediate_size": (cfg.intermediate_size, hf.intermediate_size),
        "layer_types": (cfg.layer_types, tuple(hf.layer_types)),
        "mlp_layer_types": (cfg.mlp_layer_types, tuple(hf.mlp_layer_types)),
        "num_heads": (cfg.num_heads, hf.num_attention_heads),
        "num_key_value_heads": (cfg.num_heads, hf.num_key_value_heads),
        "q_lora_rank": (cfg.q_lora_rank, hf.q_lora_rank),
        "kv_lora_rank": (cfg.kv_lora_rank, hf.kv_lora_rank),
        "qk_nope_head_dim": (cfg.qk_nope_head_dim, hf.qk_nope_head_dim),
        "qk_rope_head_dim": (cfg.qk_rope_head_dim, hf.qk_rope_head_dim),
        "qk_head_dim": (cfg.qk_head_dim, hf.qk_head_dim),
        "v_head_dim": (cfg.v_head_dim, hf.v_head_dim),
        "linear_num_heads": (cfg.linear_num_heads, hf.linear_num_heads),
        "linear_head_dim": (cfg.linear_head_dim, hf.linear_head_dim),
        "linear_conv_kernel_dim": (cfg.linear_conv_kernel_dim, hf.linear_conv_kernel_dim),
        "n_routed_experts": (cfg.n_routed_experts, hf.num_local_experts),
        "num_experts_per_tok": (cfg.num_experts_per_tok, hf.num_experts_per_tok),
        "n_shared_experts": (cfg.n_shared_experts, hf.n_shared_experts),
        "moe_intermediate_size": (cfg.moe_intermediate_size, hf.moe_intermediate_size),
        "routed_scaling_factor": (cfg.routed_scaling_factor, hf.routed_scaling_factor),
        "n_group": (cfg.n_group, hf.n_group),
        "topk_group": (cfg.topk_group, hf.topk_group),
        "norm_topk_prob": (cfg.norm_topk_prob, hf.norm_topk_prob),
        "rms_norm_eps": (cfg.rms_norm_eps, hf.rms_norm_eps),
        "max_position_embeddings": (cfg.max_position_embeddings, hf.max_position_embeddings),
        "pad_token_id": (cfg.pad_token_id, hf.pad_token_id),
        "bos_token_id": (cfg.bos_token_id, hf.bos_token_id),
        "eos_token_id": (cfg.eos_token_id, tuple(eos) if isinstance(eos, list) else eos),
        "hidden_act": ("silu", hf.hidden_act),
        "tie_word_embeddings": (False, hf.tie_word_embeddings),
        "attention_bias": (False, hf.attention_bias),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_field_matches_transformers(case, tmp_path):
    d = copy.deepcopy(CASES[case])
    cfg = KimiLinearConfig.from_hf_config(d, name=case)
    hf = _hf(d, tmp_path, case)
    diffs = {k: v for k, v in _fields_vs_hf(cfg, hf).items() if v[0] != v[1]}
    assert not diffs, f"config {case}: fields differ from transformers' KimiLinearConfig (ours, theirs): {diffs}"
    # from a transformers config object too, and through the config.json we write
    assert KimiLinearConfig.from_hf_config(hf, name=case) == cfg, f"config {case}: from the transformers object"
    assert KimiLinearConfig.from_hf_config(cfg.to_hf_config()) == cfg, f"config {case}: to_hf_config round trip"
    (tmp_path / case / "config.json").write_text(json.dumps(d))
    assert KimiLinearConfig.from_pretrained(tmp_path / case) == cfg, f"config {case}: from_pretrained"


def test_defaults_are_transformers_defaults(tmp_path):
    cfg = KimiLinearConfig.from_hf_config(CASES["defaults"])
    # transformers' default pattern: MLA at 0-based layers 4, 8, ..., 24, KDA elsewhere (layer 0 too)
    assert cfg.mla_layers == (4, 8, 12, 16, 20, 24), f"defaults: mla layers {cfg.mla_layers}"
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    got = (cfg.hidden_size, cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim)
    assert got == (2304, 128, 32, 4), f"defaults: {got}"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_read_back_and_count_params_like_transformers(name, tmp_path):
    cfg = PRESETS[name]
    hf = _hf(cfg.to_hf_config(), tmp_path, name)
    diffs = {k: v for k, v in _fields_vs_hf(cfg, hf).items() if v[0] != v[1]}
    assert not diffs, f"preset {name}: {diffs}"
    if cfg.num_layers > 8:  # the full model: count it from its 4-layer slice pattern instead (meta is slow)
        return
    with torch.device("meta"):
        model = KimiLinearForCausalLM(hf)
    n_hf = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.total_params == n_hf, f"preset {name}: total_params {cfg.total_params} != transformers {n_hf}"


def test_48b_preset_is_the_published_config():
    """The kimi-linear-48b-a3b preset is exactly what the published config.json parses to (layer lists, MoE,
    token ids: every field but the name)."""
    parsed = KimiLinearConfig.from_hf_config(copy.deepcopy(KIMI_LINEAR_48B_JSON), name="kimi-linear-48b-a3b")
    preset = get_preset("kimi-linear-48b-a3b")
    diffs = {f.name: (getattr(preset, f.name), getattr(parsed, f.name)) for f in dataclasses.fields(preset)
             if getattr(preset, f.name) != getattr(parsed, f.name)}
    assert not diffs, f"kimi-linear-48b-a3b: preset vs published config.json (preset, parsed): {diffs}"


def test_48b_preset_shapes_and_slice():
    full = get_preset("kimi-linear-48b-a3b")
    hf_default = transformers.KimiLinearConfig()
    for ours, theirs in [(full.hidden_size, hf_default.hidden_size),
                         (full.n_routed_experts, hf_default.num_local_experts),
                         (full.num_experts_per_tok, hf_default.num_experts_per_tok),
                         (full.moe_intermediate_size, hf_default.moe_intermediate_size),
                         (full.linear_head_dim, hf_default.linear_head_dim), (full.vocab_size, hf_default.vocab_size),
                         (full.routed_scaling_factor, hf_default.routed_scaling_factor)]:
        assert ours == theirs, "kimi-linear-48b-a3b: a shape differs from transformers' defaults"
    assert (full.num_kda_layers, full.num_mla_layers) == (20, 7)
    assert 47e9 < full.total_params < 50e9, f"kimi-linear-48b-a3b: {full.total_params / 1e9:.1f}B params"
    s = kimi_linear_slice(4)
    assert s.layer_types == (KDA, KDA, KDA, MLA) and s.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert kimi_linear_slice(8).layer_types == (KDA, KDA, KDA, MLA) * 2
    assert dataclasses.replace(s, name="x") == s  # name does not take part in equality
    with pytest.raises(ValueError, match="num_layers"):
        kimi_linear_slice(28)
    with pytest.raises(ValueError, match="unknown Kimi Linear preset"):
        get_preset("kimi-linear-96b")


def _bad(**changes) -> dict:
    d = copy.deepcopy(_TINY)
    for k, v in changes.items():
        if k.startswith("lac_"):
            d["linear_attn_config"][k[4:]] = v
        elif v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()
BAD = {
    "model_type": (_bad(model_type="kimi_k2"), "model_type"),
    "architectures": (_bad(architectures=["DeepseekV3ForCausalLM"]), "architectures"),
    "layer-out-of-range": (_bad(lac_full_attn_layers=[5], lac_kda_layers=[1, 2, 3]), "full_attn_layers contains 5"),
    "layer-zero-based": (_bad(lac_full_attn_layers=[3], lac_kda_layers=[0, 1, 2]), "kda_layers contains 0"),
    "layer-in-both": (_bad(lac_full_attn_layers=[3, 4], lac_kda_layers=[1, 2, 3]), "in both"),
    "layer-in-neither": (_bad(lac_full_attn_layers=[4], lac_kda_layers=[1, 2]), "layer 3 is in neither"),
    "lone-layer-list": (
        {**_bad(), "linear_attn_config": {"kda_layers": [1, 2, 3], "head_dim": 16, "num_heads": 4,
                                          "short_conv_kernel_size": 4}}, "full_attn_layers is missing"),
    "layer-types-length": (_bad(layer_types=["linear_attention"] * 3), "layer_types has 3 entries"),
    "layer-types-unknown": (_bad(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types contains"),
    "mlp-layer-types-unknown": (_bad(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types contains"),
    "mlp-layer-types-length": (_bad(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types has 2"),
    "kda-head-dim": (_bad(lac_head_dim=24), "linear_head_dim=24"),
    "conv-kernel": (_bad(lac_short_conv_kernel_size=1), "linear_conv_kernel_dim=1"),
    "mla-rope": (_bad(mla_use_nope=False), "mla_use_nope"),
    "rope-scaling": (_bad(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    "missing-experts": (_bad(num_experts=_DROP), "num_experts"),
    "missing-top-k": (_bad(num_experts_per_token=_DROP), "num_experts_per_token"),
    "n-routed-experts-name": (_bad(n_routed_experts=16), "n_routed_experts=16"),
    "kv-heads": (_bad(num_key_value_heads=2), "num_key_value_heads"),
    "hidden-act": (_bad(hidden_act="gelu"), "hidden_act"),
    "top-k-too-large": (_bad(num_experts_per_token=9), "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    "n-group": (_bad(num_expert_group=3), "n_group=3"),
    "topk-group": (_bad(num_expert_group=2, topk_group=3), "topk_group=3"),
    "tie": (_bad(tie_word_embeddings=True), "tie_word_embeddings"),
    "attention-bias": (_bad(attention_bias=True), "attention_bias"),
    "router": (_bad(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    "moe-layer-freq": (_bad(moe_layer_freq=2), "moe_layer_freq"),
    "quantized": (_bad(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    "hidden-size": (_bad(hidden_size=0), "hidden_size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_configs_raise_naming_the_field(case):
    d, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        KimiLinearConfig.from_hf_config(d, name=case)
