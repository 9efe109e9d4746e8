"""Packed DeepSeek weights: seeded init, loading checkpoints transformers writes, saving ones it reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from megakernel.model.deepseek import (
    DeepseekConfig,
    DeepseekReferenceDecoder,
    LatentKVCache,
    MissingTensorError,
    contiguous_block_table,
    get_preset,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

TINY = ["tiny-deepseek", "tiny-deepseek-qlora"]


# tiny torch ops on the CPU: one intra-op thread (the plugin's fixture)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _hf_model(cfg: DeepseekConfig, seed: int, tmp_path) -> DeepseekV3ForCausalLM:
    """A transformers model of `cfg` with seeded random weights of its own (not ours): matrices
    N(0, 1/fan_in), norms 1 + N(0, 0.01), e_score_correction_bias N(0, 0.0025)."""
    (tmp_path / "cfg").mkdir(exist_ok=True)
    with open(tmp_path / "cfg" / "config.json", "w") as fh:
        json.dump(cfg.to_hf_config(), fh)
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "cfg")
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _reference_logits(weights, tokens: list[int]) -> torch.Tensor:
    dec = DeepseekReferenceDecoder(weights)
    bt = contiguous_block_table(1, len(tokens), 4)
    cache = LatentKVCache.allocate(weights.config, bt.numel(), 4, dtype=torch.float32)
    rows = [dec.step(torch.tensor([t]), torch.tensor([p]), cache, bt)[0] for p, t in enumerate(tokens)]
    return torch.stack(rows)


def _saved_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("name", TINY)
def test_random_weights_layout_and_seed(name):
    cfg = get_preset(name)
    w = random_weights(cfg, seed=3, dtype=torch.bfloat16)
    n, H, c = cfg.num_heads, cfg.hidden_size, cfg.kv_lora_rank
    assert w.embed.shape == (cfg.vocab_size, H) and w.lm_head.shape == (cfg.vocab_size, H)
    for i, layer in enumerate(w.layers):
        assert layer.qkv_a.shape == (cfg.qkv_a_rows, H), (name, i)
        assert layer.w_uk.shape == (n, cfg.qk_nope_head_dim, c) and layer.w_uv.shape == (n, cfg.v_head_dim, c)
        assert layer.o_proj.shape == (H, n * cfg.v_head_dim)
        assert (layer.q_b is None) == (cfg.q_lora_rank is None)
        if cfg.q_lora_rank is not None:
            assert layer.q_b.shape == (cfg.q_size, cfg.q_lora_rank) and layer.q_a_norm.shape == (cfg.q_lora_rank,)
        assert layer.is_moe == cfg.is_moe_layer(i)
        if layer.is_moe:
            E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
            assert layer.experts_gate_up.shape == (E, 2 * F, H) and layer.experts_down.shape == (E, H, F)
            assert layer.shared_gate_up.shape == (2 * cfg.shared_intermediate_size, H)
            assert layer.router.dtype == torch.float32 and layer.router_bias.dtype == torch.float32
            assert layer.experts_gate_up.dtype == torch.bfloat16
            assert layer.router_bias.abs().min() > 0, "correction bias must be nonzero to test its role"
        else:
            assert layer.gate_up.shape == (2 * cfg.intermediate_size, H) and layer.router is None
    again = dict(random_weights(cfg, seed=3, dtype=torch.bfloat16).named_tensors())
    other = dict(random_weights(cfg, seed=4, dtype=torch.bfloat16).named_tensors())
    f32 = dict(random_weights(cfg, seed=3, dtype=torch.float32).named_tensors())
    for k, t in w.named_tensors():
        assert torch.equal(t, again[k]), f"{name} seed 3 not reproducible at {k}"
        assert not torch.equal(t, other[k]), f"{name} seeds 3 and 4 equal at {k}"
        assert torch.equal(t, f32[k].to(t.dtype)), f"{name} bf16 != rounded fp32 draw at {k}"
    # logits decisive: lm_head ~ N(0, 16/H) gives logit std ~4 on a unit-RMS hidden state
    assert float(w.lm_head.float().std()) * math.sqrt(H) == pytest.approx(4.0, rel=0.05)


@pytest.mark.parametrize(
    "name,interleave,shard",
    [("tiny-deepseek", True, None), ("tiny-deepseek-qlora", True, "300KB"), ("tiny-deepseek", False, "300KB")],
)
def test_load_checkpoint_written_by_transformers(name, interleave, shard, tmp_path):
    cfg = dataclasses.replace(get_preset(name), num_layers=2, rope_interleave=interleave)
    seed = 11
    model = _hf_model(cfg, seed, tmp_path)
    ckpt = tmp_path / "hf"
    if shard:
        model.save_pretrained(ckpt, max_shard_size=shard)
        assert (ckpt / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    else:
        model.save_pretrained(ckpt)
    w = load_checkpoint(ckpt, dtype=torch.float32)
    assert w.config == cfg
    sd = _saved_tensors(ckpt)
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        kv_b = sd[p + "self_attn.kv_b_proj.weight"].view(cfg.num_heads, nope + v, cfg.kv_lora_rank)
        assert torch.equal(layer.w_uk, kv_b[:, :nope]) and torch.equal(layer.w_uv, kv_b[:, nope:]), (name, i)
        assert torch.equal(layer.o_proj, sd[p + "self_attn.o_proj.weight"])
        # latent rows of kv_a are not rope rows: copied as they are
        kv_a = sd[p + "self_attn.kv_a_proj_with_mqa.weight"]
        assert torch.equal(layer.qkv_a[cfg.q_a_rows : cfg.q_a_rows + cfg.kv_lora_rank], kv_a[: cfg.kv_lora_rank])
        if layer.is_moe:
            for e in (0, cfg.n_routed_experts - 1):
                x = f"{p}mlp.experts.{e}."
                gu = torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]])
                assert torch.equal(layer.experts_gate_up[e], gu), (name, i, e)
                assert torch.equal(layer.experts_down[e], sd[x + "down_proj.weight"]), (name, i, e)
            assert torch.equal(layer.router_bias, sd[p + "mlp.gate.e_score_correction_bias"])
    # the loaded weights (rope rows permuted when interleaved) decode exactly what transformers computes
    tokens = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref, hf = _reference_logits(w, tokens), _hf_logits(model, tokens)
    err = (ref - hf).abs().max().item()
    assert err < 1e-4, f"{name} interleave={interleave} seed={seed}: max |logit diff| {err}"


@pytest.mark.parametrize("name,shard,tie", [("tiny-deepseek", None, False), ("tiny-deepseek-qlora", 200_000, True)])
def test_save_load_round_trip_and_transformers_reads_it(name, shard, tie, tmp_path):
    cfg = dataclasses.replace(get_preset(name), tie_word_embeddings=tie)
    w = random_weights(cfg, seed=5, dtype=torch.bfloat16)
    save_checkpoint(tmp_path, w, max_shard_bytes=shard)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert (len(files) > 1) == (shard is not None), files
    back = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert back.config == cfg
    assert (back.lm_head is back.embed) == tie
    got = dict(back.named_tensors())
    want = dict(w.named_tensors())
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{name} shard={shard}: {k} differs"
    model, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    cfg = dataclasses.replace(get_preset("tiny-deepseek"), num_layers=2)
    save_checkpoint(tmp_path, random_weights(cfg, seed=1, dtype=torch.float32))
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    save_file({k: t for k, t in sd.items() if k != gone}, path, {"format": "pt"})
    with pytest.raises(MissingTensorError, match=gone.replace(".", r"\.")):
        load_checkpoint(tmp_path)
    with pytest.raises(KeyError):  # MissingTensorError is a KeyError
        load_checkpoint(tmp_path)
    sd["model.layers.0.self_attn.o_proj.weight"] = sd["model.layers.0.self_attn.o_proj.weight"][:, :-1].contiguous()
    save_file(sd, path, {"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        load_checkpoint(tmp_path)


def test_fused_expert_names_and_extra_layers(tmp_path):
    """Fused `mlp.experts.gate_up_proj [E, 2F, H]` storage loads the same; tensors of a layer past
    num_hidden_layers (a multi-token-prediction module) are ignored."""
    cfg = dataclasses.replace(get_preset("tiny-deepseek-qlora"), num_layers=2)
    w = random_weights(cfg, seed=2, dtype=torch.float32)
    save_checkpoint(tmp_path / "a", w)
    sd = load_file(tmp_path / "a" / "model.safetensors")
    E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
    p = "model.layers.1.mlp.experts."
    gu = torch.stack(
        [torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)]
    )
    dn = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    sd[p + "gate_up_proj"], sd[p + "down_proj"] = gu, dn
    sd["model.layers.2.self_attn.o_proj.weight"] = torch.randn(3, 3)
    os.makedirs(tmp_path / "b")
    save_file(sd, tmp_path / "b" / "model.safetensors", {"format": "pt"})
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    back = load_checkpoint(tmp_path / "b", dtype=torch.float32)
    assert torch.equal(back.layers[1].experts_gate_up, w.layers[1].experts_gate_up)
    assert torch.equal(back.layers[1].experts_down, w.layers[1].experts_down)
    assert back.layers[1].experts_gate_up.shape == (E, 2 * F, cfg.hidden_size)
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as fh:
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in fh.keys()
