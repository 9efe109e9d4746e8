"""The vLLM integration: plugin switch and registration, config translation, the KV cache views, the
weight views, the decode input staging, and the adapter's decisions around one engine launch (with
a CPU stand-in for the engine and an injected forward context). Everything but the `vllm`-marked
tests runs on the CPU without vLLM; those check registration, metadata fields, the KV cache shape
and the config path against vLLM's own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from megakernel.integrations import vllm_mapping as vmap
from megakernel.integrations import vllm_model as vm
from megakernel.integrations import vllm_plugin as vp
from megakernel.model import get_preset
from megakernel.model.ops import rms_norm
from megakernel.model.weights import random_weights
from megakernel.testing.tolerances import assert_close

MODEL_PRESETS = ["llama-3.2-1b", "qwen3-0.6b", "tiny-llama", "tiny-qwen3"]
HF_CONFIG_CLASS = {"LlamaForCausalLM": LlamaConfig, "Qwen3ForCausalLM": Qwen3Config}
MK_NAME = {"LlamaForCausalLM": "MegakernelLlamaForCausalLM", "Qwen3ForCausalLM": "MegakernelQwen3ForCausalLM"}


class FakeRegistry:
    def __init__(self):
        self.models: dict[str, str] = {}

    def register_model(self, arch, target):
        self.models[arch] = target


# ------------------------------------------------------------------------------------------------
# The switch
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False), ("false", False),
                                            ("1", True), ("true", True), ("YES", True), (" on ", True)])
def test_env_override_values(value, expected):
    env = {} if value is None else {vp.ENV_SWITCH: value}
    assert vp.env_override(env) is expected, f"{vp.ENV_SWITCH}={value!r}"


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("1", False), ("on", False),
                                            ("0", True), ("false", True), (" NO ", True), ("off", True)])
def test_env_refuses_values(value, expected):
    env = {} if value is None else {vp.ENV_SWITCH: value}
    assert vp.env_refuses(env) is expected, f"{vp.ENV_SWITCH}={value!r}"


def test_env_unknown_value_is_off_with_a_warning(mk_log):
    env = {vp.ENV_SWITCH: "maybe"}
    assert vp.env_override(env) is False and vp.env_refuses(env) is True
    assert "maybe" in mk_log.text
    assert sorted(vp.registrations(env)) == sorted(vp.ARCHITECTURES)


def test_the_stock_names_map_to_the_megakernel_classes_unless_the_env_says_off():
    """Installed, the plugin maps the stock Llama / Qwen3 names to the megakernel classes (which run stock
    unless switched on: test_switch_setting); MEGAKERNEL_VLLM=0 leaves them to vLLM's own classes."""
    for env in ({}, {vp.ENV_SWITCH: "1"}):
        reg = FakeRegistry()
        assert vp.register(reg, environ=env) is True
        vp.register(reg, environ=env)          # vLLM may load plugins more than once per process
        for stock, mk in MK_NAME.items():
            assert reg.models[stock] == reg.models[mk] == f"{vp.MODEL_MODULE}:{mk}", (env, stock)
        assert vp.uses_megakernel(["LlamaForCausalLM"], environ=env)
        assert not vp.uses_megakernel(["MistralForCausalLM"], environ=env)
    reg = FakeRegistry()
    vp.register(reg, environ={vp.ENV_SWITCH: "0"})
    assert reg.models == {
        "MegakernelLlamaForCausalLM": "megakernel.integrations.vllm_model:MegakernelLlamaForCausalLM",
        "MegakernelQwen3ForCausalLM": "megakernel.integrations.vllm_model:MegakernelQwen3ForCausalLM",
    }
    assert not vp.uses_megakernel(["LlamaForCausalLM"], environ={vp.ENV_SWITCH: "0"})
    assert vp.uses_megakernel(["MegakernelQwen3ForCausalLM"], environ={vp.ENV_SWITCH: "0"})


def test_every_registered_class_name_exists_in_the_model_module():
    for target in vp.registrations({vp.ENV_SWITCH: "1"}).values():
        module, cls = target.split(":")
        assert module == vm.__name__
        assert cls in vp.ARCHITECTURES


def test_stock_architecture():
    assert vp.stock_architecture("MegakernelLlamaForCausalLM") == "LlamaForCausalLM"
    assert vp.stock_architecture("MegakernelQwen3ForCausalLM") == "Qwen3ForCausalLM"
    assert vp.stock_architecture("LlamaForCausalLM") == "LlamaForCausalLM"


def test_plugin_import_does_not_import_vllm():
    code = ("import sys, megakernel.integrations.vllm_plugin as p; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.skipif(vm.VLLM_IMPORT_ERROR is None, reason="vLLM is installed here")
def test_register_without_vllm_logs_and_returns_false(mk_log):
    assert vp.register() is False
    assert "vLLM is not importable" in mk_log.text


# ------------------------------------------------------------------------------------------------
# Config translation and support checks
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", MODEL_PRESETS)
@pytest.mark.parametrize("form", ["transformers", "dict"])
def test_megakernel_config_from_overridden_hf_config(preset, form):
    """vLLM holds a transformers config whose architectures hf_overrides replaced."""
    want = get_preset(preset)
    d = want.to_hf_config()
    d["architectures"] = [MK_NAME[want.architecture]]
    cfg = HF_CONFIG_CLASS[want.architecture](**d) if form == "transformers" else d
    got = vmap.megakernel_config(cfg, name=preset)
    assert got == want, f"{preset} via {form}"


def test_megakernel_config_reads_rope_parameters_form():
    want = get_preset("llama-3.2-1b")
    d = want.to_hf_config()
    rope = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
    d["rope_parameters"] = rope
    d["architectures"] = ["MegakernelLlamaForCausalLM"]
    assert vmap.megakernel_config(d, name="llama-3.2-1b") == want


@pytest.mark.parametrize("field,value", [("attention_bias", True), ("hidden_act", "gelu"),
                                         ("architectures", ["MegakernelMistralForCausalLM"])])
def test_megakernel_config_refuses_unsupported(field, value):
    d = get_preset("tiny-llama").to_hf_config()
    d[field] = value
    with pytest.raises(ValueError, match=field):
        vmap.megakernel_config(d)


def _vllm_config(**over):
    c = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype=torch.bfloat16, quantization=None, max_model_len=1024,
                                     hf_config=get_preset("tiny-qwen3").to_hf_config(), model="/m"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24]),
        quant_config=None, lora_config=None, speculative_config=None,
        additional_config={vmap.CONFIG_KEY: True})           # switched on (test_switch_setting: the switches)
    for path, value in over.items():
        obj, _, attr = path.rpartition(".")
        setattr(c if not obj else getattr(c, obj), attr, value)
    return c


@pytest.mark.parametrize("over,needle", [
    ({}, None),
    ({"parallel_config.tensor_parallel_size": 2}, None),      # the model's business (tp_reason)
    ({"parallel_config.pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"model_config.dtype": torch.float16}, "dtype=torch.float16"),
    ({"model_config.quantization": "fp8"}, "quantization=fp8"),
    ({"lora_config": object()}, "LoRA"),
    ({"cache_config.cache_dtype": "fp8_e4m3"}, "kv_cache_dtype=fp8_e4m3"),
    ({"speculative_config": object()}, "speculative"),
])
def test_vllm_config_reason(over, needle):
    why = vmap.vllm_config_reason(_vllm_config(**over))
    assert (why is None) if needle is None else (needle in why), f"{over}: {why!r}"


@pytest.mark.parametrize("extra,archs,env,want", [
    # additional_config wins over everything else, either way
    ({"megakernel": True}, ["Qwen3ForCausalLM"], {}, (True, None)),
    ({"megakernel": {"max_batch": 4}}, ["Qwen3ForCausalLM"], {}, (True, 4)),
    ({"megakernel": {}}, ["Qwen3ForCausalLM"], {}, (True, None)),
    ({"megakernel": False}, ["MegakernelQwen3ForCausalLM"], {"MEGAKERNEL_VLLM": "1"}, (False, None)),
    # then a megakernel architecture name (hf_overrides), then the environment
    ({}, ["MegakernelLlamaForCausalLM"], {}, (True, None)),
    ({"other_plugin": 1}, ["LlamaForCausalLM"], {"MEGAKERNEL_VLLM": "1"}, (True, None)),
    (None, ["LlamaForCausalLM"], {"MEGAKERNEL_VLLM": "true"}, (True, None)),
    ({}, ["LlamaForCausalLM"], {}, (False, None)),
    ({}, ["LlamaForCausalLM"], {"MEGAKERNEL_VLLM": "0"}, (False, None)),
])
def test_switch_setting(extra, archs, env, want):
    cfg = _vllm_config(**{"additional_config": extra,
                          "model_config.hf_config": dict(get_preset("tiny-llama").to_hf_config(), architectures=archs)})
    on, max_batch, why = vmap.switch_setting(cfg, environ=env)
    assert (on, max_batch) == want, (extra, archs, env, why)
    assert why, "the switch names where it came from"


@pytest.mark.parametrize("value", ["yes", 1, None, {"max_batch": 0}, {"max_batch": 65}, {"max_batch": True},
                                   {"max_batch": "4"}, {"batch": 4}])
def test_switch_setting_refuses_a_value_it_does_not_understand(value):
    with pytest.raises(ValueError, match="max_batch"):
        vmap.switch_setting(_vllm_config(additional_config={"megakernel": value}), environ={})


def test_an_instance_not_switched_on_builds_and_logs_nothing(mk_log):
    """The stock names map to the megakernel classes: an instance nobody switched on is vLLM's stock model
    (no weights viewed or packed, no engine, no warning)."""
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config(additional_config={}))
    assert a.disabled and "not switched on" in a.disabled and not a.switch.startswith("additional_config")
    a.on_weights_loaded()
    assert a.weights is None and a.packed is None and a.engine_cls is None and not a.engines
    assert a.maybe_decode(torch.tensor([1]), torch.tensor([0])) is None
    assert "WARNING" not in mk_log.text and "disabled" not in mk_log.text


def test_additional_config_max_batch_sets_the_buckets(monkeypatch):
    monkeypatch.setenv(vmap.ENV_MAX_BATCH, "8")
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config(additional_config={"megakernel": {"max_batch": 2}}))
    assert a.max_batch == 2 and a.buckets == (1, 2) and a.describe()["switch"].startswith("additional_config")


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_layout_reason_accepts_presets(preset):
    assert vmap.layout_reason(get_preset(preset)) is None
    assert vmap.layout_reason(get_preset(preset), vmap.MAX_DECODE_BATCH) is None


def test_layout_reason_names_the_unsupported_field():
    import dataclasses
    cfg = dataclasses.replace(get_preset("tiny-llama"), head_dim=96, num_heads=8)
    assert "head_dim=96" in vmap.layout_reason(cfg)


def test_decode_buckets_and_pick():
    assert vmap.decode_buckets(None) == (1, 2, 4, 8, 16, 32, 64) and vmap.MAX_DECODE_BATCH == 64
    assert vmap.decode_buckets([1, 2, 3, 4, 8, 16, 24, 128]) == (1, 2, 3, 4, 8, 16, 24, 32, 64)
    assert vmap.decode_buckets([1, 2, 4, 8, 16, 24], max_batch=8) == (1, 2, 4, 8)
    buckets = vmap.decode_buckets([1, 2, 4, 8], max_batch=8)
    assert [vmap.pick_bucket(n, buckets) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    buckets = vmap.decode_buckets([24, 40])
    assert [vmap.pick_bucket(n, buckets) for n in (9, 17, 24, 25, 33, 41, 64, 65)] == [16, 24, 24, 32, 40, 64, 64, None]


@pytest.mark.parametrize("value,expected,warned", [
    (None, vmap.DEFAULT_MAX_BATCH, False), ("", vmap.DEFAULT_MAX_BATCH, False), ("1", 1, False), (" 4 ", 4, False),
    ("8", 8, False), ("9", 9, False), ("64", 64, False), ("0", vmap.DEFAULT_MAX_BATCH, True),
    ("65", vmap.DEFAULT_MAX_BATCH, True),
    ("two", vmap.DEFAULT_MAX_BATCH, True),
])
def test_max_batch_setting(value, expected, warned, mk_log):
    env = {} if value is None else {vmap.ENV_MAX_BATCH: value}
    assert vmap.max_batch_setting(env) == expected
    assert (vmap.ENV_MAX_BATCH in mk_log.text) is warned


def test_batch_reason_names_the_switch_when_it_lowered_the_limit():
    assert vmap.batch_reason(4, 4, 1, max_batch=4) is None
    why = vmap.batch_reason(5, 5, 1, max_batch=4)
    assert "decode batch of 5 exceeds the megakernel's maximum batch 4" in why and vmap.ENV_MAX_BATCH in why
    assert vmap.batch_reason(64, 64, 1) is None
    assert vmap.ENV_MAX_BATCH not in vmap.batch_reason(65, 65, 1)


@pytest.mark.parametrize("args,kw,expected", [
    ((1, 1, 1), {}, None),
    ((8, 8, 1), {}, None),
    ((9, 9, 1), {}, None),
    ((64, 64, 1), {}, None),
    ((65, 65, 1), {}, "decode batch of 65 exceeds"),
    ((6, 2, 5), {}, vmap.QUERY_LEN),                  # prefill
    ((4, 3, 1), {}, vmap.QUERY_LEN),                  # rows that are not one request each
    ((2, 2, 1), {"has_embeds": True}, "embeddings"),
    ((2, 2, 1), {"has_intermediate": True}, "pipeline"),
])
def test_batch_reason(args, kw, expected):
    why = vmap.batch_reason(*args, **kw)
    assert (why is None) if expected is None else (expected in why), f"{args} {kw}: {why!r}"


# ------------------------------------------------------------------------------------------------
# KV cache views
# ------------------------------------------------------------------------------------------------

def _vllm_026_flash_kv(num_blocks, block_size, hkv, d, layout, gen):
    """A layer's cache built the way vLLM 0.26 builds it for FlashAttention: logical shape
    (NB, Hkv, bs, 2D), memory in the stride order of the layout, a view of an int8 buffer."""
    shape = (num_blocks, hkv, block_size, 2 * d)
    order = (0, 2, 1, 3) if layout == "NHD" else (0, 1, 2, 3)
    permuted = tuple(shape[i] for i in order)
    raw = torch.empty(num_blocks * hkv * block_size * 2 * d * 2, dtype=torch.int8)
    flat = raw.view(torch.bfloat16)
    flat.copy_(torch.randn(flat.numel(), generator=gen))
    inv = [order.index(i) for i in range(4)]
    return flat, flat.view(permuted).permute(*inv)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_split_kv_cache_flash_attention_026(layout):
    nb, bs, hkv, d, seed = 5, 16, 3, 64, 11
    gen = torch.Generator().manual_seed(seed)
    flat, kv = _vllm_026_flash_kv(nb, bs, hkv, d, layout, gen)
    k, v = vmap.split_kv_cache(kv, hkv, d)
    ctx = f"layout={layout} nb={nb} bs={bs} hkv={hkv} d={d} seed={seed}"
    # what FlashAttention reads (vllm/v1/attention/backends/flash_attn.py, forward)
    fa_k, fa_v = kv.transpose(1, 2).split(d, dim=-1)
    assert k.shape == v.shape == (nb, bs, hkv, d), ctx
    assert torch.equal(k, fa_k) and torch.equal(v, fa_v), ctx
    geom = vmap.kv_geometry([k], [v])
    # the address the kernel will compute: base + blk*sb + off*st + h*sh + dim
    for blk, off, h in [(0, 0, 0), (4, 15, 2), (2, 7, 1)]:
        for t, base in ((k, k.data_ptr()), (v, v.data_ptr())):
            idx = (base - flat.data_ptr()) // 2 + blk * geom.block_stride + off * geom.token_stride \
                + h * geom.head_stride
            assert torch.equal(flat[idx:idx + d], t[blk, off, h]), f"{ctx} at ({blk},{off},{h})"
    if layout == "NHD":
        assert (geom.block_stride, geom.token_stride, geom.head_stride) == (bs * hkv * 2 * d, hkv * 2 * d, 2 * d)
        assert v.data_ptr() - k.data_ptr() == d * 2
    # the views alias vLLM's memory: a write through k is what FlashAttention sees
    k[3, 5, 1].fill_(float("nan"))
    assert torch.isnan(fa_k[3, 5, 1]).all() and not torch.isnan(fa_v).any(), ctx


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_split_kv_cache_five_dim_layouts(layout):
    nb, bs, hkv, d = 4, 16, 2, 128
    gen = torch.Generator().manual_seed(5)
    shape = (2, nb, bs, hkv, d) if layout == "kv_first" else (nb, 2, bs, hkv, d)
    kv = torch.randn(shape, generator=gen).to(torch.bfloat16)
    k, v = vmap.split_kv_cache(kv, hkv, d)
    want_k, want_v = (kv[0], kv[1]) if layout == "kv_first" else (kv[:, 0], kv[:, 1])
    assert torch.equal(k, want_k) and torch.equal(v, want_v), layout
    assert k.data_ptr() == want_k.data_ptr(), layout
    assert k.shape == (nb, bs, hkv, d)


@pytest.mark.parametrize("shape", [(4, 16, 2, 64), (4, 2, 16, 2, 64), (2, 2, 16, 2, 64)])
def test_split_kv_cache_refuses_unknown_layouts(shape):
    with pytest.raises(ValueError, match="not a layout"):
        vmap.split_kv_cache(torch.zeros(shape, dtype=torch.bfloat16), 3, 64)


def test_kv_geometry_checks_every_layer():
    gen = torch.Generator().manual_seed(2)
    kvs = [_vllm_026_flash_kv(6, 16, 2, 64, "NHD", gen)[1] for _ in range(3)]
    pairs = [vmap.split_kv_cache(kv, 2, 64) for kv in kvs]
    ks, vs = [p[0] for p in pairs], [p[1] for p in pairs]
    g = vmap.kv_geometry(ks, vs)
    assert (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim) == (6, 16, 2, 64)
    odd = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)      # contiguous: other strides
    with pytest.raises(ValueError, match="layer 2 v"):
        vmap.kv_geometry(ks, vs[:2] + [odd])
    with pytest.raises(ValueError, match="bfloat16"):
        vmap.kv_geometry([k.float() for k in ks], [v.float() for v in vs])
    with pytest.raises(ValueError, match="one K and one V"):
        vmap.kv_geometry(ks, vs[:1])


# ------------------------------------------------------------------------------------------------
# Weights as vLLM holds them
# ------------------------------------------------------------------------------------------------

def _module(**tensors):
    m = torch.nn.Module()
    for name, t in tensors.items():
        if isinstance(t, torch.nn.Module):
            setattr(m, name, t)
        else:
            m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


@pytest.fixture(autouse=True)
def _every_batch_on_the_megakernel(monkeypatch):
    """The adapter tests cover batches up to KERNEL_MAX_BATCH; the default limit has its own test."""
    monkeypatch.setenv(vmap.ENV_MAX_BATCH, str(vmap.MAX_DECODE_BATCH))


def fake_vllm_model(weights, vocab_pad: int = 64):
    """A module tree with vLLM's names and fused layouts (qkv_proj, gate_up_proj, padded vocab)."""
    c = weights.config
    pad = -c.vocab_size % vocab_pad
    embed = torch.cat([weights.embed, torch.full((pad, c.hidden_size), float("nan"), dtype=weights.embed.dtype)])
    embed_mod = _module(weight=embed)
    layers = torch.nn.ModuleList()
    for lw in weights.layers:
        attn = dict(qkv_proj=_module(weight=lw.qkv), o_proj=_module(weight=lw.o_proj))
        if c.qk_norm:
            attn.update(q_norm=_module(weight=lw.q_norm), k_norm=_module(weight=lw.k_norm))
        layers.append(_module(input_layernorm=_module(weight=lw.attn_norm), self_attn=_module(**attn),
                              post_attention_layernorm=_module(weight=lw.mlp_norm),
                              mlp=_module(gate_up_proj=_module(weight=lw.gate_up), down_proj=_module(weight=lw.down))))
    inner = _module(embed_tokens=embed_mod, layers=layers, norm=_module(weight=weights.final_norm))
    head = embed_mod if c.tie_word_embeddings else _module(weight=weights.lm_head)
    return _module(model=inner, lm_head=head)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_weights_from_vllm_are_views_of_the_parameters(preset):
    cfg = get_preset(preset)
    w = random_weights(cfg, seed=7)
    model = fake_vllm_model(w)
    got = vmap.weights_from_vllm(model, cfg)
    ctx = f"{preset} seed=7"
    assert torch.equal(got.embed, w.embed) and got.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr(), ctx
    assert torch.equal(got.lm_head, w.lm_head), ctx
    assert (got.lm_head is got.embed) == cfg.tie_word_embeddings, ctx
    assert torch.equal(got.final_norm, w.final_norm), ctx
    for i, (a, b) in enumerate(zip(got.layers, w.layers)):
        for name, t in b.tensors():
            assert torch.equal(getattr(a, name), t), f"{ctx} layer {i} {name}"
        assert a.qkv.data_ptr() == model.model.layers[i].self_attn.qkv_proj.weight.data_ptr(), ctx
    assert (got.layers[0].q_norm is None) == (not cfg.qk_norm)


def test_weights_from_vllm_names_a_wrong_shape():
    cfg = get_preset("tiny-llama")
    model = fake_vllm_model(random_weights(cfg, seed=1))
    model.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight has shape \(3, 3\)"):
        vmap.weights_from_vllm(model, cfg)


# ------------------------------------------------------------------------------------------------
# Decode inputs and outputs
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,batch,seed", [(1, 1, 0), (3, 4, 1), (8, 8, 2), (5, 8, 3)])
def test_stage_decode_inputs(n, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    nb, vllm_nb, max_reqs, vocab = 6, 8, 16, 1000
    input_ids = torch.randint(1, vocab, (n,), generator=gen)
    positions = torch.randint(1, nb * 16, (n,), generator=gen)
    slots = torch.randint(0, 5000, (max_reqs,), generator=gen)
    slots[n:] = -1
    slots[torch.randperm(n, generator=gen)[: n // 3]] = -1        # CUDA-graph padding rows
    vbt = torch.randint(1, 500, (max_reqs, vllm_nb), generator=gen, dtype=torch.int32)
    # engine buffers poisoned with values no valid row has
    tokens = torch.full((batch,), -7, dtype=torch.int32)
    pos = torch.full((batch,), -7, dtype=torch.int32)
    bt = torch.full((batch, nb), -7, dtype=torch.int32)
    vmap.stage_decode_inputs(tokens, pos, bt, input_ids, positions, slots, vbt)
    ctx = f"n={n} batch={batch} seed={seed}"
    for r in range(batch):
        live = r < n and slots[r] >= 0
        assert tokens[r] == (input_ids[r] if live else 0), f"{ctx} row {r}"
        assert pos[r] == (positions[r] if live else 0), f"{ctx} row {r}"
        assert torch.equal(bt[r], vbt[r, :nb] if live else torch.zeros(nb, dtype=torch.int32)), f"{ctx} row {r}"


def test_stage_decode_inputs_narrow_vllm_table_leaves_the_tail():
    tokens, pos = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    bt = torch.full((2, 6), 9, dtype=torch.int32)
    vbt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]], dtype=torch.int32)
    vmap.stage_decode_inputs(tokens, pos, bt, torch.tensor([5, 6]), torch.tensor([40, 50]),
                           torch.tensor([1, 2]), vbt)
    assert bt.tolist() == [[3, 4, 5, 6, 9, 9], [7, 8, 9, 10, 9, 9]]


@pytest.mark.parametrize("n,h,seed", [(1, 256, 0), (7, 2048, 1)])
def test_final_hidden_matches_float64_rms_norm(n, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen) * 3
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(torch.bfloat16)
    out = torch.full((n, h), float("nan"), dtype=torch.bfloat16)
    out.copy_(vmap.final_hidden(x, w, 1e-5, torch.bfloat16))
    want = rms_norm(x.double(), w.double(), 1e-5)
    assert out.dtype == torch.bfloat16
    assert_close(out, want, context=f"n={n} h={h} seed={seed}")


def test_engine_kwargs_keeps_what_the_constructor_takes():
    class Old:
        def __init__(self, weights, batch, max_seq_len, *, block_size=16, device="cuda"):
            pass

    class New(Old):
        def __init__(self, weights, batch, max_seq_len, *, block_size=16, device="cuda", packed_weights=None,
                     own_kv_cache=True, lm_head=True):
            pass

    class Open:
        def __init__(self, *a, **kw):
            pass

    want = dict(packed_weights=1, own_kv_cache=False, lm_head=False)
    assert vmap.engine_kwargs(Old, **want) == {}
    assert vmap.engine_kwargs(New, **want) == want
    assert vmap.engine_kwargs(Open, **want) == want


# ------------------------------------------------------------------------------------------------
# The adapter's setup paths that need neither vLLM nor a GPU
# ------------------------------------------------------------------------------------------------

def test_adapter_disables_itself_for_an_unsupported_vllm_config(mk_log):
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config(**{"parallel_config.pipeline_parallel_size": 2}))
    assert a.disabled and "pipeline_parallel_size=2" in a.disabled
    assert "pipeline_parallel_size=2" in mk_log.text
    a.on_weights_loaded()
    assert a.engine_cls is None and a.weights is None


def test_adapter_default_limit_sends_only_batch_one_to_the_megakernel(monkeypatch, mk_log):
    monkeypatch.delenv(vmap.ENV_MAX_BATCH)
    FakeEngine.built.clear()
    a, cfg, ctx, _ = _ready_adapter()
    assert a.max_batch == vmap.DEFAULT_MAX_BATCH == 1 and a.buckets == (1,)
    name = "model.layers.0.self_attn.attn"
    ctx.attn_metadata = {name: _metadata(2, 1, 0)}
    assert a.maybe_decode(torch.zeros(2, dtype=torch.long), torch.arange(2)) is None and not FakeEngine.built
    ctx.attn_metadata = {name: _metadata(1, 1, 0)}
    assert a.maybe_decode(torch.zeros(1, dtype=torch.long), torch.arange(1)) is not None
    assert [e.batch for e in FakeEngine.built] == [1]


def test_adapter_on_cpu_falls_back_with_the_reason():
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config())
    assert a.disabled is None and a.buckets == (1, 2, 4, 8, 16, 24, 32, 64)     # (the capture sizes 1-24 among them)
    a.on_weights_loaded()
    assert a.disabled is not None and "not a CUDA GPU" in a.disabled
    assert a.maybe_decode(torch.tensor([1]), torch.tensor([0])) is None


class _Attn:
    def __init__(self, kv, name):
        self.kv_cache, self.layer_name = kv, name


class _RecordingEngine:
    def __init__(self):
        self.bound = []

    def bind_kv_caches(self, k, v):
        self.bound.append((list(k), list(v)))


def test_adapter_binds_per_layer_views_in_layer_order_and_rebinds_when_moved():
    cfg = get_preset("tiny-qwen3")
    model = fake_vllm_model(random_weights(cfg, seed=4))
    gen = torch.Generator().manual_seed(4)
    empty = [_Attn(torch.tensor([]), f"model.layers.{i}.self_attn.attn") for i in range(cfg.num_layers)]
    for layer, attn in zip(model.model.layers, empty):
        object.__setattr__(layer.self_attn, "attn", attn)
    a = vm.MegakernelDecode(model, _vllm_config())
    eng = _RecordingEngine()
    a.engines[2] = eng
    assert a._bind() is False and not eng.bound           # vLLM has not allocated its cache yet
    caches = [_vllm_026_flash_kv(5, 16, cfg.num_kv_heads, cfg.head_dim, "NHD", gen)[1] for _ in empty]
    for attn, kv in zip(empty, caches):
        attn.kv_cache = kv
    assert a._bind() is True and a._bind() is True
    assert len(eng.bound) == 1, "bound again without a move"
    k, v = eng.bound[0]
    for i, kv in enumerate(caches):
        fa_k, fa_v = kv.transpose(1, 2).split(cfg.head_dim, dim=-1)
        assert k[i].data_ptr() == fa_k.data_ptr() and v[i].data_ptr() == fa_v.data_ptr(), f"layer {i}"
    moved = [_vllm_026_flash_kv(5, 16, cfg.num_kv_heads, cfg.head_dim, "NHD", gen)[1] for _ in empty]
    for attn, kv in zip(empty, moved):
        attn.kv_cache = kv
    assert a._bind() is True and len(eng.bound) == 2
    assert eng.bound[1][0][0].data_ptr() == moved[0].data_ptr()
    assert a.kv[2].num_blocks == 5


class FakeEngine:
    """Stands in for MegakernelEngine on the CPU: same buffers, and a launch that writes x[L] as a
    known function of the staged inputs (embedding row of the token + its position)."""

    built: list["FakeEngine"] = []

    def __init__(self, weights, batch, max_seq_len, *, block_size=16, device="cpu", own_kv_cache=True,
                 lm_head=True, scratch_block=-1):
        c = weights.config
        self.weights, self.batch = weights, batch
        self.options = dict(own_kv_cache=own_kv_cache, lm_head=lm_head, scratch_block=scratch_block)
        i32 = dict(dtype=torch.int32)
        self.bufs = SimpleNamespace(tokens=torch.full((batch,), -5, **i32), positions=torch.full((batch,), -5, **i32),
                                    block_table=torch.full((batch, -(-max_seq_len // block_size)), -5, **i32),
                                    x=torch.full((c.num_layers + 1, batch, c.hidden_size), float("nan")))
        self.launches, self.bound = 0, None
        FakeEngine.built.append(self)

    def bind_kv_caches(self, k, v):
        self.bound = (k, v)

    def launch(self):
        self.launches += 1
        self.bufs.x[-1] = self.weights.embed[self.bufs.tokens.long()].float() + self.bufs.positions[:, None].float()

    def check(self):
        pass


def _ready_adapter(preset="tiny-llama", seed=6):
    """An adapter past on_weights_loaded, on the CPU, with FakeEngine and an injected forward context."""
    cfg = get_preset(preset)
    model = fake_vllm_model(random_weights(cfg, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    attn = [_Attn(_vllm_026_flash_kv(40, 16, cfg.num_kv_heads, cfg.head_dim, "NHD", gen)[1],
                  f"model.layers.{i}.self_attn.attn") for i in range(cfg.num_layers)]
    for layer, at in zip(model.model.layers, attn):
        object.__setattr__(layer.self_attn, "attn", at)
    a = vm.MegakernelDecode(model, _vllm_config(**{"model_config.hf_config": cfg.to_hf_config()}))
    a.prepared, a.engine_cls, a.device = True, FakeEngine, torch.device("cpu")
    a.weights = vmap.weights_from_vllm(model, cfg)
    a.norm_weight, a.eps = a.weights.final_norm, cfg.rms_norm_eps
    ctx = SimpleNamespace(attn_metadata=None)
    a._fc_get, a._fc_available = (lambda: ctx), (lambda: True)
    return a, cfg, ctx, model


def _metadata(n, max_query_len, seed, valid=None):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 600, (n,), generator=gen)
    if valid is not None:
        slots[~valid] = -1
    return SimpleNamespace(max_query_len=max_query_len, slot_mapping=slots,
                           block_table=torch.randint(1, 40, (n, 128), generator=gen, dtype=torch.int32))


@pytest.mark.parametrize("n,bucket,seed", [(1, 1, 0), (3, 4, 1), (8, 8, 2), (20, 24, 3), (40, 64, 4)])
def test_adapter_decode_batch_runs_one_engine_launch(n, bucket, seed):
    FakeEngine.built.clear()
    a, cfg, ctx, model = _ready_adapter(seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    valid = torch.ones(n, dtype=torch.bool)
    valid[n - 1] = n < 3                                 # the last row of bigger batches is CUDA-graph padding
    md = _metadata(n, 1, seed, valid)
    ctx.attn_metadata = {f"model.layers.{i}.self_attn.attn": md for i in range(cfg.num_layers)}
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    pos = torch.randint(0, 500, (n,), generator=gen)
    out = a.maybe_decode(ids, pos)
    ctx_s = f"n={n} seed={seed}"
    assert out is not None and out.shape == (n, cfg.hidden_size) and out.dtype == torch.bfloat16, ctx_s
    [eng] = FakeEngine.built
    assert eng.batch == bucket and eng.launches == 1 and eng.options == dict(own_kv_cache=False, lm_head=False,
                                                                     scratch_block=0)
    k, v = eng.bound
    assert len(k) == len(v) == cfg.num_layers
    tok = torch.where(valid, ids, 0)
    p = torch.where(valid, pos, 0)
    x = model.model.embed_tokens.weight[tok].float() + p[:, None].float()
    assert_close(out, rms_norm(x.double(), a.weights.final_norm.double(), cfg.rms_norm_eps), context=ctx_s)
    assert torch.equal(eng.bufs.block_table[:n, :64], torch.where(valid[:, None], md.block_table[:, :64], 0)), ctx_s
    # a second step of the same size reuses the engine
    assert a.maybe_decode(ids, pos) is not None and len(FakeEngine.built) == 1 and eng.launches == 2


def test_adapter_leaves_prefill_and_big_batches_to_vllm(mk_log):
    FakeEngine.built.clear()
    a, cfg, ctx, _ = _ready_adapter()
    name = "model.layers.0.self_attn.attn"
    ctx.attn_metadata = {name: _metadata(2, 7, 0)}                     # prefill: silent
    assert a.maybe_decode(torch.zeros(9, dtype=torch.long), torch.arange(9)) is None
    ctx.attn_metadata = {name: _metadata(65, 1, 0)}                    # 65 decodes: logged once
    before = vm.STATS["fallbacks"].copy()
    for _ in range(3):
        assert a.maybe_decode(torch.zeros(65, dtype=torch.long), torch.arange(65)) is None
    why = "decode batch of 65 exceeds the megakernel's maximum batch 64"
    assert vm.STATS["fallbacks"][why] - before[why] == 3
    assert mk_log.text.count(why) <= 1 and not FakeEngine.built
    ctx.attn_metadata = None                                            # profiling run
    assert a.maybe_decode(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)) is None


def test_adapter_limit_from_the_environment_sends_bigger_batches_stock(monkeypatch, mk_log):
    monkeypatch.setenv(vmap.ENV_MAX_BATCH, "2")
    FakeEngine.built.clear()
    a, cfg, ctx, _ = _ready_adapter()
    assert a.max_batch == 2 and a.buckets == (1, 2) and a.describe()["max_batch"] == 2
    name = "model.layers.0.self_attn.attn"
    ctx.attn_metadata = {name: _metadata(3, 1, 0)}
    before = vm.STATS["fallbacks"].copy()
    assert a.maybe_decode(torch.zeros(3, dtype=torch.long), torch.arange(3)) is None
    why = f"decode batch of 3 exceeds the megakernel's maximum batch 2 ({vmap.ENV_MAX_BATCH})"
    assert vm.STATS["fallbacks"][why] - before[why] == 1 and not FakeEngine.built
    ctx.attn_metadata = {name: _metadata(2, 1, 0)}
    assert a.maybe_decode(torch.zeros(2, dtype=torch.long), torch.arange(2)) is not None
    assert [e.batch for e in FakeEngine.built] == [2]


def test_report_is_plain_data_with_the_engines_checked(monkeypatch):
    FakeEngine.built.clear()
    a, cfg, ctx, _ = _ready_adapter()
    monkeypatch.setattr(vm, "_ADAPTERS", weakref.WeakSet([a]))   # adapters of other tests may still live
    ctx.attn_metadata = {"model.layers.0.self_attn.attn": _metadata(1, 1, 0)}
    assert a.maybe_decode(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)) is not None
    rep = vm.report(object())
    assert rep["kernel_error"] is None and rep["pid"] == os.getpid()
    assert type(rep["fallbacks"]) is dict and [d["engines"] for d in rep["adapters"]] == [[1]]
    json.dumps(rep)   # what vLLM's collective_rpc sends back must serialize as plain data
    FakeEngine.built[0].check = lambda: (_ for _ in ()).throw(RuntimeError("error word 3"))
    assert vm.report()["kernel_error"] == "RuntimeError: error word 3"


def test_adapter_waits_for_vllms_kv_cache():
    FakeEngine.built.clear()
    a, cfg, ctx, model = _ready_adapter()
    for layer in model.model.layers:
        layer.self_attn.attn.kv_cache = torch.tensor([])
    ctx.attn_metadata = {"model.layers.0.self_attn.attn": _metadata(1, 1, 0)}
    assert a.maybe_decode(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)) is None
    assert not FakeEngine.built and a.disabled is None


class _FailingEngine(FakeEngine):
    def launch(self):
        raise RuntimeError("launch broke")


def test_adapter_error_on_the_decode_path_goes_stock_and_disables(mk_log):
    """A bug on the megakernel path must not take vLLM down (at CUDA graph capture it would abort
    the engine start): the batch goes to the stock path, the reason is logged, and later batches
    stay stock."""
    a, cfg, ctx, _ = _ready_adapter()
    a.engine_cls = _FailingEngine
    ctx.attn_metadata = {f"model.layers.{i}.self_attn.attn": _metadata(2, 1, 0) for i in range(cfg.num_layers)}
    ids, pos = torch.tensor([3, 4]), torch.tensor([5, 6])
    assert a.maybe_decode(ids, pos) is None
    assert a.disabled is not None and "launch broke" in a.disabled
    assert "launch broke" in mk_log.text
    assert a.maybe_decode(ids, pos) is None


class _FlaggedEngine:
    """An engine whose kernel flag says `code` (None: no error); check() raises what the device word says."""

    def __init__(self, code):
        self.code, self.checked = code, 0

    def error_flag(self):
        return self.code

    def check(self):
        self.checked += 1
        if self.code is not None:
            self.code = None
            raise RuntimeError("instruction #7 ATTN_PARTIAL (layer 0): position 70 is past the KV cache")


def test_adapter_raises_the_kernels_error_from_its_host_flag_and_goes_stock(mk_log):
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config())
    quiet, failed = _FlaggedEngine(None), _FlaggedEngine(2)
    a.engines.update({1: quiet, 2: failed})
    with pytest.raises(RuntimeError, match="past the KV cache"):
        a.check_flags()
    assert failed.checked == 1 and quiet.checked == 0, "the device word is read only where the flag is set"
    assert a.disabled is not None and "past the KV cache" in a.disabled and "past the KV cache" in mk_log.text
    assert a.maybe_decode(torch.tensor([1]), torch.tensor([0])) is None
    a.check_flags()                                  # the error was reported once; nothing is raised again


def test_model_class_reads_the_flags_before_every_logits_computation():
    class Stock:
        def compute_logits(self, hidden_states):
            return hidden_states * 2

    class Model(vm.MegakernelDecodeMixin, Stock):
        pass

    model = object.__new__(Model)
    calls = []
    object.__setattr__(model, "megakernel", SimpleNamespace(check_flags=lambda: calls.append("checked")))
    assert torch.equal(model.compute_logits(torch.ones(2)), torch.full((2,), 2.0)) and calls == ["checked"]

    def failing():
        raise RuntimeError("kernel error")

    object.__setattr__(model, "megakernel", SimpleNamespace(check_flags=failing))
    with pytest.raises(RuntimeError, match="kernel error"):
        model.compute_logits(torch.ones(2))


def test_adapter_error_while_preparing_does_not_fail_model_loading(monkeypatch, mk_log):
    def broken(*_a, **_k):
        raise RuntimeError("view broke")

    monkeypatch.setattr(vm, "weights_from_vllm", broken)
    model = fake_vllm_model(random_weights(get_preset("tiny-qwen3"), seed=3))
    a = vm.MegakernelDecode(model, _vllm_config())
    a.on_weights_loaded()                      # must not raise into vLLM's loader
    assert a.engine_cls is None and "view broke" in a.disabled and "view broke" in mk_log.text
    assert a.maybe_decode(torch.tensor([1]), torch.tensor([0])) is None


# ------------------------------------------------------------------------------------------------
# The GPU tools' verdict on whether the plugin path really ran the megakernel
# ------------------------------------------------------------------------------------------------

def _tools_vllm_parity():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "vllm_parity.py"
    spec = importlib.util.spec_from_file_location("tools_vllm_parity", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("report,used,needle", [
    (None, False, "no megakernel report"),
    ({"import_error": "ImportError('x')"}, False, "did not import"),
    ({"report_error": "collective_rpc: TimeoutError: x"}, False, "engine process: collective_rpc"),
    ({"disabled": "the GPU is sm_80", "captured": [8]}, False, "sm_80"),
    ({"disabled": None, "kernel_error": "MegakernelError: timed out", "captured": [8]}, False, "timed out"),
    ({"disabled": None, "kernel_error": None, "captured": [], "eager_steps": 0}, False, "no decode step"),
    ({"disabled": None, "kernel_error": None, "captured": [8, 4, 8], "eager_steps": 3,
      "engines": [{"batch": 8}, {"batch": 4}], "fallbacks": {}}, True, "[4, 8]"),
])
def test_megakernel_used_verdict(report, used, needle):
    tool = _tools_vllm_parity()
    got, how = tool.megakernel_used({} if report is None else {"megakernel": report})
    assert got is used and needle in how, how


# ------------------------------------------------------------------------------------------------
# Against vLLM itself
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def vllm_registry():
    from vllm import ModelRegistry

    saved = dict(ModelRegistry.models)
    yield ModelRegistry
    ModelRegistry.models.clear()
    ModelRegistry.models.update(saved)


@pytest.mark.vllm
@pytest.mark.parametrize("env", [None, "1", "0"])
def test_register_with_vllm(vllm_registry, env, monkeypatch):
    if env is None:
        monkeypatch.delenv(vp.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(vp.ENV_SWITCH, env)
    stock_llama = vllm_registry.models["LlamaForCausalLM"]
    assert vp.register() is True
    archs = vllm_registry.get_supported_archs()
    assert {"MegakernelLlamaForCausalLM", "MegakernelQwen3ForCausalLM"} <= set(archs)
    for mk, stock in vp.ARCHITECTURES.items():
        entry = vllm_registry.models[mk]
        assert (entry.module_name, entry.class_name) == (vp.MODEL_MODULE, mk)
        cls = entry.load_model_cls()
        assert cls is getattr(vm, mk)
    if env == "0":
        assert vllm_registry.models["LlamaForCausalLM"] is stock_llama
    else:          # (unset: mapped, and each instance stock unless switched on: test_switch_setting)
        assert vllm_registry.models["LlamaForCausalLM"].class_name == "MegakernelLlamaForCausalLM"


@pytest.mark.vllm
def test_flash_attention_metadata_has_the_fields_the_adapter_reads():
    from dataclasses import fields

    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadata

    assert {"block_table", "slot_mapping", "max_query_len"} <= {f.name for f in fields(FlashAttentionMetadata)}
    # the logical per-layer cache shape split_kv_cache expects for this backend
    assert FlashAttentionBackend.get_kv_cache_shape(7, 16, 2, 64) == (7, 2, 16, 128)


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("packed", [False, True])
def test_split_kv_cache_of_vllms_own_flash_attention_cache(layout, packed):
    """The per-layer cache as vLLM 0.26's model runner builds it (vllm/v1/worker/gpu/attn_utils.py,
    _reshape_attention_kv_cache with FlashAttentionBackend's shape and stride order), on the CPU: the
    views address what FlashAttention reads, and every layer of a packed allocation shares strides."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import set_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    nb, bs, hkv, d, layers = 5, 16, 2, 64, 3
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    set_kv_cache_layout(layout)
    try:
        order = FlashAttentionBackend.get_kv_cache_stride_order()
    finally:
        set_kv_cache_layout(None)
    shape = FlashAttentionBackend.get_kv_cache_shape(nb, bs, hkv, d)
    gen = torch.Generator().manual_seed(9)
    backing = torch.randint(-100, 100, (nb * page * layers,), generator=gen, dtype=torch.int8)
    kvs = []
    for layer in range(layers):
        if packed:
            raw, packing = backing, (layer * page, layers * page)
        else:
            raw, packing = backing[layer * nb * page:(layer + 1) * nb * page], None
        kvs.append(_reshape_attention_kv_cache(raw, spec, shape, order, nb, packing))
    pairs = [vmap.split_kv_cache(kv, hkv, d) for kv in kvs]
    ks, vs = [p[0] for p in pairs], [p[1] for p in pairs]
    geom = vmap.kv_geometry(ks, vs)
    ctx = f"layout={layout} packed={packed}"
    assert (geom.num_blocks, geom.block_size, geom.num_kv_heads, geom.head_dim) == (nb, bs, hkv, d), ctx
    flat = backing.view(torch.bfloat16)

    def same(a, b):   # bitwise: random bytes include NaNs
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    for kv, k, v in zip(kvs, ks, vs):
        fa_k, fa_v = kv.transpose(1, 2).split(d, dim=-1)         # FlashAttentionImpl.forward
        assert same(k, fa_k) and same(v, fa_v) and k.data_ptr() == fa_k.data_ptr(), ctx
        for blk, off, h in [(0, 0, 0), (4, 15, 1), (2, 7, 1)]:
            for t in (k, v):
                idx = (t.data_ptr() - flat.data_ptr()) // 2 + blk * geom.block_stride + off * geom.token_stride \
                    + h * geom.head_stride
                assert same(flat[idx:idx + d], t[blk, off, h]), f"{ctx} ({blk},{off},{h})"


@pytest.mark.vllm
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-0.6b"])
def test_megakernel_config_from_vllms_model_config(preset, tmp_path, vllm_registry):
    """vLLM's own ModelConfig of a checkpoint directory with the architecture overridden."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    want = get_preset(preset)
    (tmp_path / "config.json").write_text(json.dumps(dict(want.to_hf_config(), torch_dtype="bfloat16")))
    vp.register()
    mc = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=512,
                    hf_overrides={"architectures": [MK_NAME[want.architecture]]}).create_model_config()
    assert mc.architectures == [MK_NAME[want.architecture]]
    assert vmap.megakernel_config(mc.hf_config, name=preset) == want


@pytest.mark.vllm
def test_model_classes_extend_vllms():
    import inspect
    from dataclasses import asdict

    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.registry import _ModelInfo

    assert vm.VLLM_IMPORT_ERROR is None
    for cls, base in ((vm.MegakernelLlamaForCausalLM, LlamaForCausalLM),
                      (vm.MegakernelQwen3ForCausalLM, Qwen3ForCausalLM)):
        assert issubclass(cls, base) and cls.forward is vm.MegakernelDecodeMixin.forward
        # vllm.model_executor.model_loader.utils.initialize_model passes these by keyword
        assert {"vllm_config", "prefix"} <= set(inspect.signature(cls.__init__).parameters), cls
        # what vLLM's registry records about the class is what it records about the stock one
        mine, stock = asdict(_ModelInfo.from_model_cls(cls)), asdict(_ModelInfo.from_model_cls(base))
        assert mine.pop("architecture") == cls.__name__ and stock.pop("architecture") == base.__name__
        assert mine == stock, cls
