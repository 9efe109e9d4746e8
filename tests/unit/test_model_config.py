"""ModelConfig: presets hold the real checkpoints' shapes, HF config.json round-trips through
transformers' own config classes, and every unsupported feature is refused by name."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, Qwen3Config

from megakernel.model import PRESETS, ModelConfig, RopeScaling, get_preset

PRESET_NAMES = sorted(PRESETS)
HF_CONFIG_CLASS = {"LlamaForCausalLM": LlamaConfig, "Qwen3ForCausalLM": Qwen3Config}

# (name, hidden, layers, heads, kv heads, head_dim, ffn, vocab, tied, theta, eps, qk_norm, rope)
REAL_SHAPES = [
    ("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5, False,
     RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    ("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, True, None),
    ("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 1e-5, False,
     RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    ("llama-2-7b", 4096, 32, 32, 32, 128, 11008, 32000, False, 10000.0, 1e-5, False, None),
]


@pytest.mark.parametrize("row", REAL_SHAPES, ids=[r[0] for r in REAL_SHAPES])
def test_real_presets_have_checkpoint_shapes(row):
    name, h, n_layers, hq, hkv, d, f, v, tied, theta, eps, qk_norm, rope = row
    c = get_preset(name)
    got = (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
           c.vocab_size, c.tie_word_embeddings, c.rope_theta, c.rms_norm_eps, c.qk_norm, c.rope_scaling)
    assert got == (h, n_layers, hq, hkv, d, f, v, tied, theta, eps, qk_norm, rope), f"preset {name}"
    assert c.name == name


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_derived_sizes(name):
    c = get_preset(name)
    assert c.q_size == c.num_heads * c.head_dim
    assert c.kv_size == c.num_kv_heads * c.head_dim
    assert c.qkv_rows == c.q_size + 2 * c.kv_size
    assert c.gqa_group * c.num_kv_heads == c.num_heads


def _weight_params(c: ModelConfig) -> int:
    """Independent count: one layer's q, k, v, o, gate, up, down matrices plus its norms."""
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = (h * c.num_heads * d + 2 * h * c.num_kv_heads * d + c.num_heads * d * h
                 + 3 * h * f + 2 * h + (2 * d if c.qk_norm else 0))
    return c.num_layers * per_layer + h + c.vocab_size * h


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_weight_bytes(name):
    c = get_preset(name)
    assert c.weight_bytes() == 2 * _weight_params(c), f"preset {name}"
    assert c.weight_bytes(4) == 2 * c.weight_bytes(2)


def test_weight_bytes_llama_1b_matches_the_design_figure():
    # 2.47 GB per decode step at bf16 (the embedding row reads are not counted; tied head once).
    assert get_preset("llama-3.2-1b").weight_bytes() == pytest.approx(2.4716e9, rel=1e-4)


def test_tiny_presets_are_small_gqa():
    for name in ("tiny-llama", "tiny-qwen3"):
        c = get_preset(name)
        assert c.num_layers == 2 and c.gqa_group > 1 and c.vocab_size <= 4096 and c.hidden_size <= 512, name
    assert get_preset("tiny-qwen3").qk_norm and not get_preset("tiny-llama").qk_norm
    assert get_preset("tiny-llama").rope_scaling is not None


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="llama-3.2-1b") as exc:
        get_preset("llama-9")
    assert "llama-9" in str(exc.value)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_hf_round_trip_through_transformers_config(name):
    """to_hf_config -> transformers' config class -> from_hf_config gives the same ModelConfig,
    and transformers reads the shape we meant."""
    c = get_preset(name)
    d = c.to_hf_config()
    assert ModelConfig.from_hf_config(d, name=name) == c
    hf = HF_CONFIG_CLASS[c.architecture].from_dict(json.loads(json.dumps(d)))
    assert ModelConfig.from_hf_config(hf, name=name) == c
    assert ModelConfig.from_hf_config(hf.to_dict(), name=name) == c
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (
        c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim)


def test_from_transformers_llama_config_without_head_dim():
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
          "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 77,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 512}
    c = ModelConfig.from_hf_config(hf)
    assert c.head_dim == 16 and c.num_kv_heads == 2 and not c.qk_norm and c.rope_scaling is None
    assert not c.tie_word_embeddings  # transformers' Llama default
    assert c.architecture == "LlamaForCausalLM"


def test_from_transformers_config_objects():
    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=100, rope_theta=1234.0, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "linear", "factor": 2.5})
    c = ModelConfig.from_hf_config(llama)
    assert c.architecture == "LlamaForCausalLM" and c.head_dim == 16 and c.gqa_group == 4
    assert c.rope_theta == 1234.0 and c.rope_scaling == RopeScaling("linear", factor=2.5)
    assert c.tie_word_embeddings
    qwen = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=100, rope_theta=1e6, rms_norm_eps=1e-6)
    c = ModelConfig.from_hf_config(qwen)
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and c.head_dim == 32 and c.q_size == 128
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.rms_norm_eps == 1e-6


def test_transformers5_rope_parameters_form():
    d = get_preset("llama-3.2-1b").to_hf_config()
    rope = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
    d["rope_parameters"] = rope
    assert ModelConfig.from_hf_config(d, name="llama-3.2-1b") == get_preset("llama-3.2-1b")


def test_default_rope_type_is_no_scaling():
    d = get_preset("tiny-qwen3").to_hf_config()
    d["rope_scaling"] = {"rope_type": "default"}
    assert ModelConfig.from_hf_config(d).rope_scaling is None


def test_from_pretrained_reads_config_json(tmp_path):
    c = get_preset("tiny-qwen3")
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_config()))
    got = ModelConfig.from_pretrained(tmp_path)
    assert got.architecture == c.architecture and got == ModelConfig.from_hf_config(c.to_hf_config(), got.name)


def _llama_dict(**changes):
    d = get_preset("tiny-llama").to_hf_config()
    d.update(changes)
    return d


def _qwen_dict(**changes):
    d = get_preset("tiny-qwen3").to_hf_config()
    d.update(changes)
    return d


UNSUPPORTED = [
    ("yarn", _llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type", "yarn"),
    ("dynamic", _llama_dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type", "dynamic"),
    ("attention_bias", _llama_dict(attention_bias=True), "attention_bias", "True"),
    ("mlp_bias", _llama_dict(mlp_bias=True), "mlp_bias", "True"),
    ("gelu", _llama_dict(hidden_act="gelu"), "hidden_act", "gelu"),
    ("sliding_window", _qwen_dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window", "True"),
    ("layer_types", _qwen_dict(layer_types=["full_attention", "sliding_attention"]), "layer_types",
     "sliding_attention"),
    ("architecture", _llama_dict(architectures=["MistralForCausalLM"]), "architectures", "MistralForCausalLM"),
    ("model_type", {k: v for k, v in _llama_dict(model_type="gpt2").items() if k != "architectures"},
     "model_type", "gpt2"),
    ("partial_rotary", _llama_dict(partial_rotary_factor=0.5), "partial_rotary_factor", "0.5"),
    ("llama3_missing", _llama_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor", "llama3"),
    ("gqa", _llama_dict(num_key_value_heads=3), "num_kv_heads", "3"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_raises_naming_field_and_value(case):
    _, d, field, value = case
    with pytest.raises(ValueError) as exc:
        ModelConfig.from_hf_config(d)
    msg = str(exc.value)
    assert field in msg and value in msg, f"message {msg!r} should name {field}={value}"
