"""One tensor-parallel rank per process (runtime.tensor_parallel.TensorParallelRank), on the CPU: the agreement
through the caller's gather (runtime.collective), the peer table each rank ends with (runtime.peers, with an
identity export/open pair on CPU tensors), and the setup's collective failures: a rank that fails or builds
another program makes every rank raise the same named error at the same gather. Ranks are threads
(megakernel.testing.ranks); the device state is a CPU stand-in for _Rank (buffers and table, no stream or
kernel). The launch itself needs two GPUs: tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.instructions.tensor_parallel.layout import allocate_tp_buffers
from megakernel.kernel.stream import PEER_COUNTERS, PEER_LM_IDX, PEER_LM_MAX, PEER_RECV_DOWN, PEER_RECV_O, PEER_WORDS
from megakernel.model.presets import get_preset
from megakernel.model.tensor_parallel import shard_weights
from megakernel.model.weights import random_weights
from megakernel.runtime import tensor_parallel as tp
from megakernel.runtime.collective import (ProgramMismatchError, TensorParallelSetupError, agreed_reason, collective,
                                           gather_checked)
from megakernel.runtime.peers import peer_row, peer_table_rows, peer_tensors
from megakernel.testing.ranks import run_rank_threads

# q_size / 2 and intermediate_size / 2 in whole column passes of 256 (require_kernel_shard)
CONFIG = dataclasses.replace(get_preset("tiny-llama"), num_heads=8, intermediate_size=1024, name="tiny-llama-tp")
W = 2


# ---- runtime.collective ------------------------------------------------------------------------------------------

def test_collective_returns_every_ranks_value_in_rank_order():
    out = run_rank_threads(3, lambda r, g: collective(g.gather_object(r), r, 3, "counting", lambda: 10 * r))
    assert out == [[0, 10, 20]] * 3


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank():
    def fn(rank, group):
        def work():
            if rank == 1:
                raise ValueError("no memory for the cache")
            return rank
        return collective(group.gather_object(rank), rank, 3, "building", work)

    out = run_rank_threads(3, fn)
    assert all(isinstance(e, TensorParallelSetupError) for e in out), out
    assert {str(e) for e in out} == {"building failed on 1 of 3 ranks: rank 1: ValueError: no memory for the cache"}
    assert isinstance(out[1].__cause__, ValueError) and out[0].__cause__ is None


def test_the_process_group_gather_is_all_gather_object_over_the_group(tmp_path):
    """process_group_gather on a one-rank gloo group (a file store), over the default group and over a subgroup:
    the list of the ranks' objects, here [this rank's]. (Rank order across processes: tests/e2e/test_tensor_parallel.py,
    which gathers through it.)"""
    import datetime

    import torch.distributed as dist

    from megakernel.runtime.collective import process_group_gather

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        assert process_group_gather()({"rank": 0, "x": [1, 2]}) == [{"rank": 0, "x": [1, 2]}]
        group = dist.new_group([0], backend="gloo")
        assert process_group_gather(group)(("built", 7)) == [("built", 7)]
    finally:
        dist.destroy_process_group()


def test_agreed_reason_is_none_only_where_no_rank_has_one():
    assert run_rank_threads(2, lambda r, g: agreed_reason(g.gather_object(r), r, 2, None)) == [None, None]
    out = run_rank_threads(3, lambda r, g: agreed_reason(g.gather_object(r), r, 3,
                                                         "the GPU is sm_80" if r == 2 else None))
    assert out == ["rank 2: the GPU is sm_80"] * 3


@pytest.mark.parametrize("entries,why", [([{"rank": 0}], "entries of ranks \\[0\\]; expected one per rank of 2"),
                                         ([{"rank": 1}, {"rank": 0}], "ranks \\[1, 0\\]"),
                                         ([{"rank": 0}, "x"], "ranks \\[0, None\\]")])
def test_a_gather_of_the_wrong_length_or_order_is_refused(entries, why):
    with pytest.raises(TensorParallelSetupError, match=why):
        gather_checked(lambda obj: entries, {"rank": 0}, 2, "exchanging")


# ---- runtime.peers ----------------------------------------------------------------------------------------------

def _bufs(rank: int, lm_tiles: int = 3):
    from megakernel.instructions.layout import StepLayout
    from megakernel.instructions.tensor_parallel.layout import ShardLayout
    layout = ShardLayout.of(StepLayout(config=CONFIG, batch=2, kv_splits=1, block_size=16, max_blocks_per_seq=2,
                                       num_sms=7), W, rank)
    return allocate_tp_buffers(layout, lm_tiles, 40)


def test_the_peer_table_has_every_ranks_buffers_in_rank_order():
    """Rank r's table: row s holds rank s's recv_o, recv_down, lm_max, lm_idx and counters, opened from rank s's
    export (its own row from its own buffers, never exported to itself)."""
    bufs = [_bufs(r) for r in range(W)]
    exports = [{word: ("handle", s, t) for word, t in peer_tensors(b).items()} for s, b in enumerate(bufs)]
    for rank in range(W):
        opened = []

        def open_(handle, device):
            opened.append((handle[1], device))
            return handle[2]
        rows, kept = peer_table_rows(rank, peer_tensors(bufs[rank]), exports, torch.device("cpu"), open_)
        for s, b in enumerate(bufs):
            want = {PEER_RECV_O: b.recv_o, PEER_RECV_DOWN: b.recv_down, PEER_LM_MAX: b.lm_max, PEER_LM_IDX: b.lm_idx,
                    PEER_COUNTERS: b.counters}
            assert rows[s] == [want[w].data_ptr() for w in range(PEER_WORDS)], f"rank {rank}'s row {s}"
        assert {s for s, _ in opened} == {1 - rank} and len(kept) == PEER_WORDS, f"rank {rank} opened {opened}"


def test_a_peers_buffer_is_opened_on_this_ranks_own_device():
    """ipc_open rebuilds torch's export with this rank's device index in place of the exporter's (storage_device of
    torch.multiprocessing.reductions.rebuild_cuda_tensor), so the mapping is made in this rank's context."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from megakernel.runtime.peers import ipc_open
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert "storage_device" in params, params

    def rebuild(tensor_cls, storage_device, storage_handle):
        return tensor_cls, storage_device, storage_handle
    assert ipc_open((rebuild, ("T", 0, b"handle")), torch.device("cuda", 1)) == ("T", 1, b"handle")


def test_a_program_without_the_lm_head_exports_no_argmax_slots():
    row = peer_row(peer_tensors(_bufs(0, lm_tiles=0)))
    assert row[PEER_LM_MAX] == row[PEER_LM_IDX] == 0 and all(row[w] for w in (PEER_RECV_O, PEER_RECV_DOWN,
                                                                              PEER_COUNTERS))


# ---- TensorParallelRank's setup ---------------------------------------------------------------------------------

class _CpuRank(tp._Rank):
    """_Rank's buffers and peer table on the CPU; compile and warm_up record what the table held then."""

    def __init__(self, program, rank, device, table, lengths, *, shard=None, packed=None, num_blocks=None):
        self.rank, self.device, self.layout = rank, device, program.rank_layout(rank)
        self.queue_table, self.queue_lengths = table, lengths
        self.bufs = allocate_tp_buffers(self.layout, program.lm_tiles, program.num_counters)
        self.peers = torch.zeros(program.world_size, PEER_WORDS, dtype=torch.int64)
        self.num_blocks, self.kv_strides, self.shard = num_blocks, None, shard
        self.events = []

    def compile(self, program, options):
        self.events.append(("compile", self.peers.clone()))

    def warm_up(self):
        self.events.append(("warm_up",))


@pytest.fixture
def cpu_ranks(monkeypatch):
    monkeypatch.setattr(tp, "_Rank", _CpuRank)
    monkeypatch.setattr(tp, "_check_devices", lambda devices: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _build(weights, rank, group, exported=None, **over):
    """Rank `rank`'s TensorParallelRank on the CPU, the export identity (recorded in `exported`) and open identity."""
    kw = dict(gather=group.gather_object(rank), device="cpu", num_sms=7, kv_splits=2,
              export=lambda t: (exported.append((rank, t)) if exported is not None else None) or t,
              open_=lambda handle, device: handle)
    kw.update(over)
    return tp.TensorParallelRank(shard_weights(weights, W)[rank], weights.config, W, rank, 2, 32, **kw)


@pytest.mark.parametrize("lm_head", [True, False])
def test_each_rank_ends_with_every_ranks_buffers_before_it_compiles(cpu_ranks, lm_head):
    """Two gathers per rank (build + export, then connect as the barrier); each rank's table, when it compiles, holds
    every rank's buffers in rank order; then it warms up; the ranks' programs are one program."""
    weights = random_weights(CONFIG, seed=5, dtype=torch.bfloat16)
    exported = []
    ranks = run_rank_threads(W, lambda r, g: (_build(weights, r, g, exported, lm_head=lm_head), g.calls[r]))
    assert all(not isinstance(x, BaseException) for x in ranks), ranks
    engines = [e for e, _ in ranks]
    assert [calls for _, calls in ranks] == [2, 2]
    want = torch.tensor([peer_row(peer_tensors(e.bufs)) for e in engines], dtype=torch.int64)
    for e in engines:
        assert [name for name, *_ in e._rk.events] == ["compile", "warm_up"], e.rank
        assert torch.equal(e._rk.events[0][1], want), f"rank {e.rank}'s table at compile time"
        assert e.program.instructions == engines[0].program.instructions and e.has_lm_head == lm_head
        assert e._rk.shard.meta["rank"] == e.rank
    sent = {(r, t.data_ptr()) for r, t in exported}
    words = 5 if lm_head else 3
    assert len(sent) == W * words and all(t.numel() for _, t in exported)


def test_a_rank_that_builds_another_program_stops_every_rank(cpu_ranks):
    """Rank 1 asks for other KV splits: ProgramMismatchError on both ranks at the first gather, nothing compiled."""
    weights = random_weights(CONFIG, seed=6, dtype=torch.bfloat16)
    out = run_rank_threads(W, lambda r, g: _build(weights, r, g, kv_splits=2 + r))
    assert all(isinstance(e, ProgramMismatchError) for e in out), out
    assert all("ranks [1] built another program than rank 0" in str(e) for e in out), out


def test_a_rank_that_fails_to_build_stops_every_rank_before_any_peer_is_opened(cpu_ranks):
    """Rank 1 is handed rank 0's shard config with another world size: both raise TensorParallelSetupError naming
    rank 1 at the first gather; nobody opened a peer's buffers or compiled."""
    weights = random_weights(CONFIG, seed=7, dtype=torch.bfloat16)
    opened = []

    def fn(rank, group):
        kw = dict(open_=lambda handle, device: opened.append(rank) or handle)
        if rank == 1:
            return tp.TensorParallelRank(weights, CONFIG, W, rank, 2, 32, gather=group.gather_object(rank),
                                         device="cpu", num_sms=7, kv_splits=2, export=lambda t: t, **kw)
        return _build(weights, rank, group, **kw)

    out = run_rank_threads(W, fn)
    assert all(isinstance(e, TensorParallelSetupError) for e in out), out
    assert all("building failed on 1 of 2 ranks: rank 1: ValueError: the shard's config is" in str(e) for e in out)
    assert opened == []


def test_a_rank_that_fails_to_connect_stops_every_rank_at_the_barrier(cpu_ranks):
    """Rank 0 cannot open rank 1's buffers (e.g. no peer access): both raise at the second gather, so rank 1 never
    steps alone."""
    weights = random_weights(CONFIG, seed=8, dtype=torch.bfloat16)

    def refuse(handle, device):
        raise RuntimeError("peer access is not supported between these GPUs")

    out = run_rank_threads(W, lambda r, g: _build(weights, r, g, **({"open_": refuse} if r == 0 else {})))
    assert all(isinstance(e, TensorParallelSetupError) for e in out), out
    assert all("connecting failed on 1 of 2 ranks: rank 0: RuntimeError: peer access" in str(e) for e in out), out
