"""10,000 greedy decode steps on the llama-3.2-1b shape: no error word in any step, the same tokens and the same
logits in a second run (the same engine, its counters at a later epoch), and at steps 1,000, 5,000 and 10,000 the
logits of the float32 reference decoder run teacher-forced on the megakernel's own tokens (the judgement of the
generation parity tests: the top-k log-probabilities close, the token the reference's choice or a near-tie).

Random seeded weights (their init keeps the logits decisive), bf16 weights and KV cache on both sides. Progress
goes to stdout every 1,000 steps (pytest -s shows it): the test takes a few minutes on an H200.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.weights import random_weights
from megakernel.testing.tolerances import greedy_tolerance_for

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.hopper, pytest.mark.slow]

GPU = "cuda"
STEPS = 10_000
CHECKED = (1_000, 5_000, 10_000)     # step numbers (1-based) whose logits are kept and compared
BLOCK = 16
SEED = 71


def _megakernel_run(engine, first: int) -> tuple[list[int], dict[int, torch.Tensor]]:
    """STEPS greedy steps of one sequence from token `first` at position 0: (the tokens, {step: logits})."""
    tokens: list[torch.Tensor] = []
    kept: dict[int, torch.Tensor] = {}
    tok = torch.tensor([first], dtype=torch.int32, device=GPU)
    for t in range(STEPS):
        # the error word is read every 500 steps and at the end (a read is a sync)
        out = engine.step(tok, torch.tensor([t], dtype=torch.int32, device=GPU), check=t % 500 == 0)
        if t + 1 in CHECKED:
            kept[t + 1] = engine.logits[0].float().clone()
        tok = out.clone()
        tokens.append(tok)
        if (t + 1) % 1000 == 0:
            print(f"megakernel: {t + 1} of {STEPS} steps", flush=True)
    engine.check()
    return torch.cat(tokens).tolist(), kept


def test_ten_thousand_steps_are_error_free_deterministic_and_match_the_reference():
    from megakernel.runtime.engine import MegakernelEngine

    config = get_preset("llama-3.2-1b")
    weights = random_weights(config, seed=SEED, dtype=torch.bfloat16, device=GPU)
    first = int(torch.randint(0, config.vocab_size, (1,), generator=torch.Generator().manual_seed(SEED)))
    max_seq = math.ceil((STEPS + 1) / BLOCK) * BLOCK
    what = f"llama-3.2-1b seed={SEED} bf16, {STEPS} greedy steps from token {first}"
    engine = MegakernelEngine(weights, 1, max_seq, block_size=BLOCK, device=GPU)
    try:
        tokens, kept = _megakernel_run(engine, first)
        again, kept_again = _megakernel_run(engine, first)
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    if again != tokens:
        first_diff = next(i for i, (a, b) in enumerate(zip(tokens, again)) if a != b)
        pytest.fail(f"{what}: the second run's tokens differ from step {first_diff + 1}")
    for step in CHECKED:
        assert torch.equal(kept[step], kept_again[step]), f"{what}: step {step}'s logits differ between the runs"
        assert not torch.isnan(kept[step]).any(), f"{what}: NaN logits at step {step}"
    assert len(set(tokens)) >= 64, f"{what}: only {len(set(tokens))} distinct tokens: a weak test"

    # the float32 reference, teacher-forced on the megakernel's tokens
    ref = ReferenceDecoder(weights)
    cache = PagedKVCache.allocate(config, num_blocks=max_seq // BLOCK, block_size=BLOCK, device=GPU)
    table = contiguous_block_table(1, max_seq, BLOCK, GPU)
    inputs = [first] + tokens[:-1]
    tol = greedy_tolerance_for(torch.bfloat16)
    for t in range(STEPS):
        logits = ref.step(torch.tensor([inputs[t]], device=GPU), torch.tensor([t], device=GPU), cache, table)
        if (t + 1) % 1000 == 0:
            print(f"reference: {t + 1} of {STEPS} steps", flush=True)
        if t + 1 not in CHECKED:
            continue
        mine = torch.log_softmax(kept[t + 1].double(), dim=-1)
        theirs = torch.log_softmax(logits[0].double(), dim=-1)
        top = theirs.topk(tol.top_k).indices
        torch.testing.assert_close(mine[top], theirs[top], atol=tol.logprob_atol, rtol=0,
                                   msg=lambda m: f"{what}: step {t + 1}, top-{tol.top_k} logprobs, reference: {m}")
        best = int(logits[0].argmax())
        gap = float(logits[0, best] - logits[0, tokens[t]])
        assert tokens[t] == best or gap < tol.near_tie_gap, \
            f"{what}: step {t + 1}: token {tokens[t]}, the reference picks {best} by {gap:.4g}"
