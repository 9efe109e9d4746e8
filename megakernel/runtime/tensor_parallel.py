"""Tensor parallel on the GPU: world_size ranks, one megakernel launch per rank per step, each over its shard of the
weights (model.tensor_parallel.shard_weights), running the program of schedule.tensor_parallel (the exchanges
between them are the kernel's: megakernel.kernel.tensor_parallel). The GPU twin of schedule.tensor_parallel's
TPVMDecoder.

A rank's CTAs wait on counters that the other ranks' CTAs signal, so every rank's kernel must be resident at once:
ranks on one GPU split its SMs (two ranks of an H200: 66 SMs each), every rank's kernel is loaded and launched
once before the first step (_Rank.warm_up: loading a module may wait for the kernels on the device), and step()
launches every rank before it waits for any. Every wait is bounded: a rank that stops signalling makes the others
fail with the kernel's timeout error (MegakernelError naming the rank, the instruction and the counter), never hang.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..instructions.layout import (COL_PASS, KERNEL_CAPABILITY, StepLayout, default_kv_splits, pack_weights,
                                   require_kernel_batch, validate_step_inputs)
from ..instructions.record import deserialize
from ..instructions.tensor_parallel.layout import allocate_tp_buffers
from ..kernel.interpreter import ARG_NAMES, KernelOptions
from ..kernel.stream import (PEER_COUNTERS, PEER_LM_IDX, PEER_LM_MAX, PEER_RECV_DOWN, PEER_RECV_O, PEER_WORDS,
                             TRACE_WORDS)
from ..model.kv_cache import contiguous_block_table
from ..model.tensor_parallel import shard_config, shard_weights
from ..model.weights import ModelWeights
from ..schedule.tensor_parallel import build_tp_program, rank_tables, simulate_ranks
from .engine import ErrorWord, MegakernelError, _sm_count, kernel_arg_tensors, reset_sync


class _Rank:
    """One rank's device state: its queues, packed shard weights, buffers, KV cache, peer table and kernel."""

    def __init__(self, engine: "TensorParallelEngine", rank: int, shard: ModelWeights, device: torch.device,
                 table: torch.Tensor, lengths: torch.Tensor):
        layout = engine.program.rank_layout(rank)
        c = layout.config
        self.rank, self.device, self.layout = rank, device, layout
        self.queue_table, self.queue_lengths = table.to(device), lengths.to(device)
        self.weights = pack_weights(shard.to(device=device, dtype=torch.bfloat16), layout.max_seq_len).to(device)
        self.ones = torch.ones(max(c.hidden_size, c.q_size, c.intermediate_size), dtype=torch.bfloat16, device=device)
        self.bufs = allocate_tp_buffers(layout, engine.program.lm_tiles, engine.program.num_counters, device)
        self.num_blocks = engine.num_blocks
        shape = (c.num_layers, self.num_blocks, layout.block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
        self.v_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
        self.kv_table = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in
                                      zip(self.k_cache.unbind(0), self.v_cache.unbind(0))], dtype=torch.int64,
                                     device=device)
        self.trace_buf = torch.zeros(layout.num_sms, table.shape[1], TRACE_WORDS, dtype=torch.int32, device=device)
        self.host_error = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.peers = torch.zeros(engine.world_size, PEER_WORDS, dtype=torch.int64, device=device)
        self.stream = torch.cuda.Stream(device)
        self.compiled = None

    def peer_row(self) -> list[int]:
        """This rank's row of every rank's peer table (stream.PEER_WORDS order)."""
        row = [0] * PEER_WORDS
        b = self.bufs
        row[PEER_RECV_O], row[PEER_RECV_DOWN] = b.recv_o.data_ptr(), b.recv_down.data_ptr()
        row[PEER_LM_MAX], row[PEER_LM_IDX], row[PEER_COUNTERS] = (b.lm_max.data_ptr(), b.lm_idx.data_ptr(),
                                                                  b.counters.data_ptr())
        return row

    def compile(self, program, options: KernelOptions) -> None:
        from cutlass import Int64

        from ..kernel.compile import KernelKey, compile_decode_kernel
        # the kernel's argmax slots are every rank's LM head tiles
        key = KernelKey(self.layout, program.world_size * program.lm_tiles, program.num_counters,
                        self.queue_table.shape[1], tuple(self.k_cache.stride()[1:4]), options)
        self.compiled = compile_decode_kernel(key)
        tensors = kernel_arg_tensors(self.weights, self.bufs, {
            "queue": self.queue_table, "lengths": self.queue_lengths, "ones": self.ones, "kv_table": self.kv_table,
            "trace": self.trace_buf, "host_error": self.host_error, "peers": self.peers})
        self.args = [Int64(tensors[name].data_ptr()) for name in ARG_NAMES]

    def launch(self) -> None:
        import cuda.bindings.driver as cuda
        self.compiled(*self.args, cuda.CUstream(self.stream.cuda_stream))

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


class TensorParallelEngine:
    """One model split over world_size ranks (its heads, FFN and vocabulary; model.tensor_parallel), one batch
    bucket up to SPLIT_BATCH, one KV-cache geometry per rank. `devices[rank]` is each rank's GPU (default
    cuda:0 .. cuda:W-1); ranks on one GPU split its SMs."""

    def __init__(self, weights: ModelWeights, world_size: int, batch: int, max_seq_len: int, *,
                 devices: list | None = None, block_size: int = 16, kv_splits: int | None = None,
                 policy: str = "balanced", options: KernelOptions = KernelOptions()):
        config = weights.config
        require_kernel_batch(batch)
        if not torch.cuda.is_available():
            raise RuntimeError("the megakernel needs a CUDA GPU (Hopper, sm_90a)")
        devices = [torch.device(d) for d in (devices or [f"cuda:{r}" for r in range(world_size)])]
        if len(devices) != world_size:
            raise ValueError(f"{len(devices)} devices for world_size={world_size}: one per rank")
        for d in set(devices):
            if torch.cuda.get_device_capability(d) != KERNEL_CAPABILITY:
                raise RuntimeError(f"the megakernel is built for sm_90a (Hopper); {d} is not")
        shard = shard_config(config, world_size)      # ValueError where the model does not split W ways
        for name, cols in (("q_size", shard.q_size), ("intermediate_size", shard.intermediate_size)):
            if cols % COL_PASS:
                raise ValueError(f"{name} / world_size = {cols}: a rank's O and down projections read whole passes "
                                 f"of {COL_PASS} columns")
        # every CTA of every rank resident at once: ranks sharing a GPU share its SMs
        sharing = Counter(devices)
        num_sms = min(_sm_count(d) // sharing[d] for d in devices)
        blocks_per_seq = -(-max_seq_len // block_size)
        splits = kv_splits or default_kv_splits(shard, batch, num_sms, blocks_per_seq * block_size)
        self.layout = StepLayout(config=config, batch=batch, kv_splits=splits, block_size=block_size,
                                 max_blocks_per_seq=blocks_per_seq, num_sms=num_sms)
        self.layout.validate()
        self.world_size = world_size
        self.program = build_tp_program(self.layout, world_size)
        tables = rank_tables(self.program, policy)
        # deadlock-free across the ranks, proven before any launch
        simulate_ranks([deserialize(t, n) for t, n in tables], self.program.num_counters, config.num_layers)
        self.num_blocks = batch * blocks_per_seq
        self.ranks = [_Rank(self, r, w, devices[r], *tables[r])
                      for r, w in enumerate(shard_weights(weights, world_size))]
        rows = torch.tensor([rk.peer_row() for rk in self.ranks], dtype=torch.int64)
        for rk in self.ranks:
            rk.peers.copy_(rows)
            rk.bufs.block_table.copy_(contiguous_block_table(batch, blocks_per_seq * block_size, block_size,
                                                             rk.device))
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
            b = rk.bufs
            if block_table is not None:
                b.block_table.copy_(torch.as_tensor(block_table).to(torch.int32))
            b.tokens.copy_(torch.as_tensor(tokens).to(device=rk.device, dtype=torch.int32))
            b.positions.copy_(torch.as_tensor(positions).to(device=rk.device, dtype=torch.int32))
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
        failed = [(rk.rank, ErrorWord(*rk.bufs.error.tolist())) for rk in self.ranks if int(rk.bufs.error[0])]
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
