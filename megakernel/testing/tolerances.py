"""One per-dtype tolerance table for comparing a result against a float32/float64 torch reference.

Every correctness test reads its atol/rtol from here (house style): a looser entry carries the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # float32 against a float32/float64 reference: the two sides sum reductions of up to ~16k terms
    # (hidden, ffn, kv length) in different orders, so a few hundred ulps (eps 1.2e-7) of drift is expected.
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    # bfloat16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): rounding the output alone costs half an ulp
    # (2e-3 relative) and every bf16 intermediate (normed activations, q/k after RoPE) adds about as much.
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    # float16 keeps 11 mantissa bits (eps 2^-11 = 4.9e-4): the same argument as bfloat16, 8x tighter.
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    # float64 references compared with each other: only summation order differs.
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The tolerance for results computed in `dtype` (ValueError for a dtype the table lacks)."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in TOLERANCES)
        raise ValueError(f"no tolerance for dtype {dtype}; the table has {names}") from None


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 *, context: str = "") -> None:
    """Compare `actual` with the float32/float64 `expected` at the tolerance of `dtype` (default: actual's dtype).

    NaN anywhere in `actual` fails (outputs are poisoned with NaN before a kernel writes them).
    `context` (shape, dtype, seed, ...) is put in front of the failure message so it reproduces.
    """
    dtype = actual.dtype if dtype is None else dtype
    tol = tolerance_for(dtype)
    prefix = f"{context}: " if context else ""
    torch.testing.assert_close(
        actual.detach().to(expected.dtype).cpu(), expected.detach().cpu(), atol=tol.atol, rtol=tol.rtol,
        equal_nan=False,
        msg=lambda m: f"{prefix}dtype={dtype} atol={tol.atol} rtol={tol.rtol}: {m}",
    )


# -- greedy generation parity ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GreedyTolerance:
    """How two greedy decoders of one model may differ.

    near_tie_gap: the first token where they part ways must be one where the reference's top-2 logit gap
        is below this (absolute logits); comparison stops there (the contexts differ after it).
    logprob_atol: while the tokens agree, the log-probabilities of the reference's top-k tokens agree to this.
    top_k: at the first divergence each side's token must be among the other's top_k (as vLLM's
        check_logprobs_close requires).
    """

    near_tie_gap: float
    logprob_atol: float
    top_k: int = 5


GREEDY_TOLERANCES: dict[torch.dtype, GreedyTolerance] = {
    # float32 activations and KV cache on both sides: only op order differs, ~1e-6 of the logit scale.
    torch.float32: GreedyTolerance(near_tie_gap=1e-3, logprob_atol=1e-4),
    # bf16 weights and KV cache, float32 activations (the megakernel): rounding the cached K/V moves the top-5
    # log-probabilities by up to 4.6e-3..7.0e-3 over 128 greedy steps against transformers in float32 (measured
    # with the instruction VM over bf16 weights, which rounds the cache as the kernel does: tiny-llama,
    # tiny-qwen3, the qwen3-0.6b and llama-3.2-1b shapes with 2 layers); both bounds carry a ~7x margin.
    torch.bfloat16: GreedyTolerance(near_tie_gap=5e-2, logprob_atol=5e-2),
}


def greedy_tolerance_for(dtype: torch.dtype) -> GreedyTolerance:
    """The greedy-parity tolerance for a decoder whose KV cache is `dtype` (ValueError if the table lacks it)."""
    try:
        return GREEDY_TOLERANCES[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in GREEDY_TOLERANCES)
        raise ValueError(f"no greedy tolerance for dtype {dtype}; the table has {names}") from None
