"""Matvec stages split over K past the megakernel's batch (megakernel/instructions/split_k.py): the rule that picks
the number of K ranges, the program it gives (race- and deadlock-free, every range's tiles closed by MV_REDUCE, QKV's
by the attention), and the verifier catching a reduce or an attention that starts before all of its ranges. The VM
against the reference decoder on split programs is in test_vm.py."""

from __future__ import annotations

import dataclasses

import pytest

from megakernel.instructions.layout import MAX_BATCH, SPLIT_BATCH, StepLayout, default_kv_splits
from megakernel.instructions.matvec_stages import MATVEC_OPCODES, weight_rows
from megakernel.instructions.opcodes import Opcode
from megakernel.instructions.split_k import REDUCED_STAGES, SPLIT_COLUMNS, SPLIT_STAGES, k_splits
from megakernel.model.presets import get_preset
from megakernel.schedule import assign, build_program, find_races, simulate
from megakernel.schedule.dag import StepProgram

REAL_PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b", "llama-2-7b")
WIDE = dict(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=2, head_dim=128)


def _layout(config, batch: int, num_sms: int = 132, **kw) -> StepLayout:
    return StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, num_sms, 64),
                      block_size=16, max_blocks_per_seq=4, num_sms=num_sms, **kw)


@pytest.mark.parametrize("name", REAL_PRESETS)
@pytest.mark.parametrize("batch", (1, 4, SPLIT_BATCH, 16, 32, MAX_BATCH))
def test_k_splits_divide_k_and_leave_the_megakernel_batches_gate_up_and_the_lm_head_whole(name, batch):
    layout = _layout(get_preset(name), batch)
    for op in MATVEC_OPCODES:
        e = k_splits(layout, op)
        _, k = weight_rows(op, layout)
        assert e >= 1 and (k // SPLIT_COLUMNS) % e == 0, f"{name} batch {batch} {op.name}: E={e} for K={k}"
        if batch <= SPLIT_BATCH or op in (Opcode.LM_HEAD, Opcode.GATE_UP):
            assert e == 1, f"{name} batch {batch} {op.name}: split into {e} where the megakernel runs it whole"


@pytest.mark.parametrize("batch", (16, 32, MAX_BATCH))
def test_short_wide_matrices_split_at_large_batches(batch):
    """The stages whose whole-K tiles have few rows per SM (QKV, O_PROJ, DOWN of llama-3.2-1b: 24, 16 and 16 rows)
    split at batch 16-64: their staged input would otherwise outweigh their weights (docs/batch_path.md)."""
    layout = _layout(get_preset("llama-3.2-1b"), batch)
    for op in (Opcode.QKV, Opcode.O_PROJ, Opcode.DOWN):
        assert k_splits(layout, op) > 1, f"llama-3.2-1b batch {batch} {op.name} is not split"


def _wide_program(batch: int, num_sms: int = 132, **kw) -> StepProgram:
    config = dataclasses.replace(get_preset("tiny-qwen3"), **WIDE)
    return build_program(_layout(config, batch, num_sms), **kw)


@pytest.mark.parametrize("batch", (16, MAX_BATCH))
@pytest.mark.parametrize("lm_head", (True, False))
def test_split_programs_are_race_and_deadlock_free(batch, lm_head):
    """Every layer matvec split over K; MV_REDUCE closes all but QKV, whose partials the attention sums."""
    program = _wide_program(batch, lm_head=lm_head)
    split = {i.opcode for i in program.instructions if i.k_parts > 1}
    reduced = {Opcode(i.a2) for i in program.instructions if i.opcode == Opcode.MV_REDUCE}
    assert split == set(SPLIT_STAGES), f"batch {batch}: split stages {sorted(o.name for o in split)}"
    assert reduced == set(REDUCED_STAGES), f"batch {batch}: reduces of {sorted(o.name for o in reduced)}"
    assert find_races(program) == [], f"batch {batch}"
    for policy in ("balanced", "round-robin"):
        queues = assign(program, policy)
        done = simulate(queues, program.num_counters)
        assert len(done) == len(program.instructions), f"batch {batch} {policy}: deadlock"


@pytest.mark.parametrize("batch", (16, MAX_BATCH))
def test_attention_waits_for_every_qkv_k_range_tile(batch):
    """Every ATTN_PARTIAL waits for all of its layer's QKV K-range tiles (the race check knows it reads their
    partials and x[l]), and a wait one tile short is a race."""
    program = _wide_program(batch)
    attn = next(i for i in program.instructions if i.opcode == Opcode.ATTN_PARTIAL and i.layer == 1)
    tiles = [i for i in program.instructions if i.opcode == Opcode.QKV and i.layer == 1]
    assert attn.wait_id == tiles[0].signal_id and attn.wait_count == len(tiles), attn
    short = dataclasses.replace(attn, wait_count=attn.wait_count - 1)
    broken = dataclasses.replace(program, instructions=tuple(
        short if i.index == attn.index else i for i in program.instructions))
    assert any(f"#{attn.index} ATTN_PARTIAL" in r for r in find_races(broken))


def test_every_k_range_is_closed_by_the_reduce_of_its_rows():
    """Per layer and split stage: every K range tiles all rows once, and (but for QKV) the MV_REDUCE tiles cover
    all rows once and wait for every range's tiles."""
    program = _wide_program(16)
    for layer in range(program.layout.config.num_layers):
        for op in SPLIT_STAGES:
            rows, _ = weight_rows(op, program.layout)
            parts = [i for i in program.instructions if i.opcode == op and i.layer == layer]
            e = k_splits(program.layout, op)
            assert {(i.k_part, i.k_parts) for i in parts} == {(part, e) for part in range(e)}, f"{op.name}: {e}"
            for part in range(e):
                mine = sorted((i.a0, i.a0 + i.a1) for i in parts if i.k_part == part)
                assert mine[0][0] == 0 and mine[-1][1] == rows and all(
                    a[1] == b[0] for a, b in zip(mine, mine[1:])), f"layer {layer} {op.name} range {part}: {mine}"
            if op == Opcode.QKV:
                continue                  # (summed by the attention: test_attention_waits_for_every_qkv_k_range_tile)
            reduces = [i for i in program.instructions
                       if i.opcode == Opcode.MV_REDUCE and i.layer == layer and i.a2 == int(op)]
            assert {i.a3 for i in reduces} == {e}, f"layer {layer} {op.name}: reduces of {e} ranges"
            covered = sorted((i.a0, i.a0 + i.a1) for i in reduces)
            assert covered[0][0] == 0 and covered[-1][1] == rows, f"layer {layer} {op.name} reduces: {covered}"
            assert all(i.wait_count == len(parts) and i.wait_id == parts[0].signal_id for i in reduces), \
                f"layer {layer} {op.name}: a reduce does not wait for all {len(parts)} range tiles"


def test_find_races_catches_a_reduce_that_waits_for_one_range_tile_too_few():
    program = _wide_program(16)
    reduce = next(i for i in program.instructions if i.opcode == Opcode.MV_REDUCE)
    short = dataclasses.replace(reduce, wait_count=reduce.wait_count - 1)
    broken = dataclasses.replace(program, instructions=tuple(
        short if i.index == reduce.index else i for i in program.instructions))
    races = find_races(broken)
    assert any(f"#{reduce.index} MV_REDUCE" in r for r in races), races
