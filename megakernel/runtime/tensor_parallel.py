"""Tensor parallel on the GPU: world_size ranks, one megakernel launch per rank per step, each over its shard of the
weights (model.tensor_parallel.shard_weights), running the program of schedule.tensor_parallel (the exchanges
between them are the kernel's: megakernel.kernel.tensor_parallel). The GPU twin of schedule.tensor_parallel's
TPVMDecoder. Two ways to run the ranks, sharing one rank's device state (_Rank):

- TensorParallelEngine: every rank from one process (its peer table filled from the ranks' own data_ptrs);
  ranks on one GPU split its SMs (two ranks of an H200: 66 SMs each).
- TensorParallelRank: one rank per process, one GPU each (vLLM's workers): each process builds the same program
  from the same step arguments, checks through a caller-provided gather that every rank did (runtime.collective),
  and maps the peers' buffers by CUDA IPC (runtime.peers).

A rank's CTAs wait on counters that the other ranks' CTAs signal, so every rank's kernel must be resident at once:
every rank's kernel is loaded and launched once before the first step (_Rank.warm_up: loading a module may wait
for the kernels on the device), and the single-process engine launches every rank before it waits for any. Every
wait is bounded: a rank that stops signalling (or never launches) makes the others fail with the kernel's timeout
error (MegakernelError naming the rank, the instruction and the counter), never hang.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..instructions.layout import (KERNEL_CAPABILITY, PackedWeights, StepLayout, default_kv_splits,
                                   require_kernel_batch, validate_step_inputs)
from ..instructions.record import deserialize, serialize
from ..instructions.tensor_parallel.layout import allocate_tp_buffers, require_kernel_shard
from ..kernel.interpreter import ARG_NAMES, KernelOptions
from ..kernel.stream import PEER_WORDS, TRACE_WORDS
from ..model.config import ModelConfig
from ..model.tensor_parallel import shard_config, shard_weights
from ..model.weights import ModelWeights
from ..schedule import assign
from ..schedule.tensor_parallel import build_tp_program, rank_tables, simulate_ranks
from .engine import (ErrorWord, MegakernelError, _sm_count, allocate_kv_cache, device_weights, fill_kv_table,
                     kernel_arg_tensors, kv_view_strides, reset_sync)
from .collective import Gather, check_digests, collective, program_digest
from .peers import exported_row, ipc_export, ipc_open, peer_row, peer_table_rows, peer_tensors


class _Rank:
    """One rank's device state: its queues, packed shard weights (`shard` packed here, or `packed` as given), buffers,
    KV cache (its own of `num_blocks` blocks, or views bound by bind_kv_caches), peer table and kernel."""

    def __init__(self, program, rank: int, device: torch.device, table: torch.Tensor, lengths: torch.Tensor, *,
                 shard: ModelWeights | None = None, packed: PackedWeights | None = None, num_blocks: int | None = None):
        layout = program.rank_layout(rank)
        c = layout.config
        self.rank, self.device, self.layout = rank, device, layout
        self.queue_table, self.queue_lengths = table.to(device), lengths.to(device)
        self.weights = device_weights(shard, packed, layout, device)
        self.ones = torch.ones(max(c.hidden_size, c.q_size, c.intermediate_size), dtype=torch.bfloat16, device=device)
        self.bufs = allocate_tp_buffers(layout, program.lm_tiles, program.num_counters, device)
        self.kv_table = torch.zeros(c.num_layers, 2, dtype=torch.int64, device=device)
        self.num_blocks = self.kv_strides = self.k_cache = self.v_cache = None
        if num_blocks is not None:
            self.num_blocks = num_blocks
            self.k_cache, self.v_cache, self.kv_strides = allocate_kv_cache(layout, num_blocks, self.kv_table,
                                                                            self.bufs.block_table, device)
        self.trace_buf = torch.zeros(layout.num_sms, table.shape[1], TRACE_WORDS, dtype=torch.int32, device=device)
        self.host_error = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.peers = torch.zeros(program.world_size, PEER_WORDS, dtype=torch.int64, device=device)
        self.stream = torch.cuda.Stream(device)
        self.compiled = None

    def set_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None) -> None:
        """The step's inputs (validated by the caller) into this rank's buffers, on its device."""
        b = self.bufs
        if block_table is not None:
            b.block_table.copy_(torch.as_tensor(block_table).to(torch.int32))
        b.tokens.copy_(torch.as_tensor(tokens).to(device=self.device, dtype=torch.int32))
        b.positions.copy_(torch.as_tensor(positions).to(device=self.device, dtype=torch.int32))

    def bind_kv_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> bool:
        """Read and write per-layer K/V views (vLLM's cache of this rank's kv heads; MegakernelEngine.bind_kv_caches
        says what they must be) in place of the rank's own cache. -> whether the strides changed (the kernel must
        then be compiled again)."""
        num_blocks, strides = kv_view_strides(k_caches, v_caches, self.layout, self.device)
        fill_kv_table(self.kv_table, k_caches, v_caches)
        self.num_blocks, self.k_cache, self.v_cache = num_blocks, None, None
        changed = strides != self.kv_strides
        self.kv_strides = strides
        return changed

    def compile(self, program, options: KernelOptions) -> None:
        from cutlass import Int64

        from ..kernel.compile import KernelKey, compile_decode_kernel
        # the kernel's argmax slots are every rank's LM head tiles (none without the LM head)
        key = KernelKey(self.layout, program.world_size * program.lm_tiles, program.num_counters,
                        self.queue_table.shape[1], self.kv_strides, options)
        self.compiled = compile_decode_kernel(key)
        tensors = kernel_arg_tensors(self.weights, self.bufs, {
            "queue": self.queue_table, "lengths": self.queue_lengths, "ones": self.ones, "kv_table": self.kv_table,
            "trace": self.trace_buf, "host_error": self.host_error, "peers": self.peers})
        self.args = [Int64(tensors[name].data_ptr()) for name in ARG_NAMES]

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """One launch of the rank's kernel on `stream` (default: the rank's own stream)."""
        import cuda.bindings.driver as cuda
        self.compiled(*self.args, cuda.CUstream((stream or self.stream).cuda_stream))

    def warm_up(self) -> None:
        """One launch of the compiled kernel that runs no instruction (every queue length 0) and advances a scratch
        epoch instead of the rank's (its counters, error word and buffers untouched), on this rank's stream.

        The first call of a CuTe DSL compiled function loads its module into the context (cuLibraryLoadData,
        cuKernelGetFunction, the dynamic shared-memory attribute; CUDA's lazy loading: the CUDA programming guide,
        "Lazy Loading", potential hazards, concurrent execution), and loading may wait for the kernels already
        running on the device. Each rank has its own kernel (the rank is a compile-time constant), so without this
        the first step's launch of rank 1 waited for rank 0's kernel, which spun on rank 1's exchange signals
        until its timeout: rank 0 saw only its own tiles on the attention exchange (64 of 128)."""
        import cuda.bindings.driver as cuda
        from cutlass import Int64
        lengths = torch.zeros_like(self.queue_lengths)
        sync = torch.zeros_like(self.bufs.sync)
        args = list(self.args)
        args[ARG_NAMES.index("lengths")] = Int64(lengths.data_ptr())
        args[ARG_NAMES.index("sync")] = Int64(sync.data_ptr())
        # (the first call binds the compiled function to the current device's context: the rank's)
        with torch.cuda.device(self.device):
            self.compiled(*args, cuda.CUstream(self.stream.cuda_stream))
        self.stream.synchronize()        # (the scratch tensors outlive the launch)

    def error(self) -> ErrorWord | None:
        """The error word of the rank's last launches (syncs its device), or None."""
        word = ErrorWord(*self.bufs.error.tolist())
        return word if word.code else None


def _check_devices(devices: set[torch.device]) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the megakernel needs a CUDA GPU (Hopper, sm_90a)")
    for d in devices:
        if torch.cuda.get_device_capability(d) != KERNEL_CAPABILITY:
            raise RuntimeError(f"the megakernel is built for sm_90a (Hopper); {d} is not")


class TensorParallelEngine:
    """One model split over world_size ranks (its heads, FFN and vocabulary; model.tensor_parallel), one batch
    bucket up to SPLIT_BATCH, one KV-cache geometry per rank, every rank driven from this process.
    `devices[rank]` is each rank's GPU (default cuda:0 .. cuda:W-1); ranks on one GPU split its SMs."""

    def __init__(self, weights: ModelWeights, world_size: int, batch: int, max_seq_len: int, *,
                 devices: list | None = None, block_size: int = 16, kv_splits: int | None = None,
                 policy: str = "balanced", options: KernelOptions = KernelOptions()):
        config = weights.config
        require_kernel_batch(batch)
        devices = [torch.device(d) for d in (devices or [f"cuda:{r}" for r in range(world_size)])]
        if len(devices) != world_size:
            raise ValueError(f"{len(devices)} devices for world_size={world_size}: one per rank")
        _check_devices(set(devices))
        require_kernel_shard(config, world_size)      # ValueError where the model does not split W ways
        # every CTA of every rank resident at once: ranks sharing a GPU share its SMs
        sharing = Counter(devices)
        num_sms = min(_sm_count(d) // sharing[d] for d in devices)
        blocks_per_seq = -(-max_seq_len // block_size)
        splits = kv_splits or default_kv_splits(shard_config(config, world_size), batch, num_sms,
                                                blocks_per_seq * block_size)
        self.layout = StepLayout(config=config, batch=batch, kv_splits=splits, block_size=block_size,
                                 max_blocks_per_seq=blocks_per_seq, num_sms=num_sms)
        self.layout.validate()
        self.world_size = world_size
        self.program = build_tp_program(self.layout, world_size)
        tables = rank_tables(self.program, policy)
        # deadlock-free across the ranks, proven before any launch
        simulate_ranks([deserialize(t, n) for t, n in tables], self.program.num_counters, config.num_layers)
        self.num_blocks = batch * blocks_per_seq
        self.ranks = [_Rank(self.program, r, devices[r], *tables[r], shard=w, num_blocks=self.num_blocks)
                      for r, w in enumerate(shard_weights(weights, world_size))]
        rows = torch.tensor([peer_row(peer_tensors(rk.bufs)) for rk in self.ranks], dtype=torch.int64)
        for rk in self.ranks:
            rk.peers.copy_(rows)
            rk.compile(self.program, options)
        # every rank's kernel loaded (and launched once) before any launch that waits on another rank's: loading a
        # module may wait for the kernels running on the device (_Rank.warm_up)
        for rk in self.ranks:
            rk.warm_up()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None = None,
             check: bool = True) -> torch.Tensor:
        """Validated step of every rank -> rank 0's next tokens int32 [B] (every rank picks the same)."""
        validate_step_inputs(self.layout, torch.as_tensor(tokens), torch.as_tensor(positions), block_table,
                             self.num_blocks)
        for rk in self.ranks:
            rk.set_inputs(tokens, positions, block_table)
        self.launch()
        if check:
            self.check()
        return self.ranks[0].bufs.out_tokens

    def launch(self, ranks: list[int] | None = None) -> None:
        """Launch the given ranks' kernels (all by default), every one before waiting for any, each on its own
        stream after what its device's current stream has queued (the inputs' copies)."""
        for r in (range(self.world_size) if ranks is None else ranks):
            rk = self.ranks[r]
            rk.stream.wait_stream(torch.cuda.current_stream(rk.device))
            rk.launch()

    def check(self) -> None:
        """Wait for every rank; MegakernelError naming the first rank that reported an error (after every rank's
        counters, epoch and error word are reset, so the next step runs)."""
        for rk in self.ranks:
            rk.stream.synchronize()
        failed = [(rk.rank, err) for rk in self.ranks if (err := rk.error()) is not None]
        if failed:
            for rk in self.ranks:
                reset_sync(rk.bufs, rk.device, rk.host_error)
            rank, err = failed[0]
            raise MegakernelError(f"rank {rank} of {self.world_size}: {err.describe(self.program)}")

    @property
    def logits(self) -> torch.Tensor:
        """float32 [B, V] of the last step: the ranks' vocabulary slices side by side (on rank 0's device)."""
        dev = self.ranks[0].device
        return torch.cat([rk.bufs.logits.to(dev) for rk in self.ranks], dim=1)


class TensorParallelRank:
    """One rank of a tensor-parallel step, in its own process on its own GPU: what MegakernelEngine is to one GPU
    (bufs, launch, check, error_flag, bind_kv_caches, step / step_hidden), for rank `rank` of world_size.

    Every rank's process builds one with the same step arguments (`config`: the whole model's; batch, max_seq_len,
    block_size, kv_splits, num_sms, policy, options, fold_embed, fuse_attn_reduce, scratch_block, lm_head) and its
    own `shard` (a ModelWeights over model.tensor_parallel.shard_config(config, world_size), with the whole
    embedding: tokens are vocabulary ids; or `packed_weights` from pack_weights of it). The KV cache is the rank's
    own (`num_blocks`, default batch x blocks per sequence) or vLLM's (`kv_caches=(k views, v views)` of the rank's
    kv heads; MegakernelEngine.bind_kv_caches says what they must be), bound before the kernel is compiled for its
    strides. lm_head=False: the program ends at x[L] (bufs.x[-1]), and the caller writes tokens and positions
    before every launch (vLLM computes the logits from the final hidden state itself).

    Construction is collective, through `gather(obj) -> [every rank's obj, rank order]` (vLLM: all_gather_object
    over the tensor-parallel group's CPU group): every rank builds its state and exports its peer-visible buffers
    (runtime.peers), the gather (runtime.collective) checks that every rank's program digest is rank 0's
    (ProgramMismatchError) and hands each rank the others' exports; each rank opens them, writes its peer table,
    compiles and warms up its kernel, and a last gather is the barrier before any rank's first step. A failure on
    any rank raises TensorParallelSetupError on every rank, at the same gather. `num_sms` defaults to this GPU's SM
    count: ranks on different GPU models build different programs, which the digest check refuses. `export` /
    `open_` are the IPC pair (runtime.peers.ipc_export / ipc_open).

    After any rank's kernel error, every rank calls reset_sync() before the next step (the ranks' counters count each
    other's signals)."""

    def __init__(self, shard: ModelWeights, config: ModelConfig, world_size: int, rank: int, batch: int,
                 max_seq_len: int, *, gather: Gather, device: str | torch.device, block_size: int = 16,
                 kv_splits: int | None = None, num_sms: int | None = None, policy: str = "balanced",
                 options: KernelOptions = KernelOptions(), fold_embed: bool = False,
                 fuse_attn_reduce: bool | None = None, scratch_block: int = -1, lm_head: bool = True,
                 num_blocks: int | None = None, kv_caches: tuple[list, list] | None = None,
                 packed_weights: PackedWeights | None = None, export=ipc_export, open_=ipc_open):
        self.world_size, self.rank, self.options = world_size, rank, options
        self.device = torch.device(device)
        what = f"tensor-parallel rank {rank} of {world_size}"

        def build():
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            _check_devices({self.device})
            require_kernel_batch(batch)
            require_kernel_shard(config, world_size)
            if not 0 <= rank < world_size:
                raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
            want = shard_config(config, world_size)
            if shard.config != want:
                raise ValueError(f"the shard's config is {shard.config}; rank {rank} of {config.name} split "
                                 f"{world_size} ways needs {want}")
            if kv_caches is not None and num_blocks is not None:
                raise ValueError(f"num_blocks={num_blocks} sizes the rank's own KV cache; kv_caches brings one")
            sms = num_sms or _sm_count(self.device)
            blocks_per_seq = -(-max_seq_len // block_size)
            self.layout = StepLayout(
                config=config, batch=batch, block_size=block_size, max_blocks_per_seq=blocks_per_seq, num_sms=sms,
                kv_splits=kv_splits or default_kv_splits(want, batch, sms, blocks_per_seq * block_size),
                fold_embed=fold_embed, fuse_attn_reduce=fuse_attn_reduce, scratch_block=scratch_block)
            self.layout.validate()
            self.program = build_tp_program(self.layout, world_size, lm_head=lm_head)
            queues = assign(self.program, policy)
            simulate_ranks([queues] * world_size, self.program.num_counters, config.num_layers)
            table, lengths = serialize(queues)
            own = None if kv_caches is not None else (num_blocks or batch * blocks_per_seq)
            self._rk = _Rank(self.program, rank, self.device, table, lengths, shard=shard, packed=packed_weights,
                             num_blocks=own)
            if kv_caches is not None:
                self._rk.bind_kv_caches(*kv_caches)
            digest = program_digest(self.program.layout, self.program.world_size, self.program.lm_tiles,
                                    self.program.num_counters, table, lengths, options)
            torch.cuda.synchronize(self.device)      # the buffers settled before a peer maps them
            return digest, exported_row(peer_tensors(self._rk.bufs), export)

        built = collective(gather, rank, world_size, f"{what}: building", build)
        check_digests([digest for digest, _ in built], what)

        def connect():
            rows, self._opened = peer_table_rows(rank, peer_tensors(self._rk.bufs), [e for _, e in built],
                                                 self.device, open_)
            self._rk.peers.copy_(torch.tensor(rows, dtype=torch.int64))
            self._rk.compile(self.program, options)
            self._rk.warm_up()

        # (the last gather is the barrier: no rank launches before every rank's kernel is loaded)
        collective(gather, rank, world_size, f"{what}: connecting", connect)

    @property
    def bufs(self):
        """The rank's TPStepBuffers (tokens, positions, block_table inputs; x[L] = bufs.x[-1])."""
        return self._rk.bufs

    @property
    def num_blocks(self) -> int:
        return self._rk.num_blocks

    @property
    def has_lm_head(self) -> bool:
        return self.program.has_lm_head

    def bind_kv_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Bind other K/V views (vLLM re-allocated its cache): the address table changes in place; other strides
        compile the kernel again (and warm it up) on this rank alone, which every rank does alike, since their
        caches share one geometry."""
        if self._rk.bind_kv_caches(k_caches, v_caches):
            self._rk.compile(self.program, self.options)
            self._rk.warm_up()

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """One step of this rank from the current device inputs: one launch on `stream` (default: the device's
        current stream, so vLLM's CUDA graphs capture it). The peers launch theirs; until they do, this rank's
        kernel waits on their exchange signals (bounded by the kernel's timeout)."""
        self._rk.launch(stream or torch.cuda.current_stream(self.device))

    def check(self) -> None:
        """MegakernelError naming this rank if its last launches reported an error (syncs the device), after its
        counters, epoch and error word are reset (the peers must reset theirs too: reset_sync)."""
        err = self._rk.error()
        if err is not None:
            reset_sync(self._rk.bufs, self.device, self._rk.host_error)
            raise MegakernelError(f"rank {self.rank} of {self.world_size}: {err.describe(self.program)}")

    def reset_sync(self) -> None:
        """Zero this rank's counters, epoch and error word (and the error's host copy). The ranks' counters count
        each other's exchange signals, so after any rank's error every rank resets before the next step (check()
        resets the failed rank's own), with no kernel of any rank running: the caller's to coordinate, as it
        coordinates the steps."""
        reset_sync(self._rk.bufs, self.device, self._rk.host_error)

    def error_flag(self) -> int | None:
        """The error code of a failed step from mapped host memory, no device sync (MegakernelEngine.error_flag)."""
        code = int(self._rk.host_error[0])
        return code or None

    def _set_inputs(self, tokens, positions, block_table) -> None:
        validate_step_inputs(self.layout, torch.as_tensor(tokens), torch.as_tensor(positions), block_table,
                             self.num_blocks)
        self._rk.set_inputs(tokens, positions, block_table)

    def step(self, tokens, positions, block_table=None, check: bool = True) -> torch.Tensor:
        """Validated step -> next tokens int32 [B] (every rank picks the same; a view of bufs.out_tokens). Every
        rank's process must step alike. RuntimeError for a rank built with lm_head=False (use step_hidden)."""
        if not self.has_lm_head:
            raise RuntimeError("step(): this rank was built with lm_head=False, so its step has no LM head and no "
                               "ARGMAX and yields no next tokens; use step_hidden()")
        self.step_hidden(tokens, positions, block_table, check)
        return self.bufs.out_tokens

    def step_hidden(self, tokens, positions, block_table=None, check: bool = True) -> torch.Tensor:
        """Validated step -> x[L] float32 [B, H] (a view of bufs.x[-1]; every rank holds the same bits)."""
        self._set_inputs(tokens, positions, block_table)
        self.launch()
        if check:
            torch.cuda.current_stream(self.device).synchronize()
            self.check()
        return self.bufs.x[-1]

    @property
    def logits(self) -> torch.Tensor:
        """float32 [B, V / world_size]: this rank's vocabulary slice of the last step's logits."""
        if not self.has_lm_head:
            raise RuntimeError("logits: this rank was built with lm_head=False and computes none")
        return self.bufs.logits
