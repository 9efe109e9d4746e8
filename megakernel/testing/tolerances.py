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
