"""The plain torch baselines, the backend registry, `generate` and the read floor, against the reference."""

from __future__ import annotations

import pytest
import torch

from megakernel.integrations import backends as bk
from megakernel.integrations.floor import floor_ms, kv_read_bytes
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.testing.tolerances import assert_close

PRESETS = ("tiny-llama", "tiny-qwen3")
PROMPT_LENS = (5, 1, 9)        # a batch of different lengths, one of a single token
NEW_TOKENS = 10


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _reference(weights, prompts):
    return ReferenceDecoder(weights).generate(prompts, NEW_TOKENS, return_logits=True)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("backend", ["torch-eager", "reference"])
def test_generate_matches_reference_decoder(preset, backend, seeded_weights):
    """`generate` (right-aligned prefill) through each CPU backend == ReferenceDecoder.generate (its own loop)."""
    seed = 1000 + PRESETS.index(preset)
    weights = seeded_weights(preset, seed=seed, dtype=torch.float32)
    prompts = _prompts(weights.config.vocab_size, seed)
    ref = _reference(weights, prompts)
    out = bk.generate(bk.get_backend(backend, weights, "cpu"), prompts, NEW_TOKENS, keep_logits=True)
    for b in range(len(prompts)):
        ctx = f"{backend} vs reference, preset={preset} seed={seed} float32 seq={b} prompt_len={PROMPT_LENS[b]}"
        assert out.tokens[b] == ref.tokens[b], f"{ctx}: top-2 gaps {ref.top2_gaps(b).tolist()}"
        assert_close(out.logits[b], ref.logits[b], torch.float32, context=ctx)
    assert len(out.step_ms) == max(PROMPT_LENS) - 1 + NEW_TOKENS
    assert out.prefill_steps == max(PROMPT_LENS) - 1
    assert out.tokens_per_s == pytest.approx(len(prompts) * 1e3 / out.median_decode_ms)


@pytest.mark.parametrize("preset", PRESETS)
def test_torch_eager_step_matches_reference_step(preset, seeded_weights):
    """One step at scattered positions after a shared history: logits and argmax equal the reference's."""
    seed = 77
    weights = seeded_weights(preset, seed=seed, dtype=torch.float32)
    cfg = weights.config
    gen = torch.Generator().manual_seed(seed)
    batch, history = 3, 20
    eager = bk.get_backend("torch-eager", weights, "cpu")
    ref = bk.get_backend("reference", weights, "cpu")
    for backend in (eager, ref):
        backend.reset(batch, history + 1)
    tokens = torch.randint(0, cfg.vocab_size, (history + 1, batch), generator=gen)
    for pos in range(history):   # fill the caches identically
        positions = torch.full((batch,), pos, dtype=torch.long)
        eager.step(tokens[pos], positions)
        ref.step(tokens[pos], positions)
    positions = torch.tensor([0, history // 2, history])      # each sequence at its own position
    got = eager.step(tokens[history], positions)
    want = ref.step(tokens[history], positions)
    ctx = f"preset={preset} seed={seed} float32 batch={batch} positions={positions.tolist()}"
    assert_close(eager.last_logits(), ref.last_logits(), torch.float32, context=ctx)
    assert got.tolist() == want.tolist(), ctx


@pytest.mark.slow
def test_compiled_step_matches_eager_on_cpu(seeded_weights):
    """The step the torch-compile backend captures traces as one graph (fullgraph=True) and keeps
    writing the KV cache in place: 4 compiled steps give the eager step's tokens and logits."""
    from megakernel.integrations.torch_baselines import TorchDecodeStep

    seed = 31
    weights = seeded_weights("tiny-qwen3", seed=seed, dtype=torch.float32)
    eager = TorchDecodeStep(weights, "cpu")
    compiled = TorchDecodeStep(weights, "cpu")
    for s in (eager, compiled):
        s.reset(2, 8)
    forward = torch.compile(compiled._forward, fullgraph=True)
    tokens = torch.randint(0, weights.config.vocab_size, (2,), generator=torch.Generator().manual_seed(seed))
    got_tokens = want_tokens = tokens
    for pos in range(4):
        positions = torch.tensor([pos, pos + 3])
        got_tokens, got_logits = forward(got_tokens, positions)
        want_tokens = eager.step(want_tokens, positions)
        ctx = f"tiny-qwen3 seed={seed} float32 step {pos}"
        assert_close(got_logits, eager.last_logits(), torch.float32, context=ctx)
        assert got_tokens.tolist() == want_tokens.tolist(), ctx


@pytest.mark.parametrize("name", ["torch-graph", "torch-compile", "megakernel"])
def test_gpu_backends_refuse_cpu_clearly(name, seeded_weights):
    weights = seeded_weights("tiny-llama", seed=5)
    with pytest.raises(bk.BackendUnavailable, match="CUDA"):
        bk.get_backend(name, weights, "cpu")


def test_torch_graph_mode_refuses_cpu_device(seeded_weights):
    from megakernel.integrations.torch_baselines import TorchDecodeStep

    with pytest.raises(bk.BackendUnavailable, match="needs a CUDA device"):
        TorchDecodeStep(seeded_weights("tiny-llama", seed=6), "cpu", mode="graph")


def test_unknown_backend_lists_the_names(seeded_weights):
    with pytest.raises(ValueError, match="torch-eager"):
        bk.get_backend("cublas", seeded_weights("tiny-llama", seed=8), "cpu")


def test_generate_rejects_bad_input(seeded_weights):
    backend = bk.get_backend("reference", seeded_weights("tiny-llama", seed=9), "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        bk.generate(backend, [[1], []], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        bk.generate(backend, [[1]], 0)


def test_available_backends_on_cpu():
    assert bk.available_backends("cpu") == ["reference", "torch-eager"]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["torch-eager", "torch-graph", "torch-compile"])
def test_gpu_baselines_match_reference(name, preset, seeded_weights, cuda_device):
    """float32 on the GPU (no TF32 in matmuls by default): the same tokens as the CPU reference."""
    seed = 2000 + PRESETS.index(preset)
    weights = seeded_weights(preset, seed=seed, dtype=torch.float32)
    prompts = _prompts(weights.config.vocab_size, seed)
    ref = _reference(weights, prompts)
    out = bk.generate(bk.get_backend(name, weights, cuda_device), prompts, NEW_TOKENS, keep_logits=True)
    for b in range(len(prompts)):
        ctx = f"{name} on {cuda_device}, preset={preset} seed={seed} float32 seq={b}"
        assert out.tokens[b] == ref.tokens[b], f"{ctx}: top-2 gaps {ref.top2_gaps(b).tolist()}"
        assert_close(out.logits[b], ref.logits[b], torch.float32, context=ctx)


# -- the read floor ------------------------------------------------------------------------------------

def _llama_3_2_1b_bytes() -> int:
    """Counted by hand from the published shape: 16 layers of hidden 2048, 32/8 heads of 64, ffn 8192,
    a tied 128256 x 2048 head (read once), norms included; bf16."""
    h, f, layers, vocab = 2048, 8192, 16, 128256
    per_layer = (2048 + 2 * 512) * h + h * 2048 + 2 * f * h + h * f + 2 * h
    return 2 * (layers * per_layer + h + vocab * h)


def test_floor_of_llama_3_2_1b():
    cfg = get_preset("llama-3.2-1b")
    bandwidth = 4.32e12               # BASELINES.md: pure read on the H200
    expected = _llama_3_2_1b_bytes() / bandwidth * 1e3
    assert floor_ms(cfg, 1, bandwidth) == pytest.approx(expected, rel=1e-12)
    assert floor_ms(cfg, 1, bandwidth) == pytest.approx(0.57, abs=0.005)   # the figure BASELINES.md quotes
    # KV: batch 4 at 1000 tokens reads 4 * 1000 * 16 layers * (K and V) * 512 values * 2 bytes more.
    kv = 4 * 1000 * 16 * 2 * 512 * 2
    assert kv_read_bytes(cfg, 4, 1000) == kv
    assert floor_ms(cfg, 4, bandwidth, context_len=1000) == pytest.approx((_llama_3_2_1b_bytes() + kv)
                                                                          / bandwidth * 1e3, rel=1e-12)


def test_floor_rejects_bad_arguments():
    cfg = get_preset("tiny-llama")
    with pytest.raises(ValueError, match="bandwidth"):
        floor_ms(cfg, 1, 0.0)
    with pytest.raises(ValueError, match="batch"):
        floor_ms(cfg, 0, 1e12)


def test_measure_read_bandwidth_divides_bytes_by_the_median_time(monkeypatch):
    """On the CPU each read is timed between two perf_counter calls: with a clock that advances 0.5 s
    per call, every read takes 0.5 s, so the result must be nbytes / 0.5 exactly."""
    import megakernel.integrations.floor as floor_mod

    ticks = iter(range(10_000))
    monkeypatch.setattr(floor_mod.time, "perf_counter", lambda: 0.5 * next(ticks))
    nbytes = 3 << 20
    assert floor_mod.measure_read_bandwidth(nbytes, device="cpu", repeats=5, warmup=1) == nbytes / 0.5
    with pytest.raises(ValueError, match="repeats"):
        floor_mod.measure_read_bandwidth(nbytes, device="cpu", repeats=0)
