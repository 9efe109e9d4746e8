"""The peer table of a tensor-parallel rank that runs in its own process (one GPU each, vLLM's workers): which
buffers a peer reaches, how they are exported and opened, and the table's rows.

A rank's kernel stores its exchange partials into every rank's receive buffers and argmax slots, and signals
every rank's counters, through its peer table (int64 [world_size, stream.PEER_WORDS], rank order, its own row
included; kernel/tensor_parallel.py). Within one process the rows are the ranks' own data_ptrs
(runtime.tensor_parallel.TensorParallelEngine). Across processes each rank exports its peer-visible buffers as
CUDA IPC handles (torch.multiprocessing.reductions.reduce_tensor: torch's own IPC machinery, which sends the
handle of the caching allocator's whole block and the tensor's offset in it), gathers every rank's
(runtime.collective), opens the peers' in its own process and writes the mapped addresses into its table. Nothing
here creates a multicast object: the exchange is plain peer-to-peer stores and atomics (NVLink multicast stays
off on these hosts). `export` / `open_` are parameters, so the logic runs on the CPU with an identity pair.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..kernel.stream import PEER_COUNTERS, PEER_LM_IDX, PEER_LM_MAX, PEER_RECV_DOWN, PEER_RECV_O, PEER_WORDS

# The buffers a peer reaches, by their word in a peer table row (stream.PEER_*): TPStepBuffers fields.
PEER_BUFFERS = {PEER_RECV_O: "recv_o", PEER_RECV_DOWN: "recv_down", PEER_LM_MAX: "lm_max", PEER_LM_IDX: "lm_idx",
                PEER_COUNTERS: "counters"}


def peer_tensors(bufs) -> dict[int, torch.Tensor]:
    """A rank's peer-visible buffers by their peer-table word."""
    return {word: getattr(bufs, name) for word, name in PEER_BUFFERS.items()}


def peer_row(tensors: dict[int, torch.Tensor]) -> list[int]:
    """A peer table row (PEER_WORDS int64) of the given buffers' addresses; 0 for an empty or absent one (a program
    without the LM head has no argmax slots, and no instruction reads that word)."""
    row = [0] * PEER_WORDS
    for word, t in tensors.items():
        row[word] = t.data_ptr() if t.numel() else 0
    return row


def ipc_export(t: torch.Tensor):
    """A picklable CUDA IPC handle of `t` (reduce_tensor's (rebuild function, arguments)). The caller keeps `t`
    alive while any peer has it open, and its contents settled (its device synchronized) before the export."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(t)


def ipc_open(exported, device: torch.device) -> torch.Tensor:
    """A peer's exported tensor, opened in this process with `device` current: the mapping is made in this rank's
    own context, and CUDA enables peer access from this GPU to the peer's (cudaIpcMemLazyEnablePeerAccess, which
    torch opens with), so this rank's kernel can store into it. The returned tensor reports `device` though its
    memory is the peer's: only its data_ptr is used."""
    rebuild, args = exported
    args = list(args)
    args[list(inspect.signature(rebuild).parameters).index("storage_device")] = torch.device(device).index
    return rebuild(*args)


def exported_row(tensors: dict[int, torch.Tensor], export: Callable = ipc_export) -> dict[int, Any]:
    """What a rank sends its peers: each non-empty peer-visible buffer's export, by word."""
    return {word: export(t) for word, t in tensors.items() if t.numel()}


def peer_table_rows(rank: int, own: dict[int, torch.Tensor], exports: list[dict[int, Any]], device: torch.device,
                    open_: Callable = ipc_open) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every rank's peer table row, rank order: this rank's from its own buffers, every other rank's from its
    exports (exports[r]) opened here. -> (rows, the opened tensors: keep them while the table is in use)."""
    rows, opened = [], []
    for r, exported in enumerate(exports):
        if r == rank:
            rows.append(peer_row(own))
            continue
        mapped = {word: open_(handle, device) for word, handle in exported.items()}
        opened += mapped.values()
        rows.append(peer_row(mapped))
    return rows, opened
