"""Kimi Linear reference decoder vs transformers' KimiLinearForCausalLM (float32, CPU; transformers runs
its pure-torch fallbacks there: chunk_kimi_delta_attention for prefill, recurrent_kimi_delta_attention and
causal_conv1d_update for one-token decode), and its KDA state against transformers' recurrent path."""

from __future__ import annotations

import pytest
import torch

from megakernel.model.deepseek import contiguous_block_table
from megakernel.model.kimi_linear import (
    KimiLinearCache,
    KimiLinearReferenceDecoder,
    get_preset,
    kda_recurrent_step,
    random_weights,
    save_checkpoint,
)
from megakernel.model.kimi_linear.reference import l2norm
from megakernel.testing.tolerances import assert_close

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kl  # noqa: E402

NUM_NEW_TOKENS = 32
PROMPTS = [[5, 9, 100, 3, 7], [1, 2], [300, 200, 101, 42, 17, 8, 250, 99, 64]]
TINY = ["tiny-kimi-linear", "tiny-kimi-linear-qlora"]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _model(weights, tmp_path) -> KimiLinearForCausalLM:
    save_checkpoint(tmp_path, weights)
    return KimiLinearForCausalLM.from_pretrained(tmp_path).float().eval()


@pytest.mark.parametrize("name", TINY)
def test_greedy_matches_transformers(name, tmp_path):
    cfg, seed = get_preset(name), 1
    weights = random_weights(cfg, seed=seed, dtype=torch.float32)
    model = _model(weights, tmp_path)
    res = KimiLinearReferenceDecoder(weights).generate(PROMPTS, NUM_NEW_TOKENS, block_size=8)
    for b, (prompt, toks, logits) in enumerate(zip(PROMPTS, res.tokens, res.logits)):
        assert len(toks) == NUM_NEW_TOKENS and logits.shape == (NUM_NEW_TOKENS, cfg.vocab_size)
        with torch.no_grad():  # one forward over prompt + our picks: the logits behind every pick
            hf = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : len(prompt) - 1 + NUM_NEW_TOKENS]
        assert_close(logits, hf, torch.float32, context=f"{name} seed={seed} seq {b} (prompt len {len(prompt)})")
        hf_picks = hf.argmax(-1).tolist()
        if hf_picks != toks:
            step = next(i for i, (x, y) in enumerate(zip(hf_picks, toks)) if x != y)
            pytest.fail(f"{name} seed={seed} seq {b}: greedy diverges at step {step} "
                        f"(ours {toks[step]}, transformers {hf_picks[step]})")
    # transformers' own generate (prefill with the chunked KDA, then its recurrent one-token path)
    for b in (0, 2):
        out = model.generate(torch.tensor([PROMPTS[b]]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                             min_new_tokens=NUM_NEW_TOKENS, pad_token_id=0)
        assert out[0, len(PROMPTS[b]) :].tolist() == res.tokens[b], f"{name} seed={seed} seq {b}: generate() differs"


@pytest.mark.parametrize("name", TINY)
def test_batch_equals_each_sequence_alone(name):
    seed = 4
    weights = random_weights(get_preset(name), seed=seed, dtype=torch.float32)
    dec = KimiLinearReferenceDecoder(weights)
    batch = dec.generate(PROMPTS, 12, block_size=4)
    for b, prompt in enumerate(PROMPTS):
        alone = dec.generate([prompt], 12, block_size=16)
        assert batch.tokens[b] == alone.tokens[0], f"{name} seed={seed} seq {b}: batched tokens differ from alone"
        assert_close(batch.logits[b], alone.logits[0], torch.float32,
                     context=f"{name} seed={seed} seq {b} batch vs alone")


def test_paged_cache_slots_and_naive_mla():
    """Scattered pages and permuted KDA slots give the same logits; naive MLA agrees with absorbed; only the
    written latent slots are touched."""
    cfg, seed = get_preset("tiny-kimi-linear-qlora"), 9
    weights = random_weights(cfg, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    B, steps, bs = 3, 10, 4
    tokens = torch.randint(0, cfg.vocab_size, (steps, B), generator=gen)
    nb = -(-steps // bs)
    layouts = {
        "contiguous": (contiguous_block_table(B, steps, bs), torch.arange(B), "absorbed"),
        "scattered": (torch.randperm(B * nb + 5, generator=gen)[: B * nb].view(B, nb).to(torch.int32),
                      torch.tensor([4, 0, 2]), "absorbed"),
        "naive": (contiguous_block_table(B, steps, bs), torch.arange(B), "naive"),
    }
    runs = {}
    for label, (table, slots, attention) in layouts.items():
        dec = KimiLinearReferenceDecoder(weights, attention=attention)
        cache = KimiLinearCache.allocate(cfg, 5, B * nb + 5, bs)
        runs[label] = torch.stack([dec.step(tokens[t], torch.full((B,), t), cache, table, slots) for t in range(steps)])
        used = torch.zeros(B * nb + 5, bs, dtype=torch.bool)
        for b in range(B):
            for p in range(steps):
                used[table[b, p // bs], p % bs] = True
        lat = cache.latent.latent
        assert torch.isfinite(lat[:, used]).all() and torch.isnan(lat[:, ~used]).all(), f"{label} seed={seed}"
        unused = sorted(set(range(5)) - set(slots.tolist()))
        assert (cache.kda.recurrent[:, unused] == 0).all(), f"{label} seed={seed}: an unused KDA slot changed"
    torch.testing.assert_close(runs["scattered"], runs["contiguous"], atol=0, rtol=0)
    assert_close(runs["naive"], runs["contiguous"], torch.float32, context=f"naive vs absorbed MLA seed={seed}")


@pytest.mark.parametrize("seed", [0, 1])
def test_kda_recurrence_matches_transformers_recurrent_kernel(seed):
    """kda_recurrent_step token by token == transformers' recurrent_kimi_delta_attention (its CPU fallback),
    state after every token included, and both == a float64 run of the same recurrence."""
    gen = torch.Generator().manual_seed(seed)
    B, T, nh, dk = 2, 9, 3, 16
    q, k, v = (torch.randn(B, T, nh, dk, generator=gen) for _ in range(3))
    g = -torch.rand(B, T, nh, dk, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(B, T, nh, generator=gen)
    s0 = 0.1 * torch.randn(B, nh, dk, dk, generator=gen)
    state, state64, hf_state = s0.clone(), s0.double(), s0.clone()
    for t in range(T):
        qt, kt = l2norm(q[:, t]) * dk ** -0.5, l2norm(k[:, t])
        o, state = kda_recurrent_step(state, qt, kt, v[:, t], g[:, t], beta[:, t])
        o64, state64 = kda_recurrent_step(state64, qt.double(), kt.double(), v[:, t].double(), g[:, t].double(),
                                          beta[:, t].double())
        hf_o, hf_state = hf_kl.recurrent_kimi_delta_attention(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1],
            initial_state=hf_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ctx = f"seed={seed} token {t}"
        assert_close(o, hf_o[:, 0], torch.float32, context=f"{ctx} output vs transformers")
        assert_close(state, hf_state, torch.float32, context=f"{ctx} state vs transformers")
        assert_close(state, state64, torch.float32, context=f"{ctx} state vs float64")
    # transformers' whole-sequence recurrent call ends in the same state
    _, hf_final = hf_kl.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    assert_close(state, hf_final, torch.float32, context=f"seed={seed} final state vs one recurrent call")


@pytest.mark.parametrize("name", TINY)
def test_kda_layer_state_matches_transformers_cache(name, tmp_path):
    """A KDA layer fed token by token: its output, recurrent state and conv inputs equal transformers'
    KimiLinearDeltaAttention over a DynamicCache (a 3-token prefill, then one-token decode steps)."""
    cfg, seed = get_preset(name), 2
    weights = random_weights(cfg, seed=seed, dtype=torch.float32)
    model = _model(weights, tmp_path)
    layer = cfg.kda_layers[-1]
    row = cfg.kda_layers.index(layer)
    hf_attn = model.model.layers[layer].self_attn
    dec = KimiLinearReferenceDecoder(weights)
    gen = torch.Generator().manual_seed(seed)
    B, T, prefill = 2, 8, 3
    x = torch.randn(B, T, cfg.hidden_size, generator=gen)
    cache = KimiLinearCache.allocate(cfg, B, 1, 1)
    hf_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        hf_out = [hf_attn(hidden_states=x[:, :prefill], cache=hf_cache)]
        for t in range(prefill, T):
            hf_out.append(hf_attn(hidden_states=x[:, t : t + 1], cache=hf_cache))
    hf_out = torch.cat(hf_out, dim=1)
    ours = [dec._kda(row, weights.layers[layer].kda, x[:, t], cache.kda, torch.arange(B)) for t in range(T)]
    assert_close(torch.stack(ours, dim=1), hf_out, torch.float32, context=f"{name} seed={seed} layer {layer} output")
    hf_layer = hf_cache.layers[layer]
    assert_close(cache.kda.recurrent[row], hf_layer.recurrent_states[0], torch.float32,
                 context=f"{name} seed={seed} layer {layer} recurrent state [B, nh, dk, dv]")
    km1 = cfg.conv_state_len
    assert_close(cache.kda.conv[row], hf_layer.conv_states[0][..., -km1:], torch.float32,
                 context=f"{name} seed={seed} layer {layer} conv inputs (last K-1)")
