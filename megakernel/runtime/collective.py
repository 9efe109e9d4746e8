"""Agreement among the ranks of a tensor-parallel step when each rank is its own process (vLLM's workers): every
decision that makes a rank build, fail or run stock must be the same on every rank, or a rank that launches its
kernel waits on exchange counters that a rank which gave up never signals (until the kernel's timeout), and a
rank that runs vLLM's stock layers joins collectives its peers never start.

`gather(obj) -> [every rank's obj, rank order]` is the caller's: in vLLM, torch.distributed.all_gather_object over
the tensor-parallel group's CPU (gloo) group; in tests, threads. Every rank calls the same gathers in the same
order; `collective` and `agreed_reason` turn a failure or a reason on any rank into the same outcome on every
rank at the same gather, so none is left waiting in a gather for a rank that gave up. Plain torch (no CUDA, no
CuTe DSL), for the runtime (runtime.tensor_parallel.TensorParallelRank) and the vLLM integration alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

Gather = Callable[[Any], list]


class TensorParallelSetupError(RuntimeError):
    """A rank of a tensor-parallel engine failed to set up, or the gather broke its contract; raised on every rank
    at the same point of the setup, naming the ranks that failed and why."""


class ProgramMismatchError(TensorParallelSetupError):
    """The ranks built different programs (another layout, GPU, kernel option or code version): their kernels
    would wait on counts the others never signal, so none of them runs."""


def process_group_gather(group=None) -> Gather:
    """The gather over a torch.distributed process group (default: the default group): torch.distributed.
    all_gather_object, every rank's object in rank order. Pass a CPU (gloo) group: the objects are pickled."""
    import torch.distributed as dist

    size = dist.get_world_size(group)

    def gather(obj: Any) -> list:
        out: list = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def gather_checked(gather: Gather, obj: dict, world_size: int, what: str) -> list[dict]:
    """gather(obj) with its contract checked: one entry per rank, in rank order (each entry carries its "rank").
    TensorParallelSetupError otherwise (on every rank alike: they all see the same list)."""
    everyone = list(gather(obj))
    ranks = [e.get("rank") if isinstance(e, dict) else None for e in everyone]
    if ranks != list(range(world_size)):
        raise TensorParallelSetupError(f"{what}: the gather returned entries of ranks {ranks}; expected one per rank "
                                       f"of {world_size}, in rank order (all_gather_object over the tensor-parallel "
                                       f"group)")
    return everyone


def collective(gather: Gather, rank: int, world_size: int, what: str, fn: Callable[[], Any]) -> list:
    """Run fn() on this rank, then gather every rank's outcome: -> every rank's fn() result, rank order. If fn()
    raised on any rank, TensorParallelSetupError on every rank, naming each failed rank and its error (this
    rank's own exception chained)."""
    try:
        value, error, cause = fn(), None, None
    except Exception as exc:      # noqa: BLE001 (carried to every rank, raised below)
        value, error, cause = None, f"{type(exc).__name__}: {exc}", exc
    everyone = gather_checked(gather, {"rank": rank, "error": error, "value": value}, world_size, what)
    failed = [f"rank {e['rank']}: {e['error']}" for e in everyone if e["error"] is not None]
    if failed:
        raise TensorParallelSetupError(f"{what} failed on {len(failed)} of {world_size} ranks: "
                                       + "; ".join(failed)) from cause
    return [e["value"] for e in everyone]


def agreed_reason(gather: Gather, rank: int, world_size: int, reason: str | None) -> str | None:
    """Every rank's reason not to go on (None: none), gathered: None only where no rank has one, else the same text
    on every rank, naming each rank's reason."""
    everyone = gather_checked(gather, {"rank": rank, "reason": reason}, world_size, "agreeing")
    reasons = [f"rank {e['rank']}: {e['reason']}" for e in everyone if e["reason"]]
    return "; ".join(reasons) if reasons else None


def program_digest(*parts: Any) -> str:
    """A digest of what every rank must have alike to run one program: tensors by dtype, shape and bytes, anything
    else by its repr (dataclasses: every field)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(repr((part.dtype, tuple(part.shape))).encode())
            h.update(part.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def check_digests(digests: list[str], what: str) -> None:
    """ProgramMismatchError unless every rank's digest is rank 0's (the same decision on every rank)."""
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise ProgramMismatchError(f"{what}: ranks {odd} built another program than rank 0 (digest "
                                   f"{', '.join(digests[r][:12] for r in odd)} against {digests[0][:12]}): another "
                                   f"layout, GPU, kernel option or code version")
