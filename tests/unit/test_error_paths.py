"""What a failed step leaves behind, and launches the GPU cannot make resident (GPU, marker `gpu`).

A step that fails inside the kernel (a position past the cache, a wait that times out) writes no cache slot
of the sequence it failed on; every launch after it runs no instruction and writes nothing until the host
acknowledges the error (`check()` raises and resets, so the next step runs); the launch after the failed one
copies the error code to mapped host memory, which `error_flag()` reads without a device sync, so graph
replays notice it. The kernel is a cooperative launch: with another kernel holding an SM, the launch waits
until every CTA can be resident instead of starting CTAs that spin on one that is not.

Fresh random weights and cache, outputs poisoned before the launches, logits against the float32 reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.testing.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

GPU = "cuda"
BLOCK = 16
MAX_SEQ = 64


def _engine(name: str, batch: int, seed: int, **kw):
    from megakernel.runtime.engine import MegakernelEngine

    weights = random_weights(get_preset(name), seed=seed, dtype=torch.bfloat16, device=GPU, rng_device=GPU)
    eng = MegakernelEngine(weights, batch, MAX_SEQ, block_size=BLOCK, kv_splits=2, device=GPU, **kw)
    gen = torch.Generator(device=GPU).manual_seed(seed)
    eng.k_cache.normal_(generator=gen)
    eng.v_cache.normal_(generator=gen)
    return weights, eng


def _state(eng) -> dict[str, torch.Tensor]:
    """Everything a launch may write: the cache, the step's inputs and outputs, the counters."""
    b = eng.bufs
    return {name: t.clone() for name, t in (("k_cache", eng.k_cache), ("v_cache", eng.v_cache), ("tokens", b.tokens),
                                           ("positions", b.positions), ("out_tokens", b.out_tokens),
                                           ("logits", b.logits), ("counters", b.counters))}


def _assert_unchanged(before: dict, eng, what: str) -> None:
    for name, t in _state(eng).items():
        assert torch.equal(t.nan_to_num(7.0), before[name].nan_to_num(7.0)), f"{what}: {name} was written"


def _assert_later_launches_change_nothing(eng, launch, what: str) -> None:
    """Three launches (`launch()`: the bare launch or a graph replay) after a failed step run no instruction:
    nothing a launch may write changes."""
    failed = _state(eng)
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    _assert_unchanged(failed, eng, what)


def _check_step(weights, eng, tokens, positions, what: str) -> None:
    """One checked step against the float32 reference on the cache as it is before the step."""
    from megakernel.model.reference import ReferenceDecoder

    table = contiguous_block_table(eng.layout.batch, eng.layout.max_seq_len, BLOCK, GPU)
    cache = PagedKVCache(k=eng.k_cache.clone(), v=eng.v_cache.clone(), block_size=BLOCK)
    eng.bufs.poison()
    eng.step(tokens, positions, table)
    ref = ReferenceDecoder(weights).step(tokens.to(GPU), positions.to(GPU), cache, table.long())
    assert_close(eng.logits, ref, torch.bfloat16, context=what)


def test_a_step_with_a_bad_position_writes_no_slot_of_its_sequence_and_later_launches_run_nothing():
    from megakernel.kernel.interpreter import ERR_POSITION
    from megakernel.runtime.engine import MegakernelError

    weights, eng = _engine("tiny-llama", 2, seed=61)
    c = weights.config
    gen = torch.Generator().manual_seed(61)
    tokens = torch.randint(0, c.vocab_size, (2,), generator=gen).int()
    good = int(torch.randint(1, MAX_SEQ - 1, (1,), generator=gen))
    eng.bufs.poison()
    before = _state(eng)
    # launch() is the unchecked path (graph replays, vLLM): the bad position reaches the kernel
    eng.bufs.tokens.copy_(tokens)
    eng.bufs.positions.copy_(torch.tensor([good, MAX_SEQ + 3], dtype=torch.int32))
    eng.launch()
    torch.cuda.synchronize()
    assert int(eng.bufs.error[0]) == ERR_POSITION, eng.bufs.error.tolist()
    # the cache holds what it held, but the valid sequence's own new slot (block good // BLOCK of its range)
    slot = (good // BLOCK, good % BLOCK)
    for name in ("k_cache", "v_cache"):
        after = getattr(eng, name)
        mask = torch.ones_like(after, dtype=torch.bool)
        mask[:, slot[0], slot[1]] = False
        assert torch.equal(after[mask], before[name][mask]), f"{name}: the failed step wrote outside sequence 0's slot"
    assert eng.error_flag() is None        # (the next launch copies the code to host memory)

    # launches before the host acknowledges the error run no instruction: nothing changes, nothing waits
    _assert_later_launches_change_nothing(eng, eng.launch, "a launch after the failed step")
    assert eng.error_flag() == ERR_POSITION, eng.host_error.tolist()
    assert int(eng.bufs.error[0]) == ERR_POSITION

    # check() raises the kernel's error, resets, and the next checked step is correct
    with pytest.raises(MegakernelError, match="past the KV cache"):
        eng.check()
    assert eng.error_flag() is None and int(eng.bufs.error[0]) == 0
    positions = torch.tensor([good, good + 1], dtype=torch.int32)
    _check_step(weights, eng, tokens, positions, f"tiny-llama: the step after the error at positions {positions.tolist()}")


def test_a_wait_that_times_out_aborts_the_step_and_the_engine_recovers_after_check():
    from megakernel.instructions.record import W_WAIT_COUNT
    from megakernel.kernel.interpreter import ERR_TIMEOUT, KernelOptions
    from megakernel.runtime.engine import MegakernelError

    weights, eng = _engine("tiny-llama", 1, seed=62, options=KernelOptions(timeout_ns=50_000_000))
    c = weights.config
    # an instruction in the middle of some CTA's queue waits for a count no producer reaches (one that waits on a
    # counter: at batch 1 the stages with a flagged input poll it instead)
    table = eng.queue_table
    waits = eng.counter_waits()
    sm, i = waits[len(waits) // 2]
    saved = table.clone()
    table[sm, i, W_WAIT_COUNT] = 1 << 20
    gen = torch.Generator().manual_seed(62)
    tokens = torch.randint(0, c.vocab_size, (1,), generator=gen).int()
    eng.bufs.poison()
    eng.bufs.tokens.copy_(tokens)
    eng.bufs.positions.fill_(5)
    eng.launch()
    torch.cuda.synchronize()
    assert int(eng.bufs.error[0]) == ERR_TIMEOUT, eng.bufs.error.tolist()
    _assert_later_launches_change_nothing(eng, eng.launch, "a launch after the timed-out step")
    assert eng.error_flag() == ERR_TIMEOUT
    table.copy_(saved)
    with pytest.raises(MegakernelError, match="timed out waiting on counter"):
        eng.check()
    _check_step(weights, eng, tokens, torch.tensor([5], dtype=torch.int32), "tiny-llama: the step after the timeout")


@pytest.mark.parametrize("stage,polled", [("DOWN", "act"), ("ATTN_PARTIAL", "qkv")])
def test_a_poll_of_a_flagged_input_that_times_out_aborts_the_step_and_the_engine_recovers_after_check(stage, polled):
    """At batch 1 DOWN polls act's {value, epoch} words and ATTN_PARTIAL its q, k and v in qkv's
    (instructions.flagged): run alone on words no step wrote (reset_sync zeroed their epochs), the poll times out;
    the error word names the instruction, counter -1, and the epoch."""
    from megakernel.instructions.flagged import FLAGGED_BUFFERS
    from megakernel.instructions.opcodes import Opcode
    from megakernel.instructions.record import NO_COUNTER, WORDS
    from megakernel.kernel.interpreter import ERR_TIMEOUT, KernelOptions
    from megakernel.runtime.engine import MegakernelError

    weights, eng = _engine("tiny-llama", 1, seed=65, options=KernelOptions(timeout_ns=50_000_000))
    c = weights.config
    assert len(eng.bufs.epochs()) == len(FLAGGED_BUFFERS) and polled in FLAGGED_BUFFERS
    ins = next(i for i in eng.program.instructions if i.opcode == Opcode[stage] and i.layer == 1)
    saved_table, saved_len = eng.queue_table.clone(), eng.queue_lengths.clone()
    eng.reset_sync()
    getattr(eng.bufs, polled).normal_()
    eng.bufs.positions.fill_(4)          # (ATTN_PARTIAL: a position in the sequence's own first block)
    eng.bufs.block_table.copy_(contiguous_block_table(1, MAX_SEQ, BLOCK, GPU))
    eng.queue_table.zero_()
    eng.queue_table[0, 0] = torch.tensor(dataclasses.replace(ins, wait_id=NO_COUNTER, wait_count=0,
                                                             signal_id=NO_COUNTER).encode(), dtype=torch.int32)
    assert eng.queue_table.shape[2] == WORDS
    eng.queue_lengths.zero_()
    eng.queue_lengths[0] = 1
    eng.launch()
    torch.cuda.synchronize()
    assert eng.bufs.error.tolist() == [ERR_TIMEOUT, ins.index, -1, 1], eng.bufs.error.tolist()
    _assert_later_launches_change_nothing(eng, eng.launch, "a launch after the timed-out poll")
    assert eng.error_flag() == ERR_TIMEOUT
    eng.queue_table.copy_(saved_table)
    eng.queue_lengths.copy_(saved_len)
    with pytest.raises(MegakernelError, match=f"#{ins.index} {stage} \\(layer 1\\) timed out polling"):
        eng.check()
    gen = torch.Generator().manual_seed(65)
    tokens = torch.randint(0, c.vocab_size, (1,), generator=gen).int()
    eng.bufs.poison()
    _check_step(weights, eng, tokens, torch.tensor([5], dtype=torch.int32), "tiny-llama: the step after the poll's")


def test_graph_replays_after_a_failed_step_write_nothing_and_the_host_flag_reports_it():
    from megakernel.kernel.interpreter import ERR_POSITION

    weights, eng = _engine("tiny-llama", 1, seed=63)
    gen = torch.Generator().manual_seed(63)
    eng.bufs.tokens.copy_(torch.randint(0, weights.config.vocab_size, (1,), generator=gen).int())
    eng.bufs.positions.fill_(3)
    eng.launch()                                   # warm-up, outside the capture
    torch.cuda.synchronize()
    eng.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng.launch()
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert int(eng.bufs.positions[0]) == 8 and eng.error_flag() is None, eng.bufs.positions.tolist()
    eng.check()
    eng.bufs.positions.fill_(MAX_SEQ + 1)          # a bad input reaches a replay
    graph.replay()
    torch.cuda.synchronize()
    _assert_later_launches_change_nothing(eng, graph.replay, "a replay after the failed one")
    assert eng.error_flag() == ERR_POSITION, eng.host_error.tolist()


@pytest.mark.parametrize("name", ("tiny-llama", "llama-3.2-1b"))
def test_steps_with_another_kernel_holding_an_sm_wait_for_it_and_give_the_same_tokens(name):
    """A kernel on a second stream occupies one SM for 4x the wait timeout before every step: a launch that
    started the CTAs it could would spin on the missing one and time out; the cooperative launch starts only
    when every CTA can be resident."""
    from megakernel.kernel.interpreter import KernelOptions

    config = dataclasses.replace(get_preset(name), num_layers=2)
    weights = random_weights(config, seed=64, dtype=torch.bfloat16, device=GPU, rng_device=GPU)
    from megakernel.runtime.engine import MegakernelEngine

    timeout_ns = 25_000_000
    eng = MegakernelEngine(weights, 1, MAX_SEQ, block_size=BLOCK, device=GPU, options=KernelOptions(timeout_ns=timeout_ns))
    sleep_cycles = int(4 * timeout_ns * 1e-9 * 1.98e9)     # at most the H200's 1.98 GHz: >= 4 timeouts
    tok0 = torch.tensor([int(torch.randint(0, config.vocab_size, (1,), generator=torch.Generator().manual_seed(64)))],
                        dtype=torch.int32)
    table = contiguous_block_table(1, eng.layout.max_seq_len, BLOCK, GPU)

    def run(background: bool) -> list[int]:
        other = torch.cuda.Stream()
        tok, out = tok0, []
        for t in range(6):
            if background:
                torch.cuda.synchronize()
                with torch.cuda.stream(other):
                    torch.cuda._sleep(sleep_cycles)
            tok = eng.step(tok, torch.tensor([t], dtype=torch.int32), table).clone()
            out.append(int(tok[0]))
        torch.cuda.synchronize()
        return out

    alone = run(False)
    beside = run(True)
    assert beside == alone, f"{name}: tokens {beside} with a kernel on a second stream, {alone} alone"


def _launch_unchecked(eng, tokens, positions, table) -> None:
    """Outputs poisoned, the step inputs copied in and one bare launch (no host check), finished."""
    eng.bufs.poison()
    eng.bufs.tokens.copy_(tokens)
    eng.bufs.positions.copy_(positions)
    eng.bufs.block_table.copy_(table)
    eng.launch()
    torch.cuda.synchronize()


def _block_table(batch: int, blocks_per_seq: int, positions: torch.Tensor, gen: torch.Generator, copy: bool):
    """A random permutation of the engine's blocks (no two positions share a slot); with `copy`, the entry of one
    sequence's new position replaced by an entry at or below some sequence's position (its own or another's):
    that aliases when the copied block holds a slot the step reads or appends to, as aliased_appends decides."""
    n = batch * blocks_per_seq
    table = torch.randperm(n, generator=gen).view(batch, blocks_per_seq).int()
    if copy:
        b, o = (int(v) for v in torch.randint(0, batch, (2,), generator=gen))
        jo = int(torch.randint(0, int(positions[o]) // BLOCK + 1, (1,), generator=gen))
        table[b, int(positions[b]) // BLOCK] = table[o, jo].clone()
    return table


@pytest.mark.parametrize("batch", (3, 4))
def test_the_kernel_enforces_the_aliasing_rule_on_the_unchecked_path(batch):
    """launch() (no host check: graph replays and vLLM take this path) on random block tables, half of them with
    a copied entry: the kernel fails the step with ERR_ALIAS exactly when aliased_appends names a sequence, writes
    none of those sequences' new K/V while the others' appends land, and a table that does not alias gives the
    float32 reference's logits on that same table."""
    from megakernel.instructions.layout import aliased_appends
    from megakernel.kernel.interpreter import ERR_ALIAS
    from megakernel.model.reference import ReferenceDecoder
    from megakernel.runtime.engine import MegakernelError

    weights, eng = _engine("tiny-llama", batch, seed=65 + batch)
    c, mb = weights.config, eng.layout.max_blocks_per_seq
    gen = torch.Generator().manual_seed(65 + batch)
    outcomes = []
    for case in range(12):
        tokens = torch.randint(0, c.vocab_size, (batch,), generator=gen).int()
        positions = torch.randint(0, MAX_SEQ, (batch,), generator=gen).int()
        table = _block_table(batch, mb, positions, gen, copy=case % 2 == 1)
        bad = aliased_appends(table, positions, BLOCK)
        outcomes.append(bool(bad))
        what = f"batch {batch} case {case}: positions {positions.tolist()}, table {table.tolist()}, aliased {sorted(bad)}"
        cache = PagedKVCache(k=eng.k_cache.clone(), v=eng.v_cache.clone(), block_size=BLOCK)
        before = _state(eng)
        _launch_unchecked(eng, tokens, positions, table)
        code = int(eng.bufs.error[0])
        if bad:
            assert code == ERR_ALIAS, f"{what}: error word {eng.bufs.error.tolist()}"
            for name in ("k_cache", "v_cache"):
                after, mask = getattr(eng, name), torch.ones_like(before[name], dtype=torch.bool)
                for b in set(range(batch)) - set(bad):       # the sequences whose appends may land
                    mask[:, int(table[b, int(positions[b]) // BLOCK]), int(positions[b]) % BLOCK] = False
                assert torch.equal(after[mask].nan_to_num(7.0), before[name][mask].nan_to_num(7.0)), \
                    f"{what}: {name} written outside the appends of the sequences that do not alias"
            with pytest.raises(MegakernelError, match="maps two positions to one slot"):
                eng.check()
        else:
            assert code == 0, f"{what}: error word {eng.bufs.error.tolist()} on a table that does not alias"
            ref = ReferenceDecoder(weights).step(tokens.to(GPU), positions.to(GPU), cache, table.long().to(GPU))
            assert_close(eng.logits, ref, torch.bfloat16, context=what)
    assert outcomes.count(True) >= 2 and outcomes.count(False) >= 2, f"batch {batch}: outcomes {outcomes}"


def test_padded_rows_that_append_to_the_scratch_block_pass_the_kernels_aliasing_rule():
    """vLLM's CUDA-graph padding: rows at position 0 with an all-zero table row all append to slot 0 of block 0.
    An engine whose scratch block is 0 runs the step (the real rows match the float32 reference); the same table
    on an engine without one fails with ERR_ALIAS and leaves the real rows' appends in place."""
    from megakernel.kernel.interpreter import ERR_ALIAS
    from megakernel.model.reference import ReferenceDecoder
    from megakernel.runtime.engine import MegakernelError

    gen = torch.Generator().manual_seed(67)
    for scratch in (0, -1):
        weights, eng = _engine("tiny-llama", 4, seed=67, scratch_block=scratch)
        c, mb = weights.config, eng.layout.max_blocks_per_seq
        table = torch.zeros(4, mb, dtype=torch.int32)
        table[:2] = 1 + torch.randperm(eng.num_blocks - 1, generator=gen)[:2 * mb].view(2, mb).int()
        positions = torch.tensor([int(torch.randint(1, MAX_SEQ, (1,), generator=gen)) for _ in range(2)] + [0, 0],
                                 dtype=torch.int32)
        tokens = torch.randint(0, c.vocab_size, (4,), generator=gen).int()
        cache = PagedKVCache(k=eng.k_cache.clone(), v=eng.v_cache.clone(), block_size=BLOCK)
        _launch_unchecked(eng, tokens, positions, table)
        what = f"scratch_block={scratch}: positions {positions.tolist()}"
        if scratch == 0:
            eng.check()
            ref = ReferenceDecoder(weights).step(tokens.to(GPU), positions.to(GPU), cache, table.long().to(GPU))
            assert_close(eng.logits[:2], ref[:2], torch.bfloat16, context=what)
        else:
            assert int(eng.bufs.error[0]) == ERR_ALIAS, f"{what}: {eng.bufs.error.tolist()}"
            for b in range(2):
                blk, off = int(table[b, int(positions[b]) // BLOCK]), int(positions[b]) % BLOCK
                assert not torch.equal(eng.k_cache[:, blk, off], cache.k[:, blk, off]), f"{what}: row {b}'s k not written"
            with pytest.raises(MegakernelError, match="maps two positions to one slot"):
                eng.check()
