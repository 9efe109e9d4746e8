"""The megakernel on a GPU: device buffers, the KV cache, the compiled kernel and its launch.

`MegakernelEngine.launch()` is the hot path: one kernel launch, no host sync, no allocation, so it
can be captured in a CUDA graph; the kernel advances tokens/positions itself, so replaying the graph
decodes the next token. `step()` is the checked user path: it validates inputs before the launch
(including that no sequence's KV append lands on a cache slot the same step reads), and reads the
error word after it. The kernel checks that aliasing rule itself too, on every path (launch(), graph
replays, vLLM): a step whose append would overwrite a slot it reads or another sequence appends to writes
no K/V for that token and reports ERR_ALIAS. `scratch_block=` names a block no sequence reads (vLLM's null
block 0, where its padded rows append), exempt from the rule. An engine with its own cache starts with
the contiguous block table (sequence b owns blocks b*n .. b*n+n-1), so a bare `launch()` (benchmarks,
graph capture) is a valid step.

Layout options (profiles/RESULTS.md has the sweeps behind the defaults): `fold_embed=True` (the
default since 2026-11-30) folds the embedding into layer 0's QKV (`StepLayout.embed_folded`): those
tiles read embed[token] themselves and wait on nothing.

Three constructor options serve callers that bring their own LM head and KV cache (the vLLM
integration, docs/vllm.md):

- `lm_head=False`: the step's program has no LM_HEAD and no ARGMAX; it ends when x[L]
  (`bufs.x[-1]`, float32 [B, H], the residual stream after the last layer, before the final norm)
  is written. Nothing advances tokens/positions then: the caller writes both before every launch.
  `step()` raises RuntimeError (there are no next tokens); `step_hidden()` is its checked
  counterpart and returns x[L]; `logits` raises as well.
- `packed_weights=`: a PackedWeights from `pack_weights(weights, n)` (n >= max_seq_len rounded up to
  whole blocks), bf16, on the engine's device, used as is instead of packing `weights` again, so
  several engines share one copy; `weights` then only supplies the model config. Checked by
  `validate_packed_weights` (ValueError naming the field).
- `own_kv_cache=False`: no KV cache is allocated and nothing is compiled at construction (the kernel
  is compiled for the cache's strides at the first `bind_kv_caches`); `launch()`, `step()`,
  `step_hidden()` and `set_inputs()` raise RuntimeError until `bind_kv_caches` has been called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..instructions.layout import (KERNEL_CAPABILITY, KERNEL_MAX_BATCH, PackedWeights, StepLayout, allocate_buffers,
                                   default_kv_splits, pack_weights, require_kernel_batch, validate_packed_weights,
                                   validate_step_inputs)
from ..instructions.opcodes import Opcode
from ..instructions.record import serialize
from ..kernel.interpreter import ARG_NAMES, ERR_ALIAS, ERR_POSITION, ERR_RING, ERR_TIMEOUT, ERR_TOKEN, KernelOptions
from ..kernel.stream import (PEER_WORDS, TR_BEGIN, TR_CONSUMED, TR_END, TR_EPILOGUE, TR_ISSUED_FIRST, TR_ISSUED_LAST,
                             TR_LANDED_FIRST, TR_LANDED_LAST, TR_OP, TR_READY, TR_REACHED_LAST, TR_SM, TR_STAGED,
                             TR_STAGING, TR_WAIT_FREE, TR_WAIT_IN_FLIGHT, TR_WAIT_LANDED, TRACE_WORDS)
from ..model.kv_cache import contiguous_block_table
from ..model.weights import ModelWeights
from ..schedule import assign, build_program, simulate


class MegakernelError(RuntimeError):
    """The kernel reported an error through its error word (the step's outputs are invalid)."""


@dataclass
class ErrorWord:
    code: int
    instruction: int
    detail: int         # the counter a timed-out wait spun on (-1: a poll of a flagged input); the sequence of a
                        # position or aliasing error
    value: int

    def describe(self, program) -> str:
        ins = program.instructions[self.instruction] if 0 <= self.instruction < len(program.instructions) else None
        what = f"instruction #{self.instruction} {ins.opcode.name} (layer {ins.layer})" if ins else \
            f"instruction #{self.instruction}"
        if self.code == ERR_TIMEOUT and self.detail < 0:
            return (f"{what} timed out polling its flagged input for epoch {self.value} (or stopped on another "
                    f"CTA's error): a producer never wrote this step's words; the schedule or the kernel is broken")
        if self.code == ERR_TIMEOUT:
            return (f"{what} timed out waiting on counter {self.detail} (last value {self.value}): "
                    f"a producer never signalled; the schedule or the kernel is broken")
        if self.code == ERR_POSITION:
            return f"{what}: sequence {self.detail}'s position {self.value} is past the KV cache"
        if self.code == ERR_RING:
            return (f"a weight-ring slot stayed unfilled or occupied past the timeout (phase "
                    f"{self.value}): the producer and consumers disagree on the slot sequence")
        if self.code == ERR_TOKEN:
            return f"{what}: token id {self.value} is outside the vocabulary"
        if self.code == ERR_ALIAS:
            return (f"{what}: the KV slot of sequence {self.detail}'s new token (position {self.value}) is one that "
                    f"this step also reads or that another sequence appends to: the block table maps two positions "
                    f"to one slot; that token's K/V was not written")
        return f"unknown error code {self.code} at {what}"


def kernel_arg_tensors(weights: PackedWeights, bufs, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The kernel's arguments by name (interpreter.ARG_NAMES): the engine's `own` tensors (queue, lengths, ones,
    kv_table, trace, host_error, peers), the packed weights' and, for the other names, the step buffers'."""
    w = weights
    streamed = {"w_embed": w.embed, "w_qkv": w.qkv, "w_o": w.o_proj, "w_gate_up": w.gate_up, "w_down": w.down,
                "w_lm_head": w.lm_head, "attn_norm": w.attn_norm, "mlp_norm": w.mlp_norm,
                "final_norm": w.final_norm, "q_norm": w.q_norm, "k_norm": w.k_norm, "rope_cos": w.rope_cos,
                "rope_sin": w.rope_sin}
    return {name: own[name] if name in own else streamed[name] if name in streamed else getattr(bufs, name)
            for name in ARG_NAMES}


def reset_sync(bufs, device: torch.device, host_error: torch.Tensor) -> None:
    """Zero an engine's counters, epoch and error word, and the error's host copy; and the flagged buffers' epoch
    words (StepBuffers.epochs), which a restarted epoch would otherwise find already this step's."""
    bufs.counters.zero_()
    bufs.sync.zero_()
    for epochs in bufs.epochs():
        epochs.zero_()
    bufs.error.zero_()
    torch.cuda.synchronize(device)      # no launch still in flight writes the host copy afterwards
    host_error.zero_()


def kv_view_strides(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], layout: StepLayout,
                    device: torch.device) -> tuple[int, tuple[int, int, int]]:
    """(num_blocks, (block, offset, head) element strides) of per-layer K/V views an engine can bind: one per layer
    each, [num_blocks, block_size, Hkv, D] bf16 on `device`, last dimension contiguous and 16-byte aligned, every
    view with the same strides. ValueError naming the first view that is not."""
    c = layout.config
    if len(k_caches) != c.num_layers or len(v_caches) != c.num_layers:
        raise ValueError(f"need {c.num_layers} K and V caches, got {len(k_caches)} and {len(v_caches)}")
    strides = None
    num_blocks = k_caches[0].shape[0]
    for name, t in [(f"k_caches[{i}]", k) for i, k in enumerate(k_caches)] + \
                   [(f"v_caches[{i}]", v) for i, v in enumerate(v_caches)]:
        if t.dim() != 4 or tuple(t.shape[1:]) != (layout.block_size, c.num_kv_heads, c.head_dim) \
                or t.shape[0] != num_blocks:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected "
                             f"({num_blocks}, {layout.block_size}, {c.num_kv_heads}, {c.head_dim})")
        if t.dtype != torch.bfloat16 or t.device != device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; expected torch.bfloat16 on {device}")
        if t.stride(3) != 1 or t.data_ptr() % 16:
            raise ValueError(f"{name} needs a contiguous, 16-byte aligned last dimension")
        s = tuple(t.stride()[:3])
        if strides is None:
            strides = s
        elif s != strides:
            raise ValueError(f"{name} has strides {s}; every K/V view must share {strides}")
    return num_blocks, strides


def device_weights(weights: ModelWeights | None, packed: PackedWeights | None, layout: StepLayout,
                   device: torch.device) -> PackedWeights:
    """The packed weights an engine streams: `packed` as given (validate_packed_weights: ValueError naming the field),
    else `weights` packed here on `device` (the kernel streams bf16 weights: other dtypes are converted, exact for
    bf16-representable values)."""
    if packed is not None:
        validate_packed_weights(packed, layout, device)
        return packed
    return pack_weights(weights.to(device=device, dtype=torch.bfloat16), layout.max_seq_len).to(device)


def fill_kv_table(table: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    """Each layer's K and V base address into the kernel's table (int64 [L, 2]), in place: the kernel argument's
    address stays, so a captured CUDA graph stays valid."""
    table.copy_(torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(k_caches, v_caches)], dtype=torch.int64))


def allocate_kv_cache(layout: StepLayout, num_blocks: int, table: torch.Tensor, block_table: torch.Tensor,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """An engine's own K and V caches, [num_layers, num_blocks, block_size, Hkv, D] bf16 filled with NaN (a read of
    a slot no step wrote shows in the outputs), their layers' addresses written into the kernel's table, and the
    per-layer strides (block, token, head) the kernel is compiled for. Where the blocks suffice, the step's
    block_table gets the contiguous one until step()/set_inputs() is given one: sequence b owns blocks b*n ..
    b*n + n - 1, so a bare launch never appends a token into a slot that another position reads (a zero table
    would)."""
    c = layout.config
    shape = (c.num_layers, num_blocks, layout.block_size, c.num_kv_heads, c.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    fill_kv_table(table, list(k_cache.unbind(0)), list(v_cache.unbind(0)))
    if num_blocks >= layout.batch * layout.max_blocks_per_seq:
        block_table.copy_(contiguous_block_table(layout.batch, layout.max_seq_len, layout.block_size, device))
    return k_cache, v_cache, tuple(k_cache.stride()[1:4])


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class MegakernelEngine:
    """One model, one batch bucket, one KV-cache geometry: a compiled kernel and its buffers."""

    max_batch = KERNEL_MAX_BATCH

    def __init__(self, weights: ModelWeights, batch: int, max_seq_len: int, *, block_size: int = 16,
                 num_blocks: int | None = None, num_sms: int | None = None, policy: str = "balanced",
                 kv_splits: int | None = None, options: KernelOptions = KernelOptions(),
                 fuse_attn_reduce: bool | None = None, slab_staging: bool = True, fold_embed: bool = True,
                 scratch_block: int = -1, device: str | torch.device = "cuda",
                 own_kv_cache: bool = True, packed_weights: PackedWeights | None = None, lm_head: bool = True):
        config = weights.config
        require_kernel_batch(batch)
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("the megakernel needs a CUDA GPU (Hopper, sm_90a)")
        if self.device.index is None:       # "cuda" -> "cuda:N": tensors report their device with an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        if num_blocks is not None and not own_kv_cache:
            raise ValueError(f"num_blocks={num_blocks} sizes the engine's own KV cache; with own_kv_cache=False "
                             f"the cache bound by bind_kv_caches sets the block count")
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) != KERNEL_CAPABILITY:
            raise RuntimeError(f"the megakernel is built for sm_90a (Hopper); this GPU is sm_{major}{minor}")
        sms = _sm_count(self.device)
        num_sms = num_sms or sms
        if num_sms > sms:
            raise ValueError(f"num_sms={num_sms} exceeds the {sms} SMs of this GPU (the persistent kernel "
                             f"needs every CTA resident at once)")
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{config.max_position_embeddings}")
        blocks_per_seq = -(-max_seq_len // block_size)
        self.layout = StepLayout(config=config, batch=batch,
                                 kv_splits=kv_splits or default_kv_splits(config, batch, num_sms, blocks_per_seq * block_size),
                                 block_size=block_size, max_blocks_per_seq=blocks_per_seq, num_sms=num_sms,
                                 fuse_attn_reduce=fuse_attn_reduce, slab_staging=slab_staging, fold_embed=fold_embed,
                                 scratch_block=scratch_block)
        self.layout.validate()
        self.program = build_program(self.layout, lm_head=lm_head)
        self.queues = assign(self.program, policy)
        simulate(self.queues, self.program.num_counters)      # deadlock-free, proven before any launch
        table, lengths = serialize(self.queues)
        if table.shape[1] * table.shape[2] * 4 > 96 * 1024:
            raise ValueError(f"the longest SM queue ({table.shape[1]} instructions) exceeds the 96 KiB of shared "
                             f"memory the kernel stages it in; use fewer kv_splits or a smaller batch")
        self.queue_table = table.to(self.device)
        self.queue_lengths = lengths.to(self.device)

        self.weights = device_weights(weights, packed_weights, self.layout, self.device)
        c = config
        self.ones = torch.ones(max(c.hidden_size, c.q_size, c.intermediate_size), dtype=torch.bfloat16,
                               device=self.device)
        self.bufs = allocate_buffers(self.layout, self.program.lm_tiles, self.program.num_counters, self.device)
        # the kernel reads each layer's K and V base address from this table: int64 [L, 2]
        self.kv_table = torch.zeros(c.num_layers, 2, dtype=torch.int64, device=self.device)
        self.trace_buf = torch.zeros(num_sms, table.shape[1], TRACE_WORDS, dtype=torch.int32, device=self.device)
        # the error code's copy in mapped (pinned) host memory: the launch after a failed step writes it, so a
        # loop that never syncs (graph replays, vLLM) reads it with error_flag()
        self.host_error = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        # tensor parallel's peer table (megakernel.kernel.tensor_parallel); a one-GPU step never reads it
        self.peers = torch.zeros(1, PEER_WORDS, dtype=torch.int64, device=self.device)
        self.options = options
        self.steps = 0
        self.compiled = None
        self.key = None
        if own_kv_cache:
            self.num_blocks = num_blocks or batch * blocks_per_seq
            self.k_cache, self.v_cache, self.kv_strides = allocate_kv_cache(
                self.layout, self.num_blocks, self.kv_table, self.bufs.block_table, self.device)
            self._compile(table.shape[1])
        else:
            # no cache, no kernel yet: bind_kv_caches fills the table and compiles for the cache's strides
            self.num_blocks = None
            self.k_cache = self.v_cache = None
            self.kv_strides = None

    @property
    def has_lm_head(self) -> bool:
        """False for an engine built with lm_head=False (its step ends at x[L])."""
        return self.program.has_lm_head

    @property
    def kv_bound(self) -> bool:
        """Whether the engine has a KV cache to run on (its own, or one given to bind_kv_caches)."""
        return self.compiled is not None

    def _require_kv(self, what: str) -> None:
        if self.compiled is None:
            raise RuntimeError(f"{what} before bind_kv_caches(): this engine was built with own_kv_cache=False "
                               f"and has no KV cache (and no compiled kernel) until one is bound")

    def _compile(self, max_queue_len: int) -> None:
        """Compile (or take from the cache) the kernel for the current KV strides; arguments by address."""
        from cutlass import Int64

        from ..kernel.compile import KernelKey, compile_decode_kernel
        self.key = KernelKey(self.layout, self.program.lm_tiles, self.program.num_counters, max_queue_len,
                             self.kv_strides, self.options)
        self.compiled = compile_decode_kernel(self.key)
        tensors = self._arg_tensors()
        self._args = [Int64(tensors[name].data_ptr()) for name in ARG_NAMES]

    def bind_kv_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Read and write an external paged KV cache (vLLM's) in place of the engine's own.

        k_caches[l], v_caches[l]: [num_blocks, block_size, Hkv, D] bf16 views on this device, last
        dim contiguous and 16-byte aligned, the same (block, offset, head) strides for all 2L views.
        Only the device address table changes when the strides stay the same, so a captured CUDA
        graph stays valid; other strides recompile the kernel. The caller keeps the tensors alive.
        An engine built with own_kv_cache=False compiles its kernel here, at the first bind."""
        num_blocks, strides = kv_view_strides(k_caches, v_caches, self.layout, self.device)
        fill_kv_table(self.kv_table, k_caches, v_caches)
        self.num_blocks = num_blocks
        self.k_cache = self.v_cache = None      # the engine's own cache is no longer used
        if strides != self.kv_strides or self.compiled is None:
            self.kv_strides = strides
            self._compile(self.queue_table.shape[1])

    def _arg_tensors(self) -> dict[str, torch.Tensor]:
        return kernel_arg_tensors(self.weights, self.bufs, {
            "queue": self.queue_table, "lengths": self.queue_lengths, "ones": self.ones, "kv_table": self.kv_table,
            "trace": self.trace_buf, "host_error": self.host_error, "peers": self.peers})

    # ---------------------------------------------------------------- hot path
    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """One decode step of the whole batch from the current device inputs: one kernel launch.
        With the LM head it advances tokens/positions in place; with lm_head=False it only writes
        x[L] (bufs.x[-1]) and the caller writes tokens/positions before every launch. RuntimeError
        (nothing launched) while an engine built with own_kv_cache=False has no bound KV cache."""
        if self.compiled is None:
            self._require_kv("launch()")
        import cuda.bindings.driver as cuda

        stream = stream or torch.cuda.current_stream(self.device)
        self.compiled(*self._args, cuda.CUstream(stream.cuda_stream))
        self.steps += 1

    # ---------------------------------------------------------------- checked path
    def set_inputs(self, tokens: torch.Tensor, positions: torch.Tensor,
                   block_table: torch.Tensor | None = None) -> None:
        """Validate and copy the step inputs (raises ValueError before anything is launched)."""
        self._require_kv("set_inputs()")
        lay = self.layout
        tokens = torch.as_tensor(tokens)
        positions = torch.as_tensor(positions)
        validate_step_inputs(lay, tokens, positions, block_table, self.num_blocks)
        if block_table is not None:
            bt = torch.as_tensor(block_table)
            self.bufs.block_table.copy_(bt.to(torch.int32))
        self.bufs.tokens.copy_(tokens.to(device=self.device, dtype=torch.int32))
        self.bufs.positions.copy_(positions.to(device=self.device, dtype=torch.int32))

    def check(self) -> None:
        """Raise MegakernelError if the last launches reported an error (syncs the device), after resetting
        the counters and the error word, so the next launch runs. Until then every launch after the failed
        step runs no instruction and writes nothing (the kernel reads the error word first)."""
        word = self.bufs.error.tolist()
        if word[0] != 0:
            err = ErrorWord(*word)
            self.reset_sync()
            raise MegakernelError(err.describe(self.program))

    def error_flag(self) -> int | None:
        """The error code of a failed step (ERR_*), read from mapped host memory without a device sync; None
        while none is reported. The launch after the failed one writes it, so it lags the device by a launch
        and by the launches still in flight; check() reads the device's word, with the error's details."""
        code = int(self.host_error[0])
        return code or None

    def reset_sync(self) -> None:
        """Zero counters, epoch and error word, and its host copy (after an error, or to start over)."""
        reset_sync(self.bufs, self.device, self.host_error)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None = None,
             check: bool = True) -> torch.Tensor:
        """Validated step -> next tokens int32 [B] (a view of the output buffer; clone to keep).
        RuntimeError for an engine built with lm_head=False (use step_hidden)."""
        if not self.has_lm_head:
            raise RuntimeError("step(): this engine was built with lm_head=False, so its step has no LM head and "
                               "no ARGMAX and yields no next tokens; use step_hidden() (or launch() and read "
                               "bufs.x[-1], x[L] float32 [B, H])")
        self._require_kv("step()")
        self.set_inputs(tokens, positions, block_table)
        self.launch()
        if check:
            self.check()
        return self.bufs.out_tokens

    def step_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None = None,
                    check: bool = True) -> torch.Tensor:
        """Validated step -> x[L] float32 [B, H], the residual stream after the last layer, before the
        final norm (a view of bufs.x[-1]; clone to keep). With or without the LM head; with it, the
        step also advances tokens/positions and writes out_tokens, as step() does."""
        self._require_kv("step_hidden()")
        self.set_inputs(tokens, positions, block_table)
        self.launch()
        if check:
            self.check()
        return self.bufs.x[-1]

    def run_instructions(self, instructions: list) -> None:
        """Run the given instructions alone through the real kernel, all on SM 0, in order, with
        their waits and signals stripped: one stage tested in isolation on whatever the buffers
        hold (flagged buffers' words stamped with the launch's epoch first, so a polled input is as
        ready as a stripped wait). The step's own queue is restored afterwards. Raises MegakernelError
        on a kernel error."""
        import dataclasses

        from ..instructions.record import NO_COUNTER, WORDS
        if len(instructions) > self.queue_table.shape[1]:
            raise ValueError(f"{len(instructions)} instructions exceed the queue length {self.queue_table.shape[1]}")
        saved_table, saved_len = self.queue_table.clone(), self.queue_lengths.clone()
        table = torch.zeros_like(self.queue_table)
        for i, ins in enumerate(instructions):
            bare = dataclasses.replace(ins, wait_id=NO_COUNTER, wait_count=0, signal_id=NO_COUNTER)
            table[0, i] = torch.tensor(bare.encode(), dtype=torch.int32)
        lengths = torch.zeros_like(self.queue_lengths)
        lengths[0] = len(instructions)
        assert table.shape[2] == WORDS
        self.queue_table.copy_(table)
        self.queue_lengths.copy_(lengths)
        for epochs in self.bufs.epochs():
            epochs.copy_(self.bufs.sync[0] + 1)     # (on the device: no host sync)
        try:
            self.launch()
            self.check()
        finally:
            self.queue_table.copy_(saved_table)
            self.queue_lengths.copy_(saved_len)

    def counter_waits(self) -> list[tuple[int, int]]:
        """(queue, index) of every queue entry that waits on a counter the kernel spins on: not those of the
        stages that poll a flagged input instead (instructions.flagged.POLLING)."""
        from ..instructions.flagged import POLLING, flagged_hops
        from ..instructions.record import W_A3, W_OPCODE, W_WAIT_ID
        table, lengths = self.queue_table.cpu(), self.queue_lengths.cpu().tolist()

        def polls(op: int, a3: int) -> bool:
            return flagged_hops(self.layout) and op in POLLING and not (op == Opcode.QKV and a3 == 1)
        # (entries past a queue's length are zero padding: wait id 0, never run)
        return [(sm, i) for sm, i in (table[:, :, W_WAIT_ID] >= 0).nonzero().tolist()
                if i < lengths[sm] and not polls(int(table[sm, i, W_OPCODE]), int(table[sm, i, W_A3]))]

    @property
    def logits(self) -> torch.Tensor:
        """float32 [B, V] of the last step; RuntimeError for an engine built with lm_head=False."""
        if not self.has_lm_head:
            raise RuntimeError("logits: this engine was built with lm_head=False and computes none; x[L] is "
                               "bufs.x[-1]")
        return self.bufs.logits

    def trace_records(self) -> list[dict]:
        """Per-instruction (sm, smid, index, opcode, begin, ready, end) of the last launch (trace mode: sm the CTA's
        queue, smid the physical SM it ran on), and for a
        matvec `staged` (its input staged), `streamed` (its last slot consumed), (landed_first, landed_last)
        (the warps reading its first and last slot past their waits; `reached_last`: the last one's reader at its
        wait) and (stream_begin, stream_end): when its weight
        slots began and finished being issued to the copy engine. Nanoseconds from the step's earliest begin.
        Also a matvec's waits for the weight ring, in nanoseconds: `wait_free` and `wait_in_flight` (the
        producer's, for a free slot and for the slot its in-flight cap before to land) and `wait_landed` (consumer
        warp 0's, for its slots to land), and `staging` (consumer thread 0's time in the input's staging, every
        window of it: the consumers' staging up to SPLIT_BATCH, the wait for each window's bulk copy past it)."""
        if not self.options.trace:
            raise RuntimeError("trace records need KernelOptions(trace=True)")
        return decode_trace(self.trace_buf.cpu(), self.queue_lengths.cpu().tolist())


def decode_trace(t: torch.Tensor, lengths: list[int]) -> list[dict]:
    """The trace buffer (int32 [num_sms, max_queue_len, TRACE_WORDS]) as MegakernelEngine.trace_records returns
    it. Stamps are the low 32 bits of globaltimer (ns), stored as int32: each is read as a signed distance from
    the earliest instruction begin, so a stamp before it (the producer warp starts issuing weight slots before
    consumer thread 0 stamps its first begin) comes out negative, not wrapped around."""
    wrap, half = 1 << 31, 1 << 30          # (a step lasts milliseconds: distances within +-1.07 s)

    def signed(word: int, origin: int) -> int:
        return (word - origin + half) % wrap - half

    # the earliest first begin, compared as distances (a raw minimum of int32 words is wrong across the wrap)
    firsts = [int(t[sm, 0, TR_BEGIN]) for sm, n in enumerate(lengths) if n]
    ref = firsts[0] if firsts else 0
    base = min((signed(w, ref) for w in firsts), default=0)

    def ns(word: int) -> int:
        return signed(word, ref) - base

    # the record's stamps by name: always these; a matvec's own (0 in other records) each group where its
    # last word is set
    always = {"begin": TR_BEGIN, "ready": TR_READY, "end": TR_END}
    matvec = [{"staged": TR_STAGED},                 # its input staged (the first window)
              {"streamed": TR_CONSUMED},             # its last weight slot consumed
              # the readers of its first and last slots past their waits, and the last one's reader at its wait
              {"landed_first": TR_LANDED_FIRST, "reached_last": TR_REACHED_LAST, "landed_last": TR_LANDED_LAST},
              # the producer warp: when it began and finished issuing the slots
              {"stream_begin": TR_ISSUED_FIRST, "stream_end": TR_ISSUED_LAST},
              # thread 0 past its last epilogue (up to SPLIT_BATCH), before the signal's barrier and release
              {"epilogue_done": TR_EPILOGUE}]
    out = []
    for sm, n in enumerate(lengths):
        for i in range(n):
            w = [int(v) for v in t[sm, i]]
            rec = {"sm": sm, "smid": int(t[sm, 0, TR_SM]), "index": w[TR_OP] >> 8, "opcode": Opcode(w[TR_OP] & 255).name}
            rec.update({k: ns(w[j]) for k, j in always.items()})
            for group in matvec:
                if w[list(group.values())[-1]]:
                    rec.update({k: ns(w[j]) for k, j in group.items()})
            # a matvec's waits for the weight ring (durations, ns): the producer's, where it issued the slots,
            # and consumer warp 0's, where the consumers were past the last slot
            if "stream_end" in rec:
                rec.update(wait_free=w[TR_WAIT_FREE], wait_in_flight=w[TR_WAIT_IN_FLIGHT])
            if "streamed" in rec and "landed_last" in rec:
                rec.update(wait_landed=w[TR_WAIT_LANDED], staging=w[TR_STAGING])
            out.append(rec)
    return out


# MegakernelEngine keywords that parse_engine_options accepts beside the KernelOptions fields
LAYOUT_OPTIONS = {"fold_embed": bool, "kv_splits": int, "slab_staging": bool,
                  "fuse_attn_reduce": bool, "policy": str, "num_sms": int}


def parse_engine_options(spec: str) -> dict:
    """'fold_embed=0,kv_splits=2,timeout_ns=500000000' -> MegakernelEngine keywords: KernelOptions fields go into
    `options=KernelOptions(...)`, the layout ones (LAYOUT_OPTIONS) are passed as they are. Booleans are
    0/1/true/false. ValueError, naming the item, for an unknown key or a value of the wrong kind."""
    kernel, layout = split_engine_options(spec)
    if kernel:
        layout["options"] = KernelOptions(**kernel)
    return layout


def split_engine_options(spec: str) -> tuple[dict, dict]:
    """parse_engine_options' parse: (KernelOptions keywords, layout keywords)."""
    import dataclasses

    kinds = {f.name: type(f.default) for f in dataclasses.fields(KernelOptions) if f.name != "trace"}
    kernel, layout = {}, {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        kind = kinds.get(key) or LAYOUT_OPTIONS.get(key)
        if not sep or kind is None:
            raise ValueError(f"kernel option {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(kinds) + sorted(LAYOUT_OPTIONS))}")
        text = text.strip()
        if kind is bool:
            if text.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"kernel option {item!r}: {key} takes 0/1/true/false")
            value = text.lower() in ("1", "true")
        elif kind is int:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"kernel option {item!r}: {key} takes an integer") from None
        else:
            value = text
        (kernel if key in kinds else layout)[key] = value
    return kernel, layout


class MegakernelBackend:
    """The engine behind the DecodeBackend protocol (megakernel.integrations.backends)."""

    name = "megakernel"
    max_batch = KERNEL_MAX_BATCH

    def __init__(self, weights: ModelWeights, device: str | torch.device = "cuda", **engine_kw):
        # the backend's step returns the kernel's own next tokens, from the engine's own cache
        for name in ("lm_head", "own_kv_cache"):
            if not engine_kw.get(name, True):
                raise ValueError(f"{name}={engine_kw[name]!r}: the decode backend samples with the kernel's LM "
                                 f"head and decodes in the engine's own KV cache")
        self.weights = weights
        self.device = torch.device(device)
        self.engine_kw = engine_kw
        self.engine: MegakernelEngine | None = None
        self._shape: tuple[int, int] | None = None

    def reset(self, batch: int, max_seq_len: int) -> None:
        require_kernel_batch(batch)
        # the cache is sized in whole blocks; round up so equal requests reuse one compiled kernel
        bs = self.engine_kw.get("block_size", 16)
        max_seq_len = max(bs, 1 << math.ceil(math.log2(max(max_seq_len, 1))))
        if self.engine is None or self._shape != (batch, max_seq_len):
            self.engine = MegakernelEngine(self.weights, batch, max_seq_len, device=self.device, **self.engine_kw)
            self._shape = (batch, max_seq_len)
        elif self.engine.k_cache is not None:
            self.engine.k_cache.fill_(float("nan"))
            self.engine.v_cache.fill_(float("nan"))
        self.engine.bufs.block_table.copy_(contiguous_block_table(
            batch, self.engine.layout.max_seq_len, self.engine.layout.block_size, self.device))

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        if eng is None:
            raise RuntimeError("megakernel: call reset(batch, max_seq_len) before step()")
        eng.bufs.tokens.copy_(tokens)
        eng.bufs.positions.copy_(positions)
        eng.launch()
        return eng.bufs.out_tokens.long()

    def last_logits(self) -> torch.Tensor | None:
        return None if self.engine is None else self.engine.logits

    def check(self) -> None:
        if self.engine is not None:
            self.engine.check()
