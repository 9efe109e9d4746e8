"""Weights: seeded random init, HF checkpoints (written by transformers itself) into the packed layout,
and our checkpoints read back by transformers with the same tensors and logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megakernel.model import (
    CheckpointError,
    ModelConfig,
    ReferenceDecoder,
    contiguous_block_table,
    PagedKVCache,
    get_preset,
    load_checkpoint,
    random_weights,
    save_checkpoint,
    to_hf_state_dict,
)

HF_MODEL_CLASS = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}

# Small HF configs with odd sizes (vocab 97/101) and GQA; head_dim given or derived.
HF_CONFIGS = {
    "llama_tied_llama3": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, max_position_embeddings=512),
    "llama_untied": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, vocab_size=101, tie_word_embeddings=False),
    "qwen3_tied": lambda: Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=101, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3_untied": lambda: Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, vocab_size=97, tie_word_embeddings=False, rope_theta=1e6),
}


def _hf_model(name: str, seed: int):
    """A transformers model with every parameter random (norms around 1, never the init's ones)."""
    cfg = HF_CONFIGS[name]()
    cfg.architectures = ["LlamaForCausalLM" if cfg.model_type == "llama" else "Qwen3ForCausalLM"]
    model = HF_MODEL_CLASS[cfg.architectures[0]](cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.2 * noise)
    return model


def _assert_state_dicts_equal(ours: dict, theirs: dict, what: str) -> None:
    assert sorted(ours) == sorted(theirs), f"{what}: tensor names differ"
    for name, t in theirs.items():
        assert ours[name].shape == t.shape and ours[name].dtype == t.dtype, f"{what}: {name}"
        assert torch.equal(ours[name], t), f"{what}: tensor {name} differs"


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_load_transformers_checkpoint(tmp_path, name, shard):
    seed = 11
    model = _hf_model(name, seed)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, **kwargs)
    if shard is not None:
        assert (tmp_path / "model.safetensors.index.json").exists(), "transformers wrote a single file"
    w = load_checkpoint(tmp_path, dtype=torch.float32)
    cfg = w.config
    assert cfg == ModelConfig.from_hf_config(model.config, name=cfg.name)
    # Fused layout: qkv rows are q, k, v; gate_up rows are gate, up.
    for i, lw in enumerate(w.layers):
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        assert torch.equal(lw.qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert torch.equal(lw.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert (w.lm_head is w.embed) == cfg.tie_word_embeddings
    _assert_state_dicts_equal(to_hf_state_dict(w), model.state_dict(), f"{name} seed={seed} shard={shard}")


def test_load_casts_to_requested_dtype(tmp_path):
    model = _hf_model("qwen3_untied", 3)
    model.save_pretrained(tmp_path)
    w = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    ref = model.state_dict()
    for name, t in to_hf_state_dict(w).items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, ref[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("max_shard_bytes", [None, 150_000], ids=["single", "sharded"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_save_checkpoint_loads_in_transformers(tmp_path, preset, max_shard_bytes):
    """Our checkpoint -> transformers from_pretrained: the same tensors and the same logits as the
    reference decoder; and load_checkpoint gives back exactly what was saved."""
    seed = 5
    cfg = get_preset(preset)
    w = random_weights(cfg, seed=seed, dtype=torch.float32)
    save_checkpoint(tmp_path, w, max_shard_bytes=max_shard_bytes)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    if max_shard_bytes is not None:
        assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == files

    back = load_checkpoint(tmp_path, dtype=torch.float32)
    assert back.config == ModelConfig.from_hf_config(cfg.to_hf_config(), name=back.config.name)
    _assert_state_dicts_equal(to_hf_state_dict(back), to_hf_state_dict(w), f"{preset} reload seed={seed}")

    model = HF_MODEL_CLASS[cfg.architecture].from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_state_dicts_equal(model.state_dict(), to_hf_state_dict(w), f"{preset} transformers seed={seed}")

    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hf_logits = model(prompt[None]).logits[0].float()
    dec = ReferenceDecoder(w)
    table = contiguous_block_table(1, len(prompt), 4)
    cache = PagedKVCache.allocate(cfg, table.numel(), 4, dtype=torch.float32)
    ours = torch.stack([dec.step(prompt[p:p + 1], torch.tensor([p]), cache, table)[0] for p in range(len(prompt))])
    scale = hf_logits.abs().max().item()
    torch.testing.assert_close(ours, hf_logits, rtol=0, atol=1e-4 * scale,
                               msg=lambda m: f"{preset} seed={seed} logits [9, {cfg.vocab_size}] float32: {m}")


def test_save_checkpoint_bf16_round_trip_is_exact(tmp_path):
    w = random_weights(get_preset("tiny-qwen3"), seed=9, dtype=torch.bfloat16)
    save_checkpoint(tmp_path, w)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    _assert_state_dicts_equal(to_hf_state_dict(back), to_hf_state_dict(w), "tiny-qwen3 bf16 seed=9")


def _saved(tmp_path, preset="tiny-qwen3"):
    w = random_weights(get_preset(preset), seed=2, dtype=torch.float32)
    save_checkpoint(tmp_path, w)
    file = tmp_path / "model.safetensors"
    return file, load_file(file)


def test_missing_tensor_is_named(tmp_path):
    file, tensors = _saved(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path)


def test_missing_untied_lm_head_is_named(tmp_path):
    file, tensors = _saved(tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_checkpoint(tmp_path)


def test_mismatched_tensor_is_named(tmp_path):
    file, tensors = _saved(tmp_path)
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.randn(k.shape[0] + 128, k.shape[1])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(384, 256\)"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    file, tensors = _saved(tmp_path, "tiny-llama")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.randn(256)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_checkpoint(tmp_path)


def test_missing_shard_is_named(tmp_path):
    w = random_weights(get_preset("tiny-llama"), seed=1, dtype=torch.float32)
    save_checkpoint(tmp_path, w, max_shard_bytes=200_000)
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[-1]
    os.remove(tmp_path / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        load_checkpoint(tmp_path)


# ---- random weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_random_weights_shapes_and_tying(preset):
    cfg = get_preset(preset)
    w = random_weights(cfg, seed=0)
    h, f, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    assert w.embed.shape == (v, h) and w.lm_head.shape == (v, h) and w.final_norm.shape == (h,)
    assert (w.lm_head is w.embed) == cfg.tie_word_embeddings
    assert len(w.layers) == cfg.num_layers
    for lw in w.layers:
        assert lw.attn_norm.shape == (h,) and lw.mlp_norm.shape == (h,)
        assert lw.qkv.shape == (cfg.qkv_rows, h) and lw.o_proj.shape == (h, cfg.q_size)
        assert lw.gate_up.shape == (2 * f, h) and lw.down.shape == (h, f)
        assert (lw.q_norm is None) == (not cfg.qk_norm) and (lw.k_norm is None) == (not cfg.qk_norm)
        if cfg.qk_norm:
            assert lw.q_norm.shape == (d,) and lw.k_norm.shape == (d,)
    for name, t in to_hf_state_dict(w).items():
        assert t.dtype == torch.bfloat16 and torch.isfinite(t).all(), f"{preset} {name}"
        if t.ndim == 1:
            assert not torch.all(t == 1), f"{preset} {name}: norm weights must not be all ones"
            assert 0.5 < t.float().mean() < 1.5, f"{preset} {name}"
        else:
            assert t.float().std() > 0, f"{preset} {name}"


def test_random_weights_are_seeded():
    cfg = get_preset("tiny-qwen3")
    a, b, c = (random_weights(cfg, seed=s) for s in (4, 4, 5))
    sa, sb, sc = (to_hf_state_dict(x) for x in (a, b, c))
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"seed 4 twice: {name}"
        assert not torch.equal(sa[name], sc[name]), f"seed 4 vs 5: {name}"


def test_random_weights_std_override_and_scaled_default():
    cfg = get_preset("tiny-llama")
    w = random_weights(cfg, seed=1, dtype=torch.float32, std=0.25)
    assert w.layers[0].down.std().item() == pytest.approx(0.25, rel=0.05)
    w = random_weights(cfg, seed=1, dtype=torch.float32)
    # Default: unit gain, std = 1/sqrt(fan_in).
    assert w.layers[0].qkv.std().item() == pytest.approx(cfg.hidden_size ** -0.5, rel=0.05)
    assert w.layers[0].down.std().item() == pytest.approx(cfg.intermediate_size ** -0.5, rel=0.05)


def test_to_keeps_tie_and_converts():
    w = random_weights(get_preset("tiny-llama"), seed=0)
    w32 = w.to(dtype=torch.float32)
    assert w32.lm_head is w32.embed and w32.embed.dtype == torch.float32
    for name, t in to_hf_state_dict(w32).items():
        assert t.dtype == torch.float32, name
        assert torch.equal(t, to_hf_state_dict(w)[name].float()), name
