"""Reference ops and the reference decoder, against float64 formulas and transformers' own
LlamaForCausalLM / Qwen3ForCausalLM (float32, CPU, the same weights)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from megakernel.model import (
    ModelConfig,
    PagedKVCache,
    ReferenceDecoder,
    RopeScaling,
    apply_rope,
    contiguous_block_table,
    get_preset,
    paged_attention_decode,
    random_weights,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
    to_hf_state_dict,
)

HF_CLASSES = {"LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM), "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM)}

TINY_LLAMA = get_preset("tiny-llama")
# Decoder variants: llama3 scaling (tiny-llama), linear, none; Qwen3 with QK-norm.
DECODER_CONFIGS = {
    "tiny-llama-llama3": TINY_LLAMA,
    "tiny-llama-linear": dataclasses.replace(TINY_LLAMA, rope_scaling=RopeScaling("linear", factor=4.0),
                                             rope_theta=10000.0, tie_word_embeddings=False),
    "tiny-llama-norope-scaling": dataclasses.replace(TINY_LLAMA, rope_scaling=None, rope_theta=10000.0),
    "tiny-qwen3": get_preset("tiny-qwen3"),
}
NEW_TOKENS = 32


def _hf_config(cfg: ModelConfig):
    config_cls, _ = HF_CLASSES[cfg.architecture]
    hf = config_cls.from_dict(cfg.to_hf_config())
    hf._attn_implementation = "eager"
    return hf


def _hf_model(weights):
    cfg = weights.config
    model = HF_CLASSES[cfg.architecture][1](_hf_config(cfg)).eval()
    model.load_state_dict(to_hf_state_dict(weights.to(dtype=torch.float32)), strict=True)
    return model


# ---- ops -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 257), (2, 5, 128)])
def test_rms_norm(shape, dtype):
    seed = 0
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    eps = 1e-5
    x64, w64 = x.double(), w.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    out = rms_norm(x, w, eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"rms_norm shape={shape} dtype={dtype} seed={seed}: {m}")


def test_silu_and_mul():
    gen = torch.Generator().manual_seed(1)
    g, u = torch.randn(4, 333, generator=gen) * 4, torch.randn(4, 333, generator=gen)
    ref = g.double() / (1 + torch.exp(-g.double())) * u.double()
    out = silu_and_mul(g.bfloat16(), u.bfloat16())
    assert out.dtype == torch.float32
    ref_bf = g.bfloat16().double() / (1 + torch.exp(-g.bfloat16().double())) * u.bfloat16().double()
    torch.testing.assert_close(out.double(), ref_bf, rtol=1e-5, atol=1e-5, msg=lambda m: f"silu seed=1 [4,333]: {m}")
    torch.testing.assert_close(silu_and_mul(g, u).double(), ref, rtol=1e-5, atol=1e-5)


ROPE_CONFIGS = {
    "llama-3.2-1b": get_preset("llama-3.2-1b"),
    "llama-3.1-8b": get_preset("llama-3.1-8b"),
    "qwen3-0.6b": get_preset("qwen3-0.6b"),
    "linear": dataclasses.replace(TINY_LLAMA, rope_scaling=RopeScaling("linear", factor=2.0)),
    "llama3-small-context": dataclasses.replace(
        TINY_LLAMA, rope_scaling=RopeScaling("llama3", factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                             original_max_position_embeddings=256)),
}


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_rope_matches_transformers(name):
    cfg = ROPE_CONFIGS[name]
    rotary = LlamaRotaryEmbedding(config=_hf_config(cfg))
    inv_freq = rope_inv_freq(cfg)
    assert inv_freq.shape == (cfg.head_dim // 2,) and inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3":
        # The scaling must change some frequencies and keep the highest one.
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        assert not torch.allclose(inv_freq, base) and inv_freq[0] == base[0]

    seed = 2
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 1, 17, 300, 5000, 70000])
    b = len(positions)
    q = torch.randn(b, 3, cfg.head_dim, generator=gen)
    k = torch.randn(b, 2, cfg.head_dim, generator=gen)
    cos, sin = rope_cos_sin(inv_freq, positions)
    hf_cos, hf_sin = rotary(q, positions[:, None])  # [B, 1, D]
    torch.testing.assert_close(cos, hf_cos[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[:, 0], rtol=1e-5, atol=1e-5)
    # HF applies RoPE to [B, heads, seq, D]; here seq = 1 per row.
    hf_q, hf_k = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], hf_cos, hf_sin, unsqueeze_dim=1)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[:, :, 0], rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"apply_rope {name} seed={seed}: {m}")
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[:, :, 0], rtol=1e-5, atol=1e-5)


def test_contiguous_block_table():
    t = contiguous_block_table(3, 33, 16)
    assert t.dtype == torch.int32 and t.shape == (3, 3)
    assert t.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_cache_write_uses_block_table():
    cfg = get_preset("tiny-qwen3")
    cache = PagedKVCache.allocate(cfg, num_blocks=6, block_size=4, dtype=torch.float32)
    assert cache.k.shape == (2, 6, 4, 2, 128) and torch.isnan(cache.k).all() and torch.isnan(cache.v).all()
    table = torch.tensor([[5, 2, 0], [1, 4, 3]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 128, generator=gen), torch.randn(2, 2, 128, generator=gen)
    cache.write(1, table, torch.tensor([6, 9]), k, v)
    assert torch.equal(cache.k[1, 2, 2], k[0]) and torch.equal(cache.v[1, 2, 2], v[0])
    assert torch.equal(cache.k[1, 3, 1], k[1]) and torch.equal(cache.v[1, 3, 1], v[1])
    assert int((~torch.isnan(cache.k)).sum()) == k.numel(), "write touched other slots"


# (batch, Hq, Hkv, D, block_size, seq_lens)
ATTN_CASES = [
    (1, 4, 4, 64, 16, [1]),
    (3, 8, 2, 64, 16, [17, 1, 48]),
    (4, 16, 8, 128, 5, [23, 7, 40, 5]),
    (2, 6, 1, 32, 3, [11, 2]),
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES, ids=[f"b{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-bs{c[4]}" for c in ATTN_CASES])
def test_paged_attention_decode_vs_dense(case, cache_dtype):
    batch, hq, hkv, d, bs, lens = case
    seed = sum(lens) + hq
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens) + 1
    num_blocks = batch * max_blocks + 3
    # Non-contiguous: every sequence's blocks are a random, interleaved subset of the pool.
    perm = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    table = perm.view(batch, max_blocks).to(torch.int32)
    k_cache = torch.full((num_blocks, bs, hkv, d), math.nan, dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    q = torch.randn(batch, hq, d, generator=gen)
    dense_k, dense_v = [], []
    for b, n in enumerate(lens):
        kb = (torch.randn(n, hkv, d, generator=gen) * 2).to(cache_dtype)
        vb = torch.randn(n, hkv, d, generator=gen).to(cache_dtype)
        for p in range(n):
            k_cache[table[b, p // bs], p % bs] = kb[p]
            v_cache[table[b, p // bs], p % bs] = vb[p]
        dense_k.append(kb.double())
        dense_v.append(vb.double())
    scale = d ** -0.5
    out = paged_attention_decode(q, k_cache, v_cache, table, torch.tensor(lens), scale)
    assert out.shape == (batch, hq, d) and out.dtype == torch.float32
    group = hq // hkv
    for b, n in enumerate(lens):
        for h in range(hq):
            kk, vv = dense_k[b][:, h // group], dense_v[b][:, h // group]  # [n, D]
            p = torch.softmax(kk @ q[b, h].double() * scale, dim=0)
            ref = p @ vv
            torch.testing.assert_close(out[b, h].double(), ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"case={case} dtype={cache_dtype} seed={seed} b={b} h={h}: {m}")


# ---- decoder vs transformers --------------------------------------------------------------------

def _hf_teacher_forced_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _assert_matches_hf(name, cfg, result_tokens, result_logits, prompt, model, seed):
    """Our greedy tokens/logits vs transformers run over prompt + our tokens (one full forward):
    if our tokens are its greedy tokens at every step, the greedy sequences are identical."""
    full = prompt + result_tokens[:-1]
    hf = _hf_teacher_forced_logits(model, full)[len(prompt) - 1:]  # [NEW_TOKENS, V]
    scale = hf.abs().max().item()
    what = f"{name} seed={seed} prompt_len={len(prompt)} logits [{NEW_TOKENS}, {cfg.vocab_size}] float32"
    torch.testing.assert_close(result_logits, hf, rtol=0, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}")
    hf_tokens = hf.argmax(-1).tolist()
    for t, (ours, theirs) in enumerate(zip(result_tokens, hf_tokens)):
        top2 = hf[t].topk(2).values
        assert ours == theirs, (f"{what}: step {t} token {ours} vs transformers {theirs}, "
                                f"top-2 gap {float(top2[0] - top2[1]):.3g}")


@pytest.mark.parametrize("name", sorted(DECODER_CONFIGS))
def test_decoder_matches_transformers(name):
    cfg = DECODER_CONFIGS[name]
    seed = 7
    w = random_weights(cfg, seed=seed, dtype=torch.float32)
    model = _hf_model(w)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (6,), generator=gen).tolist()
    res = ReferenceDecoder(w).generate([prompt], NEW_TOKENS)
    assert len(res.tokens[0]) == NEW_TOKENS and res.logits[0].shape == (NEW_TOKENS, cfg.vocab_size)
    _assert_matches_hf(name, cfg, res.tokens[0], res.logits[0], prompt, model, seed)
    # Meaningful parity: the greedy stream is not stuck on one token.
    assert len(set(res.tokens[0])) >= NEW_TOKENS // 4, f"{name} seed={seed}: tokens {res.tokens[0]}"


def test_decoder_bf16_weights_match_transformers():
    """bf16 weights (as the kernel reads them), upcast: the reference equals transformers in float32."""
    cfg = get_preset("tiny-qwen3")
    seed = 8
    w = random_weights(cfg, seed=seed, dtype=torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
    res = ReferenceDecoder(w).generate([prompt], NEW_TOKENS)
    _assert_matches_hf("tiny-qwen3 bf16 weights", cfg, res.tokens[0], res.logits[0], prompt, _hf_model(w), seed)


@pytest.mark.parametrize("name", ["tiny-llama-llama3", "tiny-qwen3"])
def test_batch_of_different_lengths_equals_each_alone(name):
    cfg = DECODER_CONFIGS[name]
    seed = 13
    w = random_weights(cfg, seed=seed, dtype=torch.float32)
    dec = ReferenceDecoder(w)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 11, 1, 6)]
    batch = dec.generate(prompts, NEW_TOKENS, block_size=8)
    for b, p in enumerate(prompts):
        alone = dec.generate([p], NEW_TOKENS, block_size=8)
        what = f"{name} seed={seed} sequence {b} prompt_len={len(p)}"
        assert batch.tokens[b] == alone.tokens[0], what
        scale = alone.logits[0].abs().max().item()
        torch.testing.assert_close(batch.logits[b], alone.logits[0], rtol=0, atol=1e-5 * scale,
                                   msg=lambda m: f"{what}: {m}")


def test_decoder_over_shuffled_block_table():
    """A non-contiguous, interleaved block table gives the same tokens and logits as contiguous."""
    cfg = get_preset("tiny-qwen3")
    seed = 21
    w = random_weights(cfg, seed=seed, dtype=torch.float32)
    dec = ReferenceDecoder(w)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 2)]
    bs, steps = 4, 16
    n_blocks = -(-(max(map(len, prompts)) + steps) // bs)
    table = torch.randperm(2 * n_blocks + 5, generator=gen)[: 2 * n_blocks].view(2, n_blocks).to(torch.int32)
    cache = PagedKVCache.allocate(cfg, 2 * n_blocks + 5, bs, dtype=torch.float32)
    shuffled = dec.generate(prompts, steps, cache=cache, block_table=table)
    plain = dec.generate(prompts, steps, block_size=bs)
    assert shuffled.tokens == plain.tokens, f"tiny-qwen3 seed={seed}"
    for b in range(2):
        torch.testing.assert_close(shuffled.logits[b], plain.logits[b], rtol=0, atol=1e-6)


def test_step_writes_kv_only_at_positions():
    cfg = get_preset("tiny-llama")
    w = random_weights(cfg, seed=4, dtype=torch.float32)
    table = contiguous_block_table(2, 32, 16)
    cache = PagedKVCache.allocate(cfg, table.numel(), 16, dtype=torch.float32)
    logits = ReferenceDecoder(w).step(torch.tensor([5, 9]), torch.tensor([0, 0]), cache, table)
    assert logits.shape == (2, cfg.vocab_size) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    written = ~torch.isnan(cache.k)
    assert written[:, 0, 0].all() and written[:, 2, 0].all()
    assert int(written.sum()) == 2 * cfg.num_layers * cfg.kv_size


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_random_weights_give_decisive_logits(preset):
    """Greedy parity tests need logits whose top two are rarely close; float32 op-order noise is
    ~1e-6 of the logit spread, far below the smallest gap allowed here."""
    cfg = get_preset(preset)
    w = random_weights(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist() for _ in range(4)]
    res = ReferenceDecoder(w).generate(prompts, 48)
    gaps = torch.cat([res.top2_gaps(b) / res.logits[b].std(dim=-1) for b in range(4)])
    assert gaps.min() > 1e-4, f"{preset} seed=0: smallest top-2 gap {gaps.min():.3g} logit std"
    assert gaps.median() > 0.05, f"{preset} seed=0: median top-2 gap {gaps.median():.3g} logit std"
    distinct = len({t for toks in res.tokens for t in toks})
    assert distinct > 48, f"{preset} seed=0: only {distinct} distinct tokens in 4 x 48 steps"
