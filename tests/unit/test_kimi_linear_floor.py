"""The bytes of a Kimi Linear decode step (megakernel.model.kimi_linear.floor) and `megakernel info` for the
Kimi Linear presets: every weight counted once (against the config's parameter count, which the config
tests check against transformers' model), the routed experts a batch touches, the MLA latent cache, and
the KDA state read and written back."""

from __future__ import annotations

import pytest

from megakernel import cli
from megakernel.model.deepseek.floor import expected_distinct_experts
from megakernel.model.kimi_linear.floor import decode_bytes, floor_ms, kda_state_bytes
from megakernel.model.kimi_linear.presets import PRESETS, get_preset

WEIGHT_PARTS = ("kda", "mla", "norms", "router", "shared_experts", "dense_mlp", "routed_experts", "lm_head")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_weight_is_counted_once_when_every_expert_is_hit(name):
    """With a batch large enough to touch every expert, the weight parts are the model's parameters
    (config.total_params, minus the embedding table of which a step reads one row per token) at 2 bytes,
    plus 2 more bytes for each tensor kept in float32 (router, its bias, dt_bias)."""
    c = get_preset(name)
    batch = 10 ** 6
    parts = decode_bytes(c, batch, 2, 0)
    fp32 = c.num_moe_layers * c.n_routed_experts * (c.hidden_size + 1) + c.num_kda_layers * c.kda_dim
    want = (c.total_params - c.vocab_size * c.hidden_size) * 2 + fp32 * 2
    got = sum(parts[k] for k in WEIGHT_PARTS)
    assert got == pytest.approx(want, rel=1e-9), f"{name}: {parts}"
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


@pytest.mark.parametrize("batch,kv_len", [(1, 0), (3, 17), (8, 1024)])
def test_batch_terms_scale_with_the_batch_and_the_context(batch, kv_len):
    c = get_preset("kimi-linear-48b-a3b")
    parts = decode_bytes(c, batch, 2, kv_len)
    state = batch * c.num_kda_layers * (c.linear_num_heads * c.linear_head_dim ** 2
                                        + 3 * c.linear_num_heads * c.linear_head_dim
                                        * (c.linear_conv_kernel_dim - 1)) * 4
    assert parts["kda_state_read"] == parts["kda_state_written"] == state == kda_state_bytes(c, batch)
    assert parts["kv_cache"] == batch * kv_len * c.num_mla_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    assert parts["embedding"] == batch * c.hidden_size * 2
    experts = expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
    assert parts["routed_experts"] == pytest.approx(
        c.num_moe_layers * experts * 3 * c.hidden_size * c.moe_intermediate_size * 2)
    one = decode_bytes(c, 1, 2, kv_len)
    assert batch == 1 or parts["routed_experts"] > one["routed_experts"]
    assert floor_ms(parts, 4e12) == pytest.approx(parts["total"] / 4e12 * 1e3)


def test_bad_batch_or_context_is_refused():
    c = get_preset("tiny-kimi-linear")
    with pytest.raises(ValueError, match="batch=0"):
        decode_bytes(c, 0)
    with pytest.raises(ValueError, match="kv_len=-1"):
        decode_bytes(c, 1, kv_len=-1)


def test_info_prints_the_parts_and_the_floor(capsys):
    rc = cli.main(["info", "--preset", "kimi-linear-48b-a3b", "--batch", "8", "--context", "64",
                   "--bandwidth", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    parts = decode_bytes(get_preset("kimi-linear-48b-a3b"), 8, 2, 64)
    for key in ("kda_state_read", "kda_state_written", "routed_experts", "kv_cache", "total"):
        assert f"{key:17s} {parts[key] / 1e9:10.3f} GB" in out, (key, out)
    assert "20 KDA, 7 MLA" in out, out
    assert f"{parts['total'] / 4e12 * 1e3:.3f} ms/step" in out, out
