"""The tensor-parallel step without the LM head (build_tp_program(lm_head=False), what vLLM's ranks run: vLLM
computes the logits from the final hidden state itself): the full program's prefix up to x[L], deadlock-free and
race-free across ranks and steps, and on the multi-rank VM the same x[L] as the full step, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from megakernel.instructions.context import matvec, rms_normalize
from megakernel.instructions.opcodes import Opcode
from megakernel.instructions.record import deserialize
from megakernel.instructions.layout import StepLayout
from megakernel.instructions.tensor_parallel import reduce
from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.weights import random_weights
from megakernel.schedule.tensor_parallel import (TPVMDecoder, build_tp_program, find_tp_races, happens_before,
                                                 rank_tables, simulate_ranks)
from megakernel.testing.tolerances import assert_close

KV4 = dataclasses.replace(get_preset("tiny-llama"), num_heads=8, num_kv_heads=4, name="tiny-llama-kv4")
CONFIGS = {"tiny-llama": get_preset("tiny-llama"), "tiny-qwen3": get_preset("tiny-qwen3"), "tiny-llama-kv4": KV4}
SPLITS = [("tiny-llama", 2), ("tiny-qwen3", 2), ("tiny-llama-kv4", 4)]
FEW_SMS = 5

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _layout(name: str, batch: int, num_sms: int, fuse=None, fold=False) -> StepLayout:
    return StepLayout(config=CONFIGS[name], batch=batch, kv_splits=2, block_size=16, max_blocks_per_seq=4,
                      num_sms=num_sms, fuse_attn_reduce=fuse, fold_embed=fold)


def _cases():
    for name, world in SPLITS:
        for batch in (1, 3):
            for num_sms in (132, FEW_SMS):
                for fuse, fold in ((None, False), (False, False), (None, True)):
                    yield name, world, _layout(name, batch, num_sms, fuse, fold)


@pytest.mark.parametrize("name,world", SPLITS)
def test_the_program_without_the_lm_head_is_the_full_programs_prefix(name, world):
    """Same instructions (indices, waits, signals, counters) up to the last layer's FFN TP_REDUCE, which writes x[L]
    and is the last stage; no TP_LM_HEAD, no ARGMAX, lm_tiles 0; the same queues on every policy, minus those."""
    for case, w, layout in _cases():
        if (case, w) != (name, world):
            continue
        full, bare = build_tp_program(layout, world), build_tp_program(layout, world, lm_head=False)
        what = f"{name} W={world} batch={layout.batch} sms={layout.num_sms} fuse={layout.fuse_attn_reduce} " \
               f"fold={layout.fold_embed}"
        n = len(bare.instructions)
        assert bare.instructions == full.instructions[:n], what
        assert Counter(i.opcode for i in full.instructions[n:]) == Counter(
            {Opcode.TP_LM_HEAD: full.lm_tiles, Opcode.ARGMAX: 1}), what
        assert (bare.lm_tiles, bare.has_lm_head, bare.num_counters) == (0, False, full.num_counters), what
        last = [i for i in bare.instructions if i.opcode == Opcode.TP_REDUCE and i.a3 == reduce.FFN
                and i.layer == layout.config.num_layers - 1]
        assert last and bare.instructions[-len(last):] == tuple(last), f"{what}: x[L]'s reduce is not last"
        for policy in ("balanced", "round-robin"):
            queues = [deserialize(t, k) for t, k in rank_tables(bare, policy)]
            done = simulate_ranks(queues, bare.num_counters, layout.config.num_layers)
            assert Counter(r for r, _, _ in done) == Counter({r: n for r in range(world)}), f"{what} {policy}"


@pytest.mark.parametrize("name,world", SPLITS)
def test_the_program_without_the_lm_head_is_race_free_across_ranks_and_steps(name, world):
    for case, w, layout in _cases():
        if (case, w) == (name, world) and layout.num_sms == FEW_SMS:
            program = build_tp_program(layout, world, lm_head=False)
            assert find_tp_races(program) == [], f"{name} W={world} batch={layout.batch} fold={layout.fold_embed}"


def test_a_broken_last_reduce_races_across_ranks_without_the_lm_head():
    """The race check still sees the last exchange: x[L]'s reduce counting only its own rank's TP_DOWN tiles reads
    the peers' receive slots unordered with their stores."""
    program = build_tp_program(_layout("tiny-llama-kv4", 2, FEW_SMS), 2, lm_head=False)
    ins = program.instructions[-1]
    broken = list(program.instructions)
    broken[-1] = dataclasses.replace(ins, wait_count=ins.wait_count // 2)
    races = find_tp_races(dataclasses.replace(program, instructions=tuple(broken)), limit=40)
    assert any(f"#{ins.index} TP_REDUCE" in r and "recv_down@rank" in r for r in races), races


def test_without_the_lm_head_the_next_step_follows_the_last_exchange():
    """The module docstring's argument, node by node (step, rank, instruction), W=2: a rank's next step starts
    after every peer's last-layer TP_DOWN tiles (through its own last reduce) and after every peer reduce of the
    earlier layers, but not after the peer's last reduces, which read the slots that only the next step's
    last-layer TP_DOWN stores into again: and those stores follow the peer's last reduces."""
    program = build_tp_program(_layout("tiny-llama", 2, FEW_SMS), 2, lm_head=False)
    L = program.layout.config.num_layers
    bits, n = happens_before(program, steps=2), len(program.instructions)

    def node(step, rank, ins):
        return (step * 2 + rank) * n + ins.index

    def before(a, b) -> bool:
        return bool((bits[b] >> a) & 1)

    def of(op, layer, part=None):
        return [i for i in program.instructions
                if i.opcode == op and i.layer == layer and (part is None or i.a3 == part)]

    first = program.instructions[0]
    assert all(before(node(0, 1, d), node(1, 0, first)) for d in of(Opcode.TP_DOWN, L - 1))
    assert all(before(node(0, 1, r), node(1, 0, first)) for r in of(Opcode.TP_REDUCE, 0, reduce.ATTENTION))
    last = of(Opcode.TP_REDUCE, L - 1, reduce.FFN)
    assert not any(before(node(0, 1, r), node(1, 0, first)) for r in last), "the ranks' steps are joined"
    assert all(before(node(0, 1, r), node(1, 0, d)) for r in last for d in of(Opcode.TP_DOWN, L - 1))


@pytest.mark.parametrize("name,world,order,fold", [("tiny-llama", 2, "reverse", False),
                                                   ("tiny-qwen3", 2, "greedy", True),
                                                   ("tiny-llama-kv4", 4, "round-robin", False)])
def test_the_vm_without_the_lm_head_leaves_the_full_steps_x_L(name, world, order, fold):
    """Teacher-forced steps at different positions: every rank's x[L] is the full TP step's, bit for bit; vLLM's
    final norm and LM head on it give the float32 reference's logits; tokens and positions stay as the caller
    wrote them (no ARGMAX); the KV caches are the full step's."""
    config = CONFIGS[name]
    seed = 90 + world
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    batch, steps = 3, 6
    kw = dict(num_sms=7, kv_splits=2, fold_embed=fold)
    full = TPVMDecoder(weights, world, batch, steps, **kw)
    bare = TPVMDecoder(weights, world, batch, steps, lm_head=False, **kw)
    assert bare.program.lm_tiles == 0 and all(c.bufs.logits.numel() == 0 for c in bare.contexts)
    table = contiguous_block_table(batch, steps, 16)
    ref, cache = ReferenceDecoder(weights), PagedKVCache.allocate(config, full.num_blocks, 16, dtype=torch.float32)
    offsets = torch.tensor([0, 1, 3])
    for t in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen)
        positions = (t - offsets).clamp(min=0)
        what = f"{name} W={world} seed={seed} {order} step {t} positions {positions.tolist()}"
        want = full.step_hidden(tokens, positions, table, order=order)
        got = bare.step_hidden(tokens, positions, table, order=order)
        assert not torch.isnan(got).any() and torch.equal(got, want), what
        for ctx in bare.contexts:
            assert torch.equal(ctx.bufs.x[-1], got), f"{what}: rank {ctx.layout.rank}'s x[L]"
            assert torch.equal(ctx.bufs.tokens.long(), tokens) and torch.equal(ctx.bufs.positions.long(), positions)
        logits = matvec(weights.lm_head, rms_normalize(got, weights.final_norm, config.rms_norm_eps))
        assert_close(logits, ref.step(tokens, positions, cache, table), torch.float32, context=what)
    for r in range(world):
        for mine, theirs in ((bare.k_caches[r], full.k_caches[r]), (bare.v_caches[r], full.v_caches[r])):
            written = ~torch.isnan(theirs)
            assert written.any() and torch.equal(mine[written], theirs[written]), f"{name} rank {r} cache"
    with pytest.raises(RuntimeError, match="lm_head=False"):
        bare.step(tokens, positions, table)
