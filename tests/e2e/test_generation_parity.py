"""Greedy generation, end to end: a checkpoint written by transformers' `save_pretrained`, loaded through
megakernel.model.weights.load_checkpoint, decoded by transformers' own `generate` (float32) and by ours: the
instruction VM on the CPU, the megakernel on a GPU.

Judging a divergence (house style, rule 4): the tokens must be identical, except that the first step where
they part ways may be one where the reference's top-2 logit gap is below the tolerance; comparison stops
there (the contexts differ after it), and, as vLLM's check_logprobs_close asks, each side's token must be in
the other's top-k. While the tokens agree, the log-probabilities of the reference's top-k tokens agree.
Past a divergence, transformers is run teacher-forced on our own tokens (one forward over the prompt and
them), and every step must be its greedy choice on that context, up to a near-tie, with close logprobs.

The weights are the project's seeded random weights (their default init keeps logits decisive: see
random_weights), rounded to bf16, so the GPU reads exactly what transformers computes with in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from megakernel.integrations.backends import generate, get_backend
from megakernel.model.config import ModelConfig
from megakernel.model.kv_cache import contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.weights import ModelWeights, load_checkpoint, random_weights, to_hf_state_dict
from megakernel.schedule.vm import VMDecoder
from megakernel.testing.strategies import ModelAxes, model_axes, seeds
from megakernel.testing.tolerances import GreedyTolerance, assert_close, greedy_tolerance_for

pytestmark = pytest.mark.e2e

GPU = "cuda"
CPU_STEPS = 32
GPU_STEPS = 128
PROMPT_LENS = (1, 5, 9)


def _shape(name: str, num_layers: int | None = None) -> ModelConfig:
    config = get_preset(name)
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers, name=f"{name}-L{num_layers}")
    return config


# ---- the checkpoint and transformers' side ----------------------------------------------------------------

def _hf_classes(architecture: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {"LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
            "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM)}[architecture]


def _skip_weight_init():
    try:                                   # transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:
        try:                               # transformers 4.56+
            from transformers.modeling_utils import no_init_weights
        except ImportError:                # neither: draw the initial weights after all (slower)
            return contextlib.nullcontext()
    return no_init_weights()


@dataclass
class Checkpoint:
    config: ModelConfig
    seed: int
    path: Path
    model: torch.nn.Module          # transformers, float32, eval mode
    weights: ModelWeights           # what was saved (float32, bf16-representable)


def write_checkpoint(config: ModelConfig, seed: int, path: Path, device: str = "cpu") -> Checkpoint:
    """transformers' model built from the config dict, our random weights loaded into it, save_pretrained."""
    weights = random_weights(config, seed=seed, dtype=torch.bfloat16).to(dtype=torch.float32)
    config_cls, model_cls = _hf_classes(config.architecture)
    hf_config = config_cls.from_dict(config.to_hf_config())
    hf_config._attn_implementation = "eager"
    with _skip_weight_init():      # the weights are overwritten next; drawing transformers' own costs seconds
        model = model_cls(hf_config).eval()
    model.load_state_dict(to_hf_state_dict(weights), strict=True)
    model.tie_weights()
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None      # random tokens must not stop generation early
    model.generation_config.pad_token_id = 0
    return Checkpoint(config, seed, path, model.to(device), weights)


def load_and_check(ckpt: Checkpoint, dtype: torch.dtype, device: str = "cpu") -> ModelWeights:
    """load_checkpoint gives back the same model and, exactly, the same weights."""
    loaded = load_checkpoint(ckpt.path, dtype=dtype, device=device)
    what = f"{ckpt.config.name} seed={ckpt.seed} load_checkpoint({ckpt.path.name}, {dtype})"
    assert dataclasses.replace(loaded.config, name=ckpt.config.name) == ckpt.config, what
    assert (loaded.lm_head is loaded.embed) == ckpt.config.tie_word_embeddings, what
    for name, ours, saved in (("embed", loaded.embed, ckpt.weights.embed), ("qkv.0", loaded.layers[0].qkv,
                              ckpt.weights.layers[0].qkv), ("final_norm", loaded.final_norm, ckpt.weights.final_norm)):
        assert torch.equal(ours.float().cpu(), saved), f"{what}: {name} changed on the way"
    return loaded


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' generate, greedy, one prompt (no padding): new tokens and raw logits [steps, V] float32."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             num_beams=1, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == steps, f"transformers generate stopped after {len(tokens)} of {steps} tokens"
    return tokens, torch.stack(out.logits, dim=1)[0].float().cpu()


def hf_teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] float32 for each of our steps, on our own context: one forward
    over prompt + tokens[:-1]. Row t is what transformers would choose from where we chose tokens[t]."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
    return logits.float().cpu()


def _prompts(config: ModelConfig, seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lens]


# ---- the comparison -------------------------------------------------------------------------------------------

def check_greedy_parity(tokens: list[int], logits: torch.Tensor, ref_tokens: list[int], ref_logits: torch.Tensor,
                        tol: GreedyTolerance, what: str) -> int:
    """Tokens identical up to a near-tie divergence; logprobs close while they agree. Returns the steps compared."""
    assert len(tokens) == len(ref_tokens) == logits.shape[0] == ref_logits.shape[0], what
    assert not torch.isnan(logits).any(), f"{what}: NaN in the logits"
    lp = torch.log_softmax(logits.double(), dim=-1)
    ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
    for t, (mine, theirs) in enumerate(zip(tokens, ref_tokens)):
        top = ref_lp[t].topk(tol.top_k).indices
        torch.testing.assert_close(lp[t, top], ref_lp[t, top], atol=tol.logprob_atol, rtol=0,
                                   msg=lambda m: f"{what}: step {t} top-{tol.top_k} logprobs: {m}")
        if mine == theirs:
            continue
        top2 = ref_logits[t].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tol.near_tie_gap, (f"{what}: step {t}: token {mine}, reference {theirs}, whose top-2 logit gap "
                                        f"{gap:.4g} is not a near-tie (< {tol.near_tie_gap})")
        assert mine in top.tolist() and theirs in lp[t].topk(tol.top_k).indices.tolist(), \
            f"{what}: step {t}: tokens {mine} / {theirs} are not in each other's top-{tol.top_k}"
        return t
    return len(tokens)


def check_teacher_forced(tokens: list[int], logits: torch.Tensor, forced: torch.Tensor, tol: GreedyTolerance,
                         what: str) -> None:
    """Every step, past any near-tie divergence: our token is transformers' greedy choice on our own context
    (or a near-tie there), and the top-k log-probabilities agree."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    ref_lp = torch.log_softmax(forced.double(), dim=-1)
    for t, mine in enumerate(tokens):
        top = ref_lp[t].topk(tol.top_k).indices
        torch.testing.assert_close(lp[t, top], ref_lp[t, top], atol=tol.logprob_atol, rtol=0,
                                   msg=lambda m: f"{what}: teacher-forced step {t} top-{tol.top_k} logprobs: {m}")
        best = int(forced[t].argmax())
        gap = float(forced[t, best] - forced[t, mine])
        assert mine == best or gap < tol.near_tie_gap, \
            f"{what}: teacher-forced step {t}: token {mine}, transformers picks {best} by {gap:.4g}"


def _not_degenerate(tokens: list[list[int]], what: str) -> None:
    distinct = len({t for seq in tokens for t in seq})
    assert distinct >= 8, f"{what}: only {distinct} distinct tokens generated: a weak parity test {tokens}"


# ---- CPU: the instruction VM ------------------------------------------------------------------------------------

class VMBackend:
    """VMDecoder behind the DecodeBackend protocol, so integrations.backends.generate can drive it."""

    name = "vm"
    device = torch.device("cpu")

    def __init__(self, weights: ModelWeights, policy: str = "balanced", num_sms: int = 132, block_size: int = 16):
        self.weights, self.policy, self.num_sms, self.block_size = weights, policy, num_sms, block_size
        self._logits = None

    def reset(self, batch: int, max_seq_len: int) -> None:
        self.vm = VMDecoder(self.weights, batch, max_seq_len, block_size=self.block_size, num_sms=self.num_sms,
                            policy=self.policy)
        self.table = contiguous_block_table(batch, self.vm.layout.max_seq_len, self.block_size)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out, self._logits = self.vm.step(tokens, positions, self.table)
        return out.long()

    def last_logits(self) -> torch.Tensor | None:
        return self._logits




CPU_MODELS = {
    "tiny-llama": (lambda: _shape("tiny-llama"), "balanced"),
    "tiny-qwen3": (lambda: _shape("tiny-qwen3"), "round-robin"),
    # the real vocabulary and widths; one layer keeps the float32 checkpoint at 0.6 GB
    "qwen3-0.6b-L1": (lambda: _shape("qwen3-0.6b", 1), "balanced"),
}


@pytest.mark.parametrize("name", sorted(CPU_MODELS))
def test_vm_matches_transformers_generate(name, tmp_path, one_cpu_thread):
    make, policy = CPU_MODELS[name]
    config = make()
    seed = 11 + sorted(CPU_MODELS).index(name)
    ckpt = write_checkpoint(config, seed, tmp_path / "ckpt")
    weights = load_and_check(ckpt, torch.float32)
    prompts = _prompts(config, seed, PROMPT_LENS if name.startswith("tiny") else (4, 9))
    out = generate(VMBackend(weights, policy=policy), prompts, CPU_STEPS, keep_logits=True)
    tol = greedy_tolerance_for(torch.float32)
    refs = [hf_greedy(ckpt.model, p, CPU_STEPS) for p in prompts]
    for b, (prompt, (ref_tokens, ref_logits)) in enumerate(zip(prompts, refs)):
        what = (f"VM ({policy}) vs transformers generate, {name} seed={seed} float32 sequence {b} "
                f"prompt_len={len(prompt)} steps={CPU_STEPS}")
        compared = check_greedy_parity(out.tokens[b], out.logits[b], ref_tokens, ref_logits, tol, what)
        assert compared == CPU_STEPS, f"{what}: float32 diverged at step {compared}"
        check_teacher_forced(out.tokens[b], out.logits[b], hf_teacher_forced(ckpt.model, prompt, out.tokens[b]),
                             tol, what)
    _not_degenerate([r[0] for r in refs], f"{name} seed={seed}")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_vm_over_bf16_weights_matches_transformers_within_bf16_tolerance(name, tmp_path, one_cpu_thread):
    """The VM over bf16 weights keeps a bf16 KV cache, as the megakernel does: the bf16 greedy tolerance the
    GPU tests use must hold for it too (divergences at near-ties, teacher-forced agreement everywhere)."""
    config = _shape(name)
    seed = 31 + list(GPU_MODELS).index(name)          # the checkpoints the GPU test uses
    ckpt = write_checkpoint(config, seed, tmp_path / "ckpt")
    weights = load_and_check(ckpt, torch.bfloat16)
    prompts = _prompts(config, seed)
    steps = 64
    out = generate(VMBackend(weights), prompts, steps, keep_logits=True)
    tol = greedy_tolerance_for(torch.bfloat16)
    for b, prompt in enumerate(prompts):
        what = f"VM (bf16 weights and KV cache) vs transformers generate, {name} seed={seed} sequence {b} steps={steps}"
        ref_tokens, ref_logits = hf_greedy(ckpt.model, prompt, steps)
        check_greedy_parity(out.tokens[b], out.logits[b], ref_tokens, ref_logits, tol, what)
        check_teacher_forced(out.tokens[b], out.logits[b], hf_teacher_forced(ckpt.model, prompt, out.tokens[b]),
                             tol, what)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_vm_batch_equals_each_sequence_alone(name, one_cpu_thread):
    config = _shape(name)
    seed = 21
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    prompts = _prompts(config, seed, (7, 2, 12))
    batch = generate(VMBackend(weights), prompts, CPU_STEPS, keep_logits=True)
    tol = greedy_tolerance_for(torch.float32)
    for b, prompt in enumerate(prompts):
        alone = generate(VMBackend(weights), [prompt], CPU_STEPS, keep_logits=True)
        what = f"VM batch vs alone, {name} seed={seed} float32 sequence {b} prompt_len={len(prompt)}"
        assert check_greedy_parity(batch.tokens[b], batch.logits[b], alone.tokens[0], alone.logits[0], tol,
                                   what) == CPU_STEPS, what
        assert_close(batch.logits[b], alone.logits[0], torch.float32, context=what)


# ---- drawn model axes (the fields real checkpoints vary), on the tiny-llama layer shapes ----------------------

# Each example writes and reloads a checkpoint and runs transformers' generate: a few per run unless a long profile
# was asked for (fuzz).
AXES = model_axes(max_vocab=2048, min_vocab=264)
AXES_EXAMPLES = max(1, min(settings.default.max_examples, 6)) if settings.default.max_examples < 1000 \
    else settings.default.max_examples
AXES_STEPS = 24


def check_parity_on_drawn_axes(axes: ModelAxes, seed: int, make_backend, dtype: torch.dtype, device: str,
                               what: str) -> None:
    """tiny-llama's layer shapes with the drawn axes: a checkpoint saved by transformers, loaded as `dtype`,
    decoded greedily by make_backend(weights) and by transformers' generate; tokens and logprobs within
    `dtype`'s greedy tolerance, teacher-forced agreement past any near-tie."""
    config = dataclasses.replace(axes.apply(_shape("tiny-llama")), name="tiny-llama-axes")
    what = f"{what}, {axes} seed={seed}"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(config, seed, Path(tmp) / "ckpt", device=device)
        weights = load_and_check(ckpt, dtype, device=device)
        prompts = _prompts(config, seed)
        out = generate(make_backend(weights), prompts, AXES_STEPS, keep_logits=True)
        tol = greedy_tolerance_for(dtype)
        refs = [hf_greedy(ckpt.model, p, AXES_STEPS) for p in prompts]
        for b, (prompt, (ref_tokens, ref_logits)) in enumerate(zip(prompts, refs)):
            seq = f"{what} sequence {b} prompt_len={len(prompt)}"
            check_greedy_parity(out.tokens[b], out.logits[b], ref_tokens, ref_logits, tol, seq)
            check_teacher_forced(out.tokens[b], out.logits[b], hf_teacher_forced(ckpt.model, prompt, out.tokens[b]),
                                 tol, seq)
        _not_degenerate([r[0] for r in refs], what)


@pytest.mark.usefixtures("one_cpu_thread")
@settings(max_examples=AXES_EXAMPLES)
@given(axes=AXES, seed=seeds())
def test_vm_matches_transformers_generate_on_drawn_model_axes(axes, seed):
    check_parity_on_drawn_axes(axes, seed, VMBackend, torch.float32, "cpu", "VM vs transformers generate, float32")


# ---- GPU: the megakernel -----------------------------------------------------------------------------------------

GPU_MODELS = {
    "tiny-llama": lambda: _shape("tiny-llama"),
    "tiny-qwen3": lambda: _shape("tiny-qwen3"),
    "llama-3.2-1b-L2": lambda: _shape("llama-3.2-1b", 2),
    "qwen3-0.6b-L2": lambda: _shape("qwen3-0.6b", 2),
}
# ... and for the batch == alone test also llama-3.1-8b's widths (at batch 8 the larger staging budget,
# megakernel.kernel.stream.staging_budget), which the transformers comparison over GPU_MODELS leaves out
ALONE_MODELS = {**GPU_MODELS, "llama-3.1-8b-L2": lambda: _shape("llama-3.1-8b", 2)}


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_megakernel_matches_transformers_generate(name, tmp_path):
    config = GPU_MODELS[name]()
    seed = 31 + list(GPU_MODELS).index(name)
    ckpt = write_checkpoint(config, seed, tmp_path / "ckpt", device=GPU)
    weights = load_and_check(ckpt, torch.bfloat16, device=GPU)
    prompts = _prompts(config, seed)
    backend = get_backend("megakernel", weights, GPU)
    try:
        out = generate(backend, prompts, GPU_STEPS, keep_logits=True)
        backend.check()
        refs = [hf_greedy(ckpt.model, p, GPU_STEPS) for p in prompts]
        tol = greedy_tolerance_for(torch.bfloat16)
        for b, (prompt, (ref_tokens, ref_logits)) in enumerate(zip(prompts, refs)):
            what = (f"megakernel vs transformers generate (float32, cuda), {name} seed={seed} bf16 weights and "
                    f"KV cache, sequence {b} prompt_len={len(prompt)} steps={GPU_STEPS}")
            check_greedy_parity(out.tokens[b], out.logits[b], ref_tokens, ref_logits, tol, what)
            forced = hf_teacher_forced(ckpt.model, prompt, out.tokens[b])
            check_teacher_forced(out.tokens[b], out.logits[b], forced, tol, what)
        _not_degenerate([r[0] for r in refs], f"{name} seed={seed}")
    finally:
        del backend, ckpt
        _free_gpu()


# Batches past SPLIT_BATCH run the wide consumers (row-group owners, bf16 inputs) and, on the real widths, the
# matvecs split over K with MV_REDUCE; sequences of different prompt lengths (1-12) in one batch.
@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name,batch", [("tiny-qwen3", 3), ("llama-3.2-1b-L2", 3), ("llama-3.2-1b-L2", 16),
                                        ("qwen3-0.6b-L2", 16), ("llama-3.2-1b-L2", 32), ("tiny-llama", 64),
                                        ("qwen3-0.6b-L2", 20), ("tiny-llama", 41), ("llama-3.1-8b-L2", 8)])
def test_megakernel_batch_equals_each_sequence_alone(name, batch):
    config = ALONE_MODELS[name]()
    seed = 41
    weights = random_weights(config, seed=seed, dtype=torch.bfloat16, device=GPU)
    prompts = _prompts(config, seed, (7, 2, 12) if batch == 3 else [1 + (5 * b) % 12 for b in range(batch)])
    backend = get_backend("megakernel", weights, GPU)
    try:
        batch = generate(backend, prompts, GPU_STEPS, keep_logits=True)
        backend.check()
        # each alone runs a batch-1 kernel (other tiles and KV splits): bf16 rounding may differ
        tol = greedy_tolerance_for(torch.bfloat16)
        for b, prompt in enumerate(prompts):
            alone = generate(backend, [prompt], GPU_STEPS, keep_logits=True)
            backend.check()
            what = (f"megakernel batch of {batch} vs alone, {name} seed={seed} bf16 sequence {b} "
                    f"prompt_len={len(prompt)}")
            check_greedy_parity(batch.tokens[b], batch.logits[b], alone.tokens[0], alone.logits[0], tol, what)
    finally:
        del backend
        _free_gpu()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name", ["tiny-llama", "llama-3.2-1b-L2"])
def test_megakernel_is_deterministic(name):
    """Two runs (the second on the same engine, at a later counter epoch) give bit-identical logits."""
    config = GPU_MODELS[name]()
    seed = 51
    weights = random_weights(config, seed=seed, dtype=torch.bfloat16, device=GPU)
    prompts = _prompts(config, seed)
    backend = get_backend("megakernel", weights, GPU)
    try:
        first = generate(backend, prompts, GPU_STEPS, keep_logits=True)
        second = generate(backend, prompts, GPU_STEPS, keep_logits=True)
        backend.check()
        what = f"megakernel run twice, {name} seed={seed} bf16 batch={len(prompts)} steps={GPU_STEPS}"
        assert first.tokens == second.tokens, what
        for b in range(len(prompts)):
            assert not torch.isnan(first.logits[b]).any(), f"{what}: NaN logits, sequence {b}"
            differ = (first.logits[b] != second.logits[b]).nonzero()
            assert differ.numel() == 0, f"{what}: sequence {b} logits differ at (step, token) {differ[:4].tolist()}"
    finally:
        del backend
        _free_gpu()


@pytest.mark.gpu
@pytest.mark.hopper
def test_megakernel_float32_weights_are_cast_or_refused():
    config = GPU_MODELS["tiny-llama"]()
    seed = 61
    bf16 = random_weights(config, seed=seed, dtype=torch.bfloat16, device=GPU)
    prompts = _prompts(config, seed)
    what = f"megakernel, tiny-llama seed={seed}: float32 weights (bf16-representable) vs the same in bf16"
    backend = get_backend("megakernel", bf16, GPU)
    try:
        expected = generate(backend, prompts, 16).tokens
        try:
            f32_backend = get_backend("megakernel", bf16.to(dtype=torch.float32), GPU)
            got = generate(f32_backend, prompts, 16).tokens
        except (ValueError, TypeError):
            return                                  # refused up front: fine
        assert got == expected, f"{what}: {got} vs {expected}"
    finally:
        del backend
        _free_gpu()


@pytest.mark.gpu
@pytest.mark.hopper
@settings(max_examples=AXES_EXAMPLES)
@given(axes=AXES, seed=seeds())
def test_megakernel_matches_transformers_generate_on_drawn_model_axes(axes, seed):
    backends = []

    def make(weights):
        backends.append(get_backend("megakernel", weights, GPU))
        return backends[-1]

    try:
        check_parity_on_drawn_axes(axes, seed, make, torch.bfloat16, GPU,
                                   "megakernel vs transformers generate (float32, cuda), bf16 weights and KV cache")
        for backend in backends:
            backend.check()
    finally:
        del backends
        _free_gpu()
