"""Reference DeepSeek decoder vs transformers' DeepseekV3ForCausalLM (float32, CPU), and its parts:
absorbed MLA == naive MLA, router == DeepseekV3TopkRouter, rope/YaRN == transformers' rotary."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megakernel.model.deepseek import (
    DeepseekConfig,
    DeepseekReferenceDecoder,
    LatentKVCache,
    YarnScaling,
    contiguous_block_table,
    get_preset,
    mla_decode_absorbed,
    mla_decode_naive,
    random_weights,
    route,
    save_checkpoint,
)
from megakernel.model.deepseek.reference import apply_rope, rope_cos_sin, rope_inv_freq
from megakernel.model.deepseek.weights import interleaved_to_half_perm

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

NUM_NEW_TOKENS = 32
PROMPTS = [[5, 9, 100, 3, 7], [1, 2], [900, 800, 700, 600, 500, 400, 300, 200, 101]]
LOGIT_ATOL = 2e-4  # float32 both sides; summation order differs (absorbed vs expanded MLA, expert order)


# tiny torch ops on the CPU: one intra-op thread (the plugin's fixture)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _hf_config(cfg: DeepseekConfig, tmp_path):
    d = tmp_path / "hfcfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    return transformers.AutoConfig.from_pretrained(d)


# ---- MLA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,block_size,seq_lens", [(0, 4, [1, 7, 13]), (1, 16, [33, 2]), (2, 5, [5, 5, 9, 1])])
def test_absorbed_mla_equals_naive(seed, block_size, seq_lens):
    gen = torch.Generator().manual_seed(seed)
    n, nope, r, c, v = 4, 24, 8, 40, 20
    B = len(seq_lens)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = B * max_blocks + 3
    # a shuffled page table: pages of a sequence are scattered over the pool
    block_table = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    latent = torch.full((num_blocks, block_size, c + r), float("nan"))
    for b, length in enumerate(seq_lens):  # only valid slots hold data: a stray read gives NaN
        for p in range(length):
            latent[block_table[b, p // block_size], p % block_size] = torch.randn(c + r, generator=gen)
    q_nope = torch.randn(B, n, nope, generator=gen)
    q_rope = torch.randn(B, n, r, generator=gen)
    w_uk = torch.randn(n, nope, c, generator=gen) / c ** 0.5
    w_uv = torch.randn(n, v, c, generator=gen) / c ** 0.5
    lens = torch.tensor(seq_lens)
    got = mla_decode_absorbed(q_nope, q_rope, latent, block_table, lens, w_uk, w_uv, 0.3)
    want = mla_decode_naive(q_nope.double(), q_rope.double(), latent.double(), block_table, lens, w_uk.double(),
                            w_uv.double(), 0.3)
    assert got.shape == (B, n, v) and got.dtype == torch.float32
    assert torch.isfinite(got).all(), f"seed={seed} bs={block_size} lens={seq_lens}: NaN (read an unwritten slot?)"
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed} bs={block_size} lens={seq_lens}: {m}")


# ---- router -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(4, 2, 3, True), (1, 1, 2, True), (8, 3, 4, False)])
def test_router_matches_transformers(n_group, topk_group, top_k, norm, tmp_path):
    cfg = dataclasses.replace(get_preset("tiny-deepseek"), n_routed_experts=16, n_group=n_group,
                              topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=norm)
    gen = torch.Generator().manual_seed(7)
    T, H = 64, cfg.hidden_size
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(16, H, generator=gen) / H ** 0.5
    bias = 0.3 * torch.randn(16, generator=gen)  # large enough to change choices
    hf = hf_ds.DeepseekV3TopkRouter(_hf_config(cfg, tmp_path))
    with torch.no_grad():
        hf.weight.copy_(w)
        hf.e_score_correction_bias.copy_(bias)
        outs = hf(x)
    # 5.x returns (logits, weights, ids), 4.x (ids, weights)
    hf_ids = next(o for o in outs if o.dtype == torch.int64)
    hf_w = next(o for o in outs if o.is_floating_point() and o.shape == (T, top_k))
    weights, ids = route(x, w, bias, cfg)
    order_hf, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, order_hf)), f"n_group={n_group}: expert choice differs"
    torch.testing.assert_close(weights.gather(1, order), hf_w.gather(1, order_hf), atol=1e-6, rtol=1e-6)
    # the correction bias steers the choice only: weights are the unbiased sigmoid scores
    scores = torch.sigmoid(x @ w.T).gather(1, ids)
    expect = scores / scores.sum(-1, keepdim=True) if norm else scores
    torch.testing.assert_close(weights, expect * cfg.routed_scaling_factor, atol=1e-5, rtol=1e-5)
    no_bias_ids = route(x, w, torch.zeros(16), cfg)[1]
    assert not torch.equal(no_bias_ids.sort(-1)[0], ids.sort(-1)[0]), "bias had no effect on the choice"
    if n_group > 1:  # every chosen expert lies in one of topk_group groups
        assert ((ids // (16 // n_group)).unique(dim=None).numel() <= n_group)
        assert all(len(set((row // (16 // n_group)).tolist())) <= topk_group for row in ids)


# ---- rope / YaRN --------------------------------------------------------------------------------

YARNS = [
    None,
    YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=1.0),  # Kimi-K2
    YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3
    YarnScaling(factor=8.0, original_max_position_embeddings=512, mscale=0.9, mscale_all_dim=0.7),
    YarnScaling(factor=4.0, original_max_position_embeddings=1024),
]


@pytest.mark.parametrize("yarn", YARNS, ids=["none", "kimi", "dsv3", "mscale", "bare"])
def test_rope_and_scales_match_transformers(yarn, tmp_path):
    base = get_preset("tiny-deepseek")
    max_pos = int(yarn.factor * yarn.original_max_position_embeddings) if yarn else base.max_position_embeddings
    cfg = dataclasses.replace(base, qk_rope_head_dim=64, rope_scaling=yarn, max_position_embeddings=max_pos)
    hf_cfg = _hf_config(cfg, tmp_path)
    rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg)
    attn = hf_ds.DeepseekV3Attention(hf_cfg, layer_idx=0)
    torch.testing.assert_close(rope_inv_freq(cfg), rotary.inv_freq, atol=0, rtol=0)
    assert cfg.rope_attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    # our rotate-half rope on rope rows permuted to half order == transformers' interleaved rope
    gen = torch.Generator().manual_seed(3)
    pos = torch.tensor([0, 5, 77, 1000])
    q, k = torch.randn(4, 3, 64, generator=gen), torch.randn(4, 1, 64, generator=gen)
    cos_hf, sin_hf = rotary(q, pos[None])
    hq, hk = hf_ds.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  cos_hf, sin_hf)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, cfg.rope_attention_factor)
    perm = interleaved_to_half_perm(64)
    torch.testing.assert_close(apply_rope(q[..., perm], cos, sin), hq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(k[..., perm], cos, sin), hk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


# ---- whole decoder vs transformers --------------------------------------------------------------

PARITY_CONFIGS = {
    # no q LoRA, one group, interleaved rope
    "tiny-deepseek": get_preset("tiny-deepseek"),
    # q LoRA, n_group 4 / topk_group 2, YaRN (mscale == mscale_all_dim)
    "tiny-deepseek-qlora": get_preset("tiny-deepseek-qlora"),
    # rotate-half checkpoint rope, YaRN with mscale != mscale_all_dim, no renormalisation, tied embeddings,
    # a large rms_norm_eps (the latent norms must keep eps 1e-6)
    "tiny-variant": dataclasses.replace(
        get_preset("tiny-deepseek"), rope_interleave=False, norm_topk_prob=False, tie_word_embeddings=True,
        n_group=2, topk_group=1, first_k_dense_replace=2, rms_norm_eps=0.1,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512, mscale=0.9, mscale_all_dim=0.7),
    ),
}


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_greedy_matches_transformers(name, tmp_path):
    cfg = PARITY_CONFIGS[name]
    seed = 1
    weights = random_weights(cfg, seed=seed, dtype=torch.float32)
    save_checkpoint(tmp_path, weights)
    model = DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    res = DeepseekReferenceDecoder(weights).generate(PROMPTS, NUM_NEW_TOKENS, block_size=8)
    for b, (prompt, toks, logits) in enumerate(zip(PROMPTS, res.tokens, res.logits)):
        assert len(toks) == NUM_NEW_TOKENS and logits.shape == (NUM_NEW_TOKENS, cfg.vocab_size)
        # one transformers forward over prompt + our tokens gives the logits behind every pick
        with torch.no_grad():
            hf = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : len(prompt) - 1 + NUM_NEW_TOKENS]
        err = (logits - hf).abs().max().item()
        assert err < LOGIT_ATOL, f"{name} seed={seed} seq {b} (prompt len {len(prompt)}): max |logit diff| {err}"
        hf_picks = hf.argmax(-1).tolist()
        if hf_picks != toks:
            step = next(i for i, (x, y) in enumerate(zip(hf_picks, toks)) if x != y)
            top2 = logits[step].topk(2).values
            pytest.fail(f"{name} seed={seed} seq {b}: greedy diverges at step {step} "
                        f"(ours {toks[step]}, transformers {hf_picks[step]}, our top-2 gap {top2[0] - top2[1]:.2e})")
    # transformers' own greedy generate (its KV cache path) on the longest prompt agrees too
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    out = model.generate(torch.tensor([PROMPTS[longest]]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                         min_new_tokens=NUM_NEW_TOKENS, pad_token_id=0)
    assert out[0, len(PROMPTS[longest]) :].tolist() == res.tokens[longest], f"{name}: generate() differs"


def test_naive_decoder_and_paged_cache(tmp_path):
    """The decoder with naive MLA gives the same logits; a scattered block table over a bigger pool
    gives the same logits as a contiguous one; only the slots of written positions are touched."""
    cfg = get_preset("tiny-deepseek-qlora")
    weights = random_weights(cfg, seed=9, dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    B, steps, bs = 3, 11, 4
    tokens = torch.randint(0, cfg.vocab_size, (steps, B), generator=gen)
    nb = -(-steps // bs)
    contiguous = contiguous_block_table(B, steps, bs)
    scattered = torch.randperm(B * nb + 5, generator=gen)[: B * nb].view(B, nb).to(torch.int32)
    runs = {}
    for label, attention, table in [("absorbed", "absorbed", contiguous), ("naive", "naive", contiguous),
                                    ("scattered", "absorbed", scattered)]:
        dec = DeepseekReferenceDecoder(weights, attention=attention)
        cache = LatentKVCache.allocate(cfg, B * nb + 5, bs, dtype=torch.float32)
        runs[label] = torch.stack([dec.step(tokens[t], torch.full((B,), t), cache, table) for t in range(steps)])
        used = torch.zeros(cache.num_blocks, bs, dtype=torch.bool)
        for b in range(B):
            for p in range(steps):
                used[table[b, p // bs], p % bs] = True
        assert torch.isfinite(cache.latent[:, used]).all(), f"{label}: a written slot holds NaN"
        assert torch.isnan(cache.latent[:, ~used]).all(), f"{label}: a slot outside the written positions changed"
    torch.testing.assert_close(runs["naive"], runs["absorbed"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(runs["scattered"], runs["absorbed"], atol=0, rtol=0)
    # different positions per sequence in one batch == each sequence alone
    dec = DeepseekReferenceDecoder(weights)
    alone = dec.generate([[3, 4, 5, 6]], 5).logits[0]
    mixed = dec.generate([[7], [3, 4, 5, 6], [8, 9]], 5).logits[1]
    torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=1e-5)
