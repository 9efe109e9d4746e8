"""DeepseekConfig: presets' real shapes, config.json parsing both ways, rejected values, decode floor."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megakernel.model.deepseek import (
    DeepseekConfig,
    YarnScaling,
    decode_bytes,
    expected_distinct_experts,
    floor_ms,
    get_preset,
    kimi_k2_slice,
    yarn_mscale,
)
from megakernel.model.deepseek.presets import PRESETS

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, DeepseekV3Config  # noqa: E402

# Kimi-K2-Instruct's config.json (fields that matter; auto_map etc. as published)
KIMI_K2_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def _hf_config(cfg: DeepseekConfig, tmp_path) -> "DeepseekV3Config":
    """transformers' own parse of our config.json (through AutoConfig, as from_pretrained does)."""
    with open(tmp_path / "config.json", "w") as fh:
        json.dump(cfg.to_hf_config(), fh)
    return AutoConfig.from_pretrained(tmp_path)


def test_moonlight_preset_shapes():
    c = get_preset("moonlight-16b-a3b")
    assert (c.num_layers, c.first_k_dense_replace, c.hidden_size) == (27, 1, 2048)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (64, 6, 2)
    assert (c.moe_intermediate_size, c.intermediate_size, c.num_heads) == (1408, 11264, 16)
    assert (c.q_lora_rank, c.kv_lora_rank) == (None, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.vocab_size) == (128, 64, 128, 163840)
    assert c.q_a_rows == 16 * 192 and c.qkv_a_rows == 16 * 192 + 576 and c.latent_dim == 576
    assert c.shared_intermediate_size == 2816
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 27))
    # Moonlight-16B-A3B: 15.96B parameters, ~3B read per token
    assert c.total_params == pytest.approx(15.96e9, rel=2e-3), c.total_params
    active = 2 * c.vocab_size * c.hidden_size + c.hidden_size + sum(c.active_layer_params(i) for i in range(27))
    assert active == pytest.approx(2.9e9, rel=0.05), active


def test_kimi_k2_slice_shapes():
    c = kimi_k2_slice(4)
    assert (c.num_layers, c.first_k_dense_replace, c.hidden_size, c.num_heads) == (4, 1, 7168, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (384, 8, 1)
    assert (c.moe_intermediate_size, c.intermediate_size) == (2048, 18432)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.scoring_func) == (1, 1, 2.827, "sigmoid")
    assert c.vocab_size == 163840 and c.num_moe_layers == 3 and c.num_dense_layers == 1
    assert get_preset("kimi-k2-slice", num_layers=3) == kimi_k2_slice(3)
    # the whole model (61 layers): ~1.03T parameters, ~32.9B activated per token
    full = kimi_k2_slice(61)
    assert full.total_params == pytest.approx(1.026e12, rel=2e-3), full.total_params
    with pytest.raises(ValueError, match="num_layers"):
        kimi_k2_slice(0)


def test_kimi_k2_config_json_parses_to_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2_JSON))
    cfg = DeepseekConfig.from_pretrained(tmp_path)
    assert cfg == kimi_k2_slice(61), cfg.summary()
    assert cfg.model_type == "kimi_k2"
    assert cfg.rope_scaling == YarnScaling(32.0, 4096, 1.0, 1.0, 1.0, 1.0)
    # K2 uses mscale == mscale_all_dim: cos/sin unscaled, softmax scale times (0.1 ln 32 + 1)^2
    assert cfg.rope_attention_factor == 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 1.0 * 3.4657359 + 1) ** 2, rel=1e-7)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_round_trip_through_transformers(name, tmp_path):
    cfg = get_preset(name)
    assert DeepseekConfig.from_hf_config(cfg.to_hf_config(), name=name) == cfg
    hf = _hf_config(cfg, tmp_path)
    assert isinstance(hf, DeepseekV3Config)
    back = DeepseekConfig.from_hf_config(hf, name=name)  # transformers' (4.x or 5.x) field names
    assert back == cfg, (name, back.summary())
    assert back.is_moe_layer(cfg.num_layers - 1) and not back.is_moe_layer(0)


def test_from_transformers_config_object_with_defaults():
    hf = DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=320, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=16, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=2, routed_scaling_factor=1.5, max_position_embeddings=1024,
    )
    c = DeepseekConfig.from_hf_config(hf)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.vocab_size, c.intermediate_size) == (128, 4, 4, 512, 320)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (48, 32, 16, 8, 24)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (16, 4, 2, 48)
    assert (c.n_group, c.topk_group, c.first_k_dense_replace, c.routed_scaling_factor) == (4, 2, 2, 1.5)
    assert c.norm_topk_prob is True and c.rope_interleave is True and c.rope_scaling is None
    assert [c.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert c.softmax_scale == pytest.approx(24 ** -0.5)


def test_rope_parameters_form_of_transformers_5():
    d = KIMI_K2_JSON | {"model_type": "deepseek_v3"}
    d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }
    assert DeepseekConfig.from_hf_config(d) == kimi_k2_slice(61)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    c = DeepseekConfig.from_hf_config(d)
    assert c.rope_scaling is None and c.rope_theta == 12345.0


@pytest.mark.parametrize("fields", [("routed_scaling_factor",), ("n_shared_experts",), ("first_k_dense_replace",),
                                    ("n_group", "topk_group"), ("q_lora_rank",)])
def test_a_field_left_out_gets_the_value_transformers_gives_it(fields, tmp_path):
    """config.json without the field(s): the parsed config holds what transformers' own parse of the same
    file holds (its DeepseekV3Config default), not a default of ours (a missing n_shared_experts is 1 there,
    not 0: reading 0 would ignore the shared-expert tensors with no warning). The base file's values differ
    from those defaults, so each case changes something."""
    base = {k: v for k, v in KIMI_K2_JSON.items() if k != "auto_map"} | {
        "model_type": "deepseek_v3", "q_lora_rank": 768, "n_shared_experts": 2, "n_group": 4, "topk_group": 2}
    d = {k: v for k, v in base.items() if k not in fields}
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = AutoConfig.from_pretrained(tmp_path)
    ours = DeepseekConfig.from_hf_config(d)
    for field in fields:
        assert getattr(ours, field) == getattr(hf, field), f"{field} left out: ours {getattr(ours, field)!r}"
        assert getattr(hf, field) != base[field], f"{field}: the default equals the base value"


def test_original_max_position_embeddings_is_read_as_transformers_reads_it(tmp_path):
    """Where config.json has one inside rope_scaling and another at the top level, the YaRN base is the one
    transformers' parse of the file ends up with."""
    d = {k: v for k, v in KIMI_K2_JSON.items() if k != "auto_map"} | {"model_type": "deepseek_v3",
                                                                      "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = AutoConfig.from_pretrained(tmp_path)
    ours = DeepseekConfig.from_hf_config(d)
    assert ours.rope_scaling.original_max_position_embeddings == hf.rope_parameters["original_max_position_embeddings"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("scoring_func", "softmax"),
        ("topk_method", "group_limited_greedy"),
        ("moe_layer_freq", 2),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("model_type", "deepseek_v2"),
        ("architectures", ["DeepseekV2ForCausalLM"]),
        ("quantization_config", {"quant_method": "fp8"}),
        ("num_key_value_heads", 8),
        ("n_routed_experts", None),
        ("n_group", 5),
        ("topk_group", 2),
        ("num_experts_per_tok", 400),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("kv_lora_rank", None),
        ("qk_rope_head_dim", 63),
    ],
)
def test_unsupported_values_name_the_field(field, value):
    d = dict(KIMI_K2_JSON)
    d[field] = value
    name = "rope_type" if field == "rope_scaling" else field
    with pytest.raises(ValueError, match=name):
        DeepseekConfig.from_hf_config(d)


def test_yarn_mscale_definition():
    assert yarn_mscale(1.0, 5.0) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * 3.6888794541 + 1.0)
    ys = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.9, mscale_all_dim=0.7)
    c = dataclasses.replace(get_preset("tiny-deepseek"), rope_scaling=ys)
    m_all = 0.1 * 0.7 * 3.6888794541 + 1.0
    assert c.softmax_scale == pytest.approx(48 ** -0.5 * m_all * m_all)  # qk_head_dim 32 + 16
    assert c.rope_attention_factor == pytest.approx((0.1 * 0.9 * 3.6888794541 + 1.0) / m_all)


# ---- decode floor -------------------------------------------------------------------------------

def test_decode_bytes_by_hand_tiny():
    """tiny-deepseek (H 256, 3 layers, 1 dense, 4 heads, no q LoRA, c 64, nope 32, rope 16, v 32,
    E 8 top-2, 1 shared expert of 64, dense FFN 384, V 1024) at batch 3, bf16."""
    c = get_preset("tiny-deepseek")
    got = decode_bytes(c, 3)
    # attention per layer: qkv_a (4*48 + 64 + 16) x 256 = 69632; kv_b 4*(32+32)*64 = 16384; o 256*128 = 32768
    assert got["attention"] == 3 * (69632 + 16384 + 32768) * 2 == 712704
    # norms: per layer attn + mlp (2*256) + kv_a (64), plus the final norm 256
    assert got["norms"] == (3 * 576 + 256) * 2 == 3968
    assert got["router"] == 2 * 8 * (256 + 1) * 2 == 8224
    assert got["shared_experts"] == 2 * 3 * 256 * 64 * 2 == 196608
    assert got["dense_mlp"] == 1 * 3 * 256 * 384 * 2 == 589824
    # distinct experts hit by 3 tokens of top-2 of 8: 8 * (1 - (6/8)^3) = 4.625
    assert expected_distinct_experts(8, 2, 3) == pytest.approx(4.625)
    assert got["routed_experts"] == pytest.approx(2 * 4.625 * 3 * 256 * 64 * 2) and got["routed_experts"] == 909312
    assert got["lm_head"] == 1024 * 256 * 2 and got["embedding"] == 3 * 256 * 2 and got["kv_cache"] == 0
    assert got["total"] == pytest.approx(2946464)
    assert floor_ms(got, 1e9) == pytest.approx(2.946464)
    assert floor_ms(2946464, 2e9) == pytest.approx(1.473232)
    # latent cache of 100 tokens per sequence: 3 seqs x 100 x 3 layers x 80 x 2 bytes
    assert decode_bytes(c, 3, kv_len=100)["kv_cache"] == 3 * 100 * 3 * 80 * 2


def test_decode_bytes_q_lora_and_limits():
    c = get_preset("tiny-deepseek-qlora")
    got = decode_bytes(c, 1, dtype_bytes=4)
    # qkv_a (96 + 80) x 256 + q_b 192 x 96 + kv_b 16384 + o 32768, fp32
    assert got["attention"] == 3 * (176 * 256 + 192 * 96 + 16384 + 32768) * 4
    assert got["norms"] == (3 * (512 + 64 + 96) + 256) * 4
    for cfg in (c, get_preset("moonlight-16b-a3b"), kimi_k2_slice(3)):
        H = cfg.hidden_size
        # batch 1 reads exactly the activated weights (top-k experts) plus one embedding row
        b1 = decode_bytes(cfg, 1)["total"]
        active = cfg.vocab_size * H + H + sum(cfg.active_layer_params(i) for i in range(cfg.num_layers))
        assert b1 == pytest.approx((active + H) * 2, rel=1e-12), cfg.name
        # a huge batch touches every expert: all weights except the unread embedding table
        big = 10**6
        assert decode_bytes(cfg, big)["total"] == pytest.approx(
            cfg.weight_bytes(2) - cfg.vocab_size * H * 2 + big * H * 2, rel=1e-9), cfg.name
    with pytest.raises(ValueError, match="batch"):
        decode_bytes(c, 0)
