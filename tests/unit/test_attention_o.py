"""The attention and O_PROJ as one stage (StepLayout.fuse_attn_o, megakernel/instructions/attention_o.py), on the
CPU: the program's shape, its races and deadlocks, what the layout refuses, and the kernel's refusal until its
device code exists. The VM against the float32 reference decoder with the fused stage: tests/unit/test_vm.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from megakernel.instructions.layout import SPLIT_BATCH, StepLayout
from megakernel.instructions.opcodes import Opcode, Stage, counter_id
from megakernel.model.presets import get_preset
from megakernel.schedule import POLICIES, assign, build_program, find_races, simulate

REAL = ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b")


def _layout(name: str, batch: int = 1, num_sms: int = 132, num_layers: int = 2, **kw) -> StepLayout:
    config = dataclasses.replace(get_preset(name), num_layers=num_layers)
    return StepLayout(config=config, batch=batch, kv_splits=kw.pop("kv_splits", 1), block_size=16,
                      max_blocks_per_seq=4, num_sms=num_sms, fuse_attn_o=kw.pop("fuse_attn_o", True), **kw)


@pytest.mark.parametrize("name,batch,num_sms", [(n, 1, 132) for n in REAL] + [("qwen3-0.6b", 2, 132),
                                                                             ("tiny-qwen3", 3, 7)])
def test_each_kv_head_covers_every_row_of_o_once_and_gate_up_waits_for_all(name, batch, num_sms):
    layout = _layout(name, batch, num_sms)
    c = layout.config
    program = build_program(layout)
    what = f"{name} batch {batch} sms {num_sms}"
    ops = Counter(i.opcode for i in program.instructions)
    assert ops[Opcode.ATTN_PARTIAL] == ops[Opcode.ATTN_REDUCE] == ops[Opcode.O_PROJ] == 0, f"{what}: {ops}"
    for layer in range(c.num_layers):
        tiles = [i for i in program.instructions if i.opcode == Opcode.ATTN_O and i.layer == layer]
        for h in range(c.num_kv_heads):
            mine = sorted((i.a0, i.a1) for i in tiles if i.k_part == h)
            covered = [r for lo, n in mine for r in range(lo, lo + n)]
            assert covered == list(range(c.hidden_size)), f"{what} layer {layer} head {h}: rows {mine}"
            assert sum(1 for i in tiles if i.k_part == h and i.a0 == 0) == 1, f"{what}: one appending tile a head"
        assert all(i.k_parts == c.num_kv_heads and i.seqs == batch and i.a1 % 8 == 0 for i in tiles), what
        assert sorted(i.a2 for i in tiles) == list(range(len(tiles))), f"{what}: tile indices"
        qkv = [i for i in program.instructions if i.opcode == Opcode.QKV and i.layer == layer]
        assert {(i.wait_id, i.wait_count) for i in tiles} == {(counter_id(layer, Stage.QKV), len(qkv))}, what
        assert {i.signal_id for i in tiles} == {counter_id(layer, Stage.O_PROJ)}, what
        gate_up = [i for i in program.instructions if i.opcode == Opcode.GATE_UP and i.layer == layer]
        assert {(i.wait_id, i.wait_count) for i in gate_up} == {(counter_id(layer, Stage.O_PROJ), len(tiles))}, what
        # about one tile per SM: kv heads x slices of O's rows
        assert num_sms // 2 < len(tiles) <= max(num_sms, c.num_kv_heads), f"{what}: {len(tiles)} tiles"


@pytest.mark.parametrize("name,batch,num_sms", [("qwen3-0.6b", 1, 132), ("llama-3.2-1b", 2, 132),
                                                ("tiny-qwen3", 3, 7), ("tiny-qwen3", 1, 1)])
def test_the_fused_program_is_race_and_deadlock_free(name, batch, num_sms):
    program = build_program(_layout(name, batch, num_sms))
    assert find_races(program) == []
    for policy in POLICIES:
        queues = assign(program, policy)
        done = simulate(queues, program.num_counters)
        assert sorted(i.index for i in done) == list(range(len(program.instructions))), policy


@pytest.mark.parametrize("change", ["gate-up-one-short", "attn-o-waits-on-nothing"])
def test_find_races_catches_a_fused_program_with_a_missing_edge(change):
    """GATE_UP reads every kv head's partials of O (and x[l]); an ATTN_O reads its head's q, k and v. A wait one
    signal short, or none, leaves a writer unordered: the race check must say so."""
    program = build_program(_layout("tiny-qwen3", 2, 7))
    op = Opcode.GATE_UP if change == "gate-up-one-short" else Opcode.ATTN_O
    ins = next(i for i in program.instructions if i.opcode == op and i.layer == 1)
    broken = (dataclasses.replace(ins, wait_count=ins.wait_count - 1) if op == Opcode.GATE_UP
              else dataclasses.replace(ins, wait_id=-1, wait_count=0))
    instructions = list(program.instructions)
    instructions[broken.index] = broken
    races = find_races(dataclasses.replace(program, instructions=tuple(instructions)))
    assert races, f"{change}: no race found"


def test_no_stage_reads_or_writes_h_and_down_reads_every_heads_partials_of_its_rows():
    """h[l] is never stored in the fused program: GATE_UP and DOWN read x[l] and the partials instead (what the
    race check orders them by)."""
    from megakernel.instructions import STAGE_MODULES
    layout = _layout("tiny-qwen3", 2, 7)
    c = layout.config
    program = build_program(layout)
    for ins in program.instructions:
        mod = STAGE_MODULES[ins.opcode]
        regions = mod.reads(ins, layout) + mod.writes(ins, layout)
        assert not [r for r in regions if r[0] == "h"], f"#{ins.index} {ins.opcode.name} touches h"
        if ins.opcode == Opcode.DOWN:
            reads = set(mod.reads(ins, layout))
            for h in range(c.num_kv_heads):
                for b in range(layout.batch):
                    base = (h * layout.batch + b) * c.hidden_size
                    assert ("part_o", ins.layer, base + ins.a0, base + ins.a0 + ins.a1) in reads, (ins, h, b)
            assert ("x", ins.layer, ins.a0, ins.a0 + ins.a1) in reads, ins


@pytest.mark.parametrize("kw,message", [
    (dict(batch=SPLIT_BATCH + 1), "batches up to"),
    (dict(kv_splits=2), "kv_splits=1"),
])
def test_the_layout_refuses_what_the_fused_stage_cannot_take(kw, message):
    with pytest.raises(ValueError, match=message):
        _layout("qwen3-0.6b", **kw).validate()


def test_the_layout_refuses_a_kv_head_whose_query_columns_are_not_a_k_range():
    # tiny-llama: 2 query heads of 64 per kv head, 128 columns, half the kernel's 256-column unit
    with pytest.raises(ValueError, match="multiple of 256"):
        _layout("tiny-llama").validate()


def test_the_megakernel_refuses_the_fused_layout_until_its_device_code_exists():
    from megakernel.kernel.interpreter import DecodeKernel
    layout = _layout("qwen3-0.6b")
    program = build_program(layout)
    with pytest.raises(ValueError, match="instruction VM only"):
        DecodeKernel(layout, program.lm_tiles, program.num_counters, 64)
