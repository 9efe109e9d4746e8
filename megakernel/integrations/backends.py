"""Decode backends behind one protocol, a registry by name, and a greedy `generate` loop over any of them.

A backend owns its KV cache and decodes one token per sequence per `step`; prefill is run as decode
steps over the prompt, which is all a decode megakernel needs to be compared end to end.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from megakernel.instructions.layout import KERNEL_CAPABILITY
from megakernel.model.weights import ModelWeights


class BackendUnavailable(RuntimeError):
    """A backend that exists but cannot run here; the message says why (no GPU, import failed, ...)."""


@runtime_checkable
class DecodeBackend(Protocol):
    """What `generate`, the CLI and the benchmarks drive.

    Optional: `last_logits() -> Tensor float32 [B, V]` (logits of the last step) and a class attribute
    `max_batch: int` (largest batch the backend accepts).
    """

    name: str
    device: torch.device

    def reset(self, batch: int, max_seq_len: int) -> None:
        """Forget all sequences; make room for `batch` sequences of up to `max_seq_len` tokens."""

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: int64 [B] on `device`; returns the greedy next tokens int64 [B] on `device`.

        Writes this token's K,V at `positions` and attends over 0..positions. No host sync inside.
        """


class ReferenceBackend:
    """The float32 torch reference decoder (megakernel.model.reference) behind the backend protocol."""

    name = "reference"

    def __init__(self, weights: ModelWeights, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype = torch.float32, block_size: int = 16):
        from megakernel.model.reference import ReferenceDecoder

        self.device = torch.device(device)
        self.config = weights.config
        self.compute_dtype = compute_dtype
        self.block_size = block_size
        self.decoder = ReferenceDecoder(weights.to(device=self.device), compute_dtype=compute_dtype)
        self._cache = None
        self._logits: torch.Tensor | None = None

    def reset(self, batch: int, max_seq_len: int) -> None:
        from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table

        if batch < 1 or max_seq_len < 1:
            raise ValueError(f"need batch >= 1 and max_seq_len >= 1, got {batch}, {max_seq_len}")
        self.block_table = contiguous_block_table(batch, max_seq_len, self.block_size, self.device)
        num_blocks = batch * self.block_table.shape[1]
        self._cache = PagedKVCache.allocate(self.config, num_blocks, block_size=self.block_size,
                                            dtype=self.compute_dtype, device=self.device)
        self._logits = None

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("reference: call reset(batch, max_seq_len) before step()")
        self._logits = self.decoder.step(tokens, positions, self._cache, self.block_table)
        return self._logits.argmax(dim=-1)

    def last_logits(self) -> torch.Tensor | None:
        return self._logits


# -- registry ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str
    needs_cuda: bool
    factory: Callable[..., DecodeBackend]


def _make_reference(weights, device, **kw):
    return ReferenceBackend(weights, device, **kw)


def _make_torch(mode: str):
    def make(weights, device, **kw):
        from megakernel.integrations.torch_baselines import TorchDecodeStep

        return TorchDecodeStep(weights, device, mode=mode, **kw)
    return make


def megakernel_class() -> type:
    """The megakernel backend class, imported on first use (BackendUnavailable if that fails)."""
    try:
        from megakernel.runtime.engine import MegakernelBackend
    except ImportError as exc:
        raise BackendUnavailable(
            f"the megakernel backend could not be imported (megakernel.runtime.engine.MegakernelBackend): "
            f"{exc}; the torch baselines (e.g. --backend torch-graph) run without it") from exc
    return MegakernelBackend


def _make_megakernel(weights, device, **kw):
    return megakernel_class()(weights, device=device, **kw)


BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("reference", "float32 torch reference decoder over a paged KV cache (CPU or GPU)", False,
                _make_reference),
    BackendSpec("torch-eager", "plain torch decode step, ops launched one by one (CPU or GPU)", False,
                _make_torch("eager")),
    BackendSpec("torch-graph", "the plain torch step captured in a CUDA graph", True, _make_torch("graph")),
    BackendSpec("torch-compile", "the plain torch step through torch.compile, then a CUDA graph", True,
                _make_torch("compile")),
    BackendSpec("megakernel", "the persistent CuTe DSL decode megakernel (Hopper GPU)", True, _make_megakernel),
)}

TORCH_BASELINES = ("torch-eager", "torch-graph", "torch-compile")


def check_backend(name: str, device: torch.device | str) -> BackendSpec:
    """Everything that can be checked before building weights: the name, the device, the import."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    spec = BACKENDS[name]
    device = torch.device(device)
    if spec.needs_cuda and (device.type != "cuda" or not torch.cuda.is_available()):
        why = "no CUDA device is present" if not torch.cuda.is_available() else f"the device is {device}"
        raise BackendUnavailable(f"backend {name!r} needs a CUDA GPU, but {why}; the 'reference' and "
                                 f"'torch-eager' backends run on the CPU")
    if name == "megakernel":
        megakernel_class()
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) != KERNEL_CAPABILITY:
            raise BackendUnavailable(f"backend 'megakernel' is built for Hopper (sm_90a); {device} is sm_{major}{minor} "
                                     f"({torch.cuda.get_device_name(device)}): the torch baselines run there")
    return spec


def backend_max_batch(name: str) -> int | None:
    """The largest batch `name` accepts, where it has one (only the megakernel does)."""
    if name == "megakernel":
        return getattr(megakernel_class(), "max_batch", None)
    return None


def get_backend(name: str, weights: ModelWeights, device: torch.device | str, **kw) -> DecodeBackend:
    """Build backend `name` over `weights` on `device` (ValueError: unknown name; BackendUnavailable: can't run)."""
    spec = check_backend(name, device)
    return spec.factory(weights, torch.device(device), **kw)


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that can run on `device` here."""
    names = []
    for name in BACKENDS:
        try:
            check_backend(name, device)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


# -- greedy generation ---------------------------------------------------------------------------------

@dataclass
class GenerationOutput:
    tokens: list[list[int]]          # new tokens per sequence (the prompt excluded), max_new_tokens each
    step_ms: list[float]             # time of every step: prefill steps first, then decode steps
    prefill_steps: int               # steps whose output was discarded (max prompt length - 1)
    batch: int
    logits: list[torch.Tensor] | None = None   # per sequence float32 [max_new_tokens, V] (keep_logits=True)

    @property
    def decode_step_ms(self) -> list[float]:
        return self.step_ms[self.prefill_steps:]

    @property
    def median_decode_ms(self) -> float:
        return statistics.median(self.decode_step_ms)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput over all sequences: batch tokens per median decode step."""
        return self.batch * 1e3 / self.median_decode_ms


def generate(backend: DecodeBackend, prompts: list[list[int]], max_new_tokens: int,
             progress: Callable[[int, int], None] | None = None, keep_logits: bool = False) -> GenerationOutput:
    """Greedy generation of `max_new_tokens` per prompt; prompts may have different lengths.

    Prefill runs as decode steps. The prompts are right-aligned, so every sequence reaches its last
    prompt token on the same step and all decode steps are full-batch; each sequence stays at its own
    position. Until its prompt starts, a shorter sequence repeats its first token at position 0 (its
    real first step writes the same K,V there again). Steps are timed with CUDA events on a GPU
    (synchronised once, at the end) and with a wall clock on the CPU. `progress(done, total)` is
    called after each step.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    last_logits = getattr(backend, "last_logits", None)
    if keep_logits and last_logits is None:
        raise ValueError(f"backend {backend.name!r} has no last_logits(); cannot keep logits")
    batch = len(prompts)
    lens = [len(p) for p in prompts]
    longest = max(lens)
    total_steps = longest - 1 + max_new_tokens
    backend.reset(batch, longest + max_new_tokens - 1)

    device = backend.device
    steps = torch.arange(total_steps)[:, None]
    offsets = torch.tensor([longest - n for n in lens])[None, :]
    positions = (steps - offsets).clamp(min=0)                                     # [T, B]
    padded = torch.tensor([[p[0]] * (longest - len(p)) + list(p) for p in prompts]).T.contiguous()  # [L, B]
    positions = positions.to(device)
    padded = padded.to(device)
    out_tokens = torch.empty(max_new_tokens, batch, dtype=torch.long, device=device)
    out_logits = None

    on_cuda = device.type == "cuda"
    if on_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(total_steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(total_steps)]
    wall_ms: list[float] = []
    for t in range(total_steps):
        tokens = padded[t] if t < longest else out_tokens[t - longest]
        if on_cuda:
            starts[t].record()
        else:
            t0 = time.perf_counter()
        next_tokens = backend.step(tokens, positions[t])
        if on_cuda:
            ends[t].record()
        else:
            wall_ms.append((time.perf_counter() - t0) * 1e3)
        if t >= longest - 1:
            j = t - (longest - 1)
            out_tokens[j].copy_(next_tokens)
            if keep_logits:
                logits = last_logits()
                if out_logits is None:
                    out_logits = torch.empty((max_new_tokens, *logits.shape), dtype=torch.float32, device=device)
                out_logits[j].copy_(logits)
        if progress is not None:
            progress(t + 1, total_steps)
    if on_cuda:
        torch.cuda.synchronize(device)
        step_ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        step_ms = wall_ms
    tokens_out = out_tokens.cpu().T.tolist()
    logits_out = None
    if out_logits is not None:
        logits_out = list(out_logits.cpu().transpose(0, 1).unbind(0))
    return GenerationOutput(tokens=tokens_out, step_ms=step_ms, prefill_steps=longest - 1, batch=batch,
                            logits=logits_out)
