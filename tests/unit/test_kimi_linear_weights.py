"""Kimi Linear weights: seeded init, loading what transformers' save_pretrained writes (single file and
sharded, hub and in-memory layouts), saving checkpoints transformers loads."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megakernel.model.kimi_linear import (
    KimiLinearCache,
    KimiLinearReferenceDecoder,
    MissingTensorError,
    get_preset,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)
from megakernel.model.kimi_linear.weights import FP32_FIELDS
from megakernel.model.deepseek import contiguous_block_table
from megakernel.testing.tolerances import assert_close

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

TINY = ["tiny-kimi-linear", "tiny-kimi-linear-qlora"]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _hf_model(name: str, seed: int, tmp_path) -> KimiLinearForCausalLM:
    """transformers' own model of the preset with seeded random weights of its own (not ours)."""
    cfg = get_preset(name)
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "cfg")
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif pname.endswith("dt_bias"):
                p.copy_(-3 + torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def _reference_logits(weights, tokens: list[int]) -> torch.Tensor:
    dec = KimiLinearReferenceDecoder(weights)
    bt = contiguous_block_table(1, len(tokens), 4)
    cache = KimiLinearCache.allocate(weights.config, 1, bt.numel(), 4)
    return torch.stack([dec.step(torch.tensor([t]), torch.tensor([p]), cache, bt)[0] for p, t in enumerate(tokens)])


@pytest.mark.parametrize("name", TINY)
def test_random_weights_seeded_and_shaped(name):
    cfg = get_preset(name)
    a = dict(random_weights(cfg, seed=3, dtype=torch.float32).named_tensors())
    b = dict(random_weights(cfg, seed=3, dtype=torch.float32).named_tensors())
    c = dict(random_weights(cfg, seed=4, dtype=torch.float32).named_tensors())
    bf = random_weights(cfg, seed=3, dtype=torch.bfloat16)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name} seed=3: {k} not reproducible"
        assert not torch.equal(a[k], c[k]), f"{name} seeds 3/4: {k} identical"
    for k, t in bf.named_tensors():
        want = torch.float32 if k.rsplit(".", 1)[-1] in FP32_FIELDS else torch.bfloat16
        assert t.dtype == want, f"{name} seed=3: {k} is {t.dtype}, want {want}"
        torch.testing.assert_close(t.float(), a[k].to(t.dtype).float(), atol=0, rtol=0,
                                   msg=lambda m, k=k: f"{name} seed=3 {k}: bf16 is not the rounded f32 draw: {m}")
    H, D, dk, K = cfg.hidden_size, cfg.kda_dim, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if cfg.is_kda_layer(i):
            assert a[p + "kda.qkv"].shape == (3 * D, H) and a[p + "kda.conv"].shape == (3 * D, K)
            assert a[p + "kda.f_b"].shape == (D, dk) and a[p + "kda.A_log"].shape == (cfg.linear_num_heads,)
            assert not any(k.startswith(p + "mla.") for k in a), f"{name}: layer {i} has MLA weights"
        else:
            assert a[p + "mla.w_uk"].shape == (cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank)
            assert a[p + "mla.kv_a"].shape == (cfg.kv_a_rows, H)
        assert (p + "router" in a) == cfg.is_moe_layer(i), f"{name}: layer {i} MoE tensors vs mlp_layer_types"
    assert sum(t.numel() for t in a.values()) == cfg.total_params, f"{name}: tensor count != total_params"


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("sharded", [False, True])
def test_load_transformers_save_pretrained(name, sharded, tmp_path):
    seed = 5
    model = _hf_model(name, seed, tmp_path)
    out = tmp_path / "ckpt"
    model.save_pretrained(out, max_shard_size="40KB" if sharded else "10GB")
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert (len(files) > 1) == sharded, f"{name}: {files}"
    assert sharded == os.path.exists(out / "model.safetensors.index.json")
    weights = load_checkpoint(out, dtype=torch.float32)
    # transformers' in-memory layout (state_dict names) loads to the same tensors
    native = tmp_path / "native"
    native.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(native / "model.safetensors"))
    (native / "config.json").write_text((out / "config.json").read_text())
    other = dict(load_checkpoint(native, dtype=torch.float32).named_tensors())
    for k, t in weights.named_tensors():
        assert torch.equal(t, other[k]), f"{name} seed={seed}: {k} differs between hub and in-memory layouts"
    tokens = [3, 17, 250, 9, 1, 77, 5]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    assert_close(_reference_logits(weights, tokens), want, torch.float32,
                 context=f"{name} seed={seed} sharded={sharded}: reference on loaded weights vs transformers")


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_checkpoint_round_trip_and_transformers_loads_it(name, dtype, tmp_path):
    seed = 11
    weights = random_weights(get_preset(name), seed=seed, dtype=dtype)
    save_checkpoint(tmp_path / "one", weights)
    save_checkpoint(tmp_path / "sharded", weights, max_shard_bytes=30_000)
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    want = dict(weights.named_tensors())
    for sub in ("one", "sharded"):
        got = load_checkpoint(tmp_path / sub, dtype=dtype)
        assert got.config == weights.config
        for k, t in got.named_tensors():
            assert t.dtype == want[k].dtype and torch.equal(t, want[k]), f"{name} seed={seed} {sub}: {k} changed"
    model, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "sharded", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"{name} seed={seed}: transformers loading info {bad}"
    sd = model.state_dict()
    i = get_preset(name).kda_layers[0]
    conv = sd[f"model.layers.{i}.self_attn.conv1d.weight"][:, 0]
    assert torch.equal(conv.to(dtype), weights.layers[i].kda.conv), f"{name}: conv taps differ after load"


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    weights = random_weights(get_preset("tiny-kimi-linear"), seed=2, dtype=torch.float32)
    save_checkpoint(tmp_path, weights)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.f_b_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="f_b_proj"):
        load_checkpoint(tmp_path, dtype=torch.float32)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="kv_b_proj"):
        load_checkpoint(tmp_path, dtype=torch.float32)
