"""The decode-step DAG, SM assignment, deadlock simulation, race detection and serialization (CPU only).

Every preset, both policies, batch 1..8. The tiny presets get every check, find_races included; the real
presets get the program and queue checks at their full depth (no weights are built) and find_races on a
2-layer copy of their shape, because find_races builds the transitive closure of the whole DAG (quadratic
in instructions: ~25k for llama-3.1-8b at batch 8) while every cross-layer edge already occurs between
layers 0 and 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megakernel.instructions import STAGE_MODULES
from megakernel.instructions.attention import split_range, warp_attention
from megakernel.instructions.embed import embed_ranges
from megakernel.instructions.layout import (MAX_BATCH, MMA_TILES, NARROW_WARPS, ROW_GROUP, SPLIT_BATCH, StepLayout,
                                            default_kv_splits)
from megakernel.instructions.matvec_stages import MATVEC_OPCODES
from megakernel.instructions.opcodes import Opcode
from megakernel.instructions.record import NO_COUNTER, WORDS, Instruction, deserialize, serialize
from megakernel.model.config import ModelConfig
from megakernel.model.presets import PRESETS, get_preset
from megakernel.schedule import assign, build_program, find_races, simulate
from megakernel.schedule.dag import StepProgram, producers

TINY_PRESETS = ("tiny-llama", "tiny-qwen3")
REAL_PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b", "llama-2-7b")
BATCHES = tuple(range(1, 9))
POLICIES = ("balanced", "round-robin")
NUM_SMS = 132          # the H200
FEW_SMS = 5            # deep queues: many instructions of one stage share an SM
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8


@functools.lru_cache(maxsize=None)
def _program(name: str, batch: int, num_sms: int = NUM_SMS, num_layers: int | None = None,
             fuse: bool | None = None, lm_head: bool = True, fold: bool = False) -> StepProgram:
    config = get_preset(name)
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, num_sms),
                        block_size=BLOCK_SIZE, max_blocks_per_seq=BLOCKS_PER_SEQ, num_sms=num_sms,
                        fuse_attn_reduce=fuse, fold_embed=fold)
    return build_program(layout, lm_head=lm_head)


def _what(program: StepProgram, policy: str | None = None) -> str:
    lay = program.layout
    pol = f" policy={policy}" if policy else ""
    return (f"{lay.config.name} L={lay.config.num_layers} batch={lay.batch} splits={lay.kv_splits} "
            f"sms={lay.num_sms} fused_reduce={lay.fused_reduce} embed_folded={lay.embed_folded} "
            f"lm_head={program.has_lm_head}{pol} "
            f"({len(program.instructions)} instructions)")


# ---- the dataflow, written out independently of the DAG builder -----------------------------------------

def _stage_rows(config: ModelConfig, op: Opcode) -> int:
    """Rows of the packed weight a matvec stage streams (from the model shape alone)."""
    return {
        Opcode.QKV: (config.num_heads + 2 * config.num_kv_heads) * config.head_dim,
        Opcode.O_PROJ: config.hidden_size,
        Opcode.GATE_UP: 2 * config.intermediate_size,
        Opcode.DOWN: config.hidden_size,
        Opcode.LM_HEAD: config.vocab_size,
    }[op]


def _key(ins: Instruction) -> tuple:
    """The stage an instruction belongs to: (opcode, layer), and for a stage split over K (split_k.py) its K
    ranges' tiles (opcode, layer, "parts") apart from the MV_REDUCE tiles that close it (opcode, layer, "reduce")."""
    if ins.opcode == Opcode.MV_REDUCE:
        return Opcode(ins.a2), ins.layer, "reduce"
    if ins.k_parts > 1:
        return ins.opcode, ins.layer, "parts"
    return ins.opcode, ins.layer


def _closing(stage: tuple, keys: set) -> tuple:
    """The instructions whose signals say a stage (opcode, layer) is done: its MV_REDUCE tiles where it is split, its
    K ranges' tiles where it is split with no MV_REDUCE (QKV, whose partials the attention sums); `keys` the
    program's stage keys (_key)."""
    for closing in ((*stage, "reduce"), (*stage, "parts")):
        if closing in keys:
            return closing
    return stage


def _producer_stages(ins: Instruction, num_layers: int, fused: bool, folded: bool = False) -> set | None:
    """{(opcode, layer)} of the stages whose outputs `ins` consumes first: what it must wait for. With the
    attention merge folded into O_PROJ (fused), O_PROJ consumes the partials. With the embedding folded
    into layer 0's QKV (folded), those tiles read the embedding table and wait on nothing, and layer 0's
    attention waits on them and on EMBED (x[0], layer 0's residual, read by O_PROJ after it)."""
    if folded and ins.layer == 0 and ins.opcode == Opcode.QKV:
        return None
    if folded and ins.layer == 0 and ins.opcode == Opcode.ATTN_PARTIAL:
        return {(Opcode.QKV, 0), (Opcode.EMBED, 0)}
    one = _producer_stage(ins, num_layers, fused)
    return None if one is None else {one}


def _producer_stage(ins: Instruction, num_layers: int, fused: bool) -> tuple[Opcode, int] | None:
    """(opcode, layer) of the stage whose outputs `ins` consumes first: what it must wait for. With the
    attention merge folded into O_PROJ (fused), O_PROJ consumes the partials."""
    op, layer = ins.opcode, ins.layer
    if op == Opcode.MV_REDUCE:
        return Opcode(ins.a2), layer
    if op == Opcode.EMBED:
        return None
    if op == Opcode.QKV:
        return (Opcode.EMBED, 0) if layer == 0 else (Opcode.DOWN, layer - 1)
    if op == Opcode.LM_HEAD:
        return Opcode.DOWN, num_layers - 1
    if op == Opcode.ARGMAX:
        return Opcode.LM_HEAD, 0
    previous = {Opcode.ATTN_PARTIAL: Opcode.QKV, Opcode.ATTN_REDUCE: Opcode.ATTN_PARTIAL,
                Opcode.O_PROJ: Opcode.ATTN_PARTIAL if fused else Opcode.ATTN_REDUCE,
                Opcode.GATE_UP: Opcode.O_PROJ, Opcode.DOWN: Opcode.GATE_UP}
    return previous[op], layer


def check_program(program: StepProgram) -> None:
    """Topological order (hence acyclic), one producing stage per counter, wait targets equal to the size of
    that stage, and tiles that cover every output exactly once."""
    what = _what(program)
    instrs = program.instructions
    config, layout = program.layout.config, program.layout
    assert [i.index for i in instrs] == list(range(len(instrs))), f"{what}: index is not the position"

    signallers: dict[int, list[Instruction]] = defaultdict(list)
    stage_size: Counter = Counter()
    for ins in instrs:
        assert 0 <= ins.signal_id < program.num_counters, f"{what}: #{ins.index} {ins.opcode.name} signals nothing"
        signallers[ins.signal_id].append(ins)
        stage_size[_key(ins)] += 1
    keys = set(stage_size)
    folded = layout.embed_folded
    for counter, group in signallers.items():
        stages = {_key(i) for i in group}
        allowed = {frozenset({_closing((Opcode.QKV, 0), keys), (Opcode.EMBED, 0)})} if folded else set()
        assert len(stages) == 1 or frozenset(stages) in allowed, \
            f"{what}: counter {counter} is signalled by several stages {stages}"

    for ins in instrs:
        producers = _producer_stages(ins, config.num_layers, layout.fused_reduce, folded)
        name = f"{what}: #{ins.index} {ins.opcode.name} layer {ins.layer}"
        if producers is None:
            assert ins.wait_id == NO_COUNTER, f"{name} waits on counter {ins.wait_id}"
            continue
        if ins.opcode == Opcode.MV_REDUCE:
            producers = {(*p, "parts") for p in producers}        # a reduce waits for its own stage's ranges
        else:
            producers = {_closing(p, keys) for p in producers}
        assert 0 <= ins.wait_id < program.num_counters, f"{name} waits on no counter"
        group = signallers[ins.wait_id]
        assert {_key(i) for i in group} == producers, \
            f"{name} waits on {sorted({_key(i) for i in group})}, its producers are {producers}"
        assert ins.wait_count == len(group) == sum(stage_size[p] for p in producers), \
            f"{name} waits for {ins.wait_count}, the stages {producers} have {len(group)} instructions"
        late = [i.index for i in group if i.index >= ins.index]
        assert not late, f"{name} precedes its producers {late[:4]} in the global order"

    # Tiles: each matvec stage partitions its rows into ROW_GROUP-multiples, in order, tile index = position; a
    # stage split over K does so once per K range (every range of the same count), and its MV_REDUCE tiles once.
    by_stage: dict[tuple, list[Instruction]] = defaultdict(list)
    for ins in instrs:
        by_stage[_key(ins)].append(ins)
    for key, group in by_stage.items():
        op, layer = key[:2]
        if op not in MATVEC_OPCODES:
            continue
        quantum = 2 * ROW_GROUP if op == Opcode.GATE_UP else ROW_GROUP
        ranges = defaultdict(list)
        for ins in group:
            ranges[ins.k_part].append(ins)
        e = group[0].a3 if key[2:] == ("reduce",) else group[0].k_parts
        if key[2:] == ("parts",):
            assert sorted(ranges) == list(range(e)) and all(i.k_parts == e for i in group), \
                f"{what}: {op.name} layer {layer} K ranges {sorted(ranges)} of {e}"
        for part, tiles in ranges.items():
            row = 0
            for t, ins in enumerate(sorted(tiles, key=lambda i: i.a0)):
                assert ins.a0 == row and ins.a1 > 0 and ins.a1 % quantum == 0, \
                    f"{what}: {key} tile {t} covers rows [{ins.a0}, {ins.a0 + ins.a1}) after {row}"
                assert ins.opcode == Opcode.MV_REDUCE or ins.a2 == t, f"{what}: {key} tile {t} has index {ins.a2}"
                row += ins.a1
            assert row == _stage_rows(config, op), f"{what}: {key} range {part} tiles cover {row} rows"
        if key[2:] == ("parts",):
            assert len({len(t) for t in ranges.values()}) == 1, f"{what}: {key} ranges of different tilings"
    lm_tiles = len(by_stage[(Opcode.LM_HEAD, 0)])
    assert program.lm_tiles == lm_tiles, f"{what}: lm_tiles={program.lm_tiles}, {lm_tiles} LM_HEAD instructions"
    if program.has_lm_head:
        assert stage_size[(Opcode.ARGMAX, 0)] == 1 and by_stage[(Opcode.ARGMAX, 0)][0].a0 == lm_tiles, what
    else:
        # the step ends with the last layer's DOWN (it writes x[L]); nothing after it, no ARGMAX
        assert stage_size[(Opcode.ARGMAX, 0)] == 0, f"{what}: ARGMAX without an LM head"
        last = instrs[-1]
        assert (last.opcode, last.layer) == (Opcode.DOWN, config.num_layers - 1), \
            f"{what}: the program ends with {last.opcode.name} layer {last.layer}"
    b, s, kvh = layout.batch, layout.kv_splits, config.num_kv_heads
    for layer in range(config.num_layers):
        partial = Counter((q, i.a1, i.a2, i.a3) for i in by_stage[(Opcode.ATTN_PARTIAL, layer)]
                          for q in range(i.a0, i.a0 + i.seqs))
        assert partial == Counter((q, h, t, s) for q in range(b) for h in range(kvh) for t in range(s)), \
            f"{what}: layer {layer} attention partials do not cover (sequence, kv head, split) once each"
        seqs = {i.seqs for i in by_stage[(Opcode.ATTN_PARTIAL, layer)]}
        if warp_attention(layout):
            # several sequences an instruction (a warp each), as few as spread the layer's pairs over the SMs
            assert max(seqs) == min(ROW_GROUP, -(-b * kvh // layout.num_sms)), f"{what}: {seqs} sequences"
        else:
            assert seqs == {1}, f"{what}: ATTN_PARTIAL of {seqs} sequences"
        reduce = Counter((i.a0, i.a1, i.a3) for i in by_stage[(Opcode.ATTN_REDUCE, layer)])
        o_proj_a3 = {i.a3 for i in by_stage[(Opcode.O_PROJ, layer)] + by_stage[(Opcode.O_PROJ, layer, "parts")]}
        if layout.fused_reduce:
            assert not reduce and o_proj_a3 == {s}, \
                f"{what}: layer {layer} folds the merge into O_PROJ, yet has {sum(reduce.values())} ATTN_REDUCE " \
                f"and O_PROJ a3 {o_proj_a3} (splits {s})"
        else:
            assert reduce == Counter((q, h, s) for q in range(b) for h in range(kvh)), \
                f"{what}: layer {layer} attention reductions do not cover (sequence, kv head) once each"
            assert o_proj_a3 == {0}, f"{what}: layer {layer} O_PROJ a3 {o_proj_a3} without the folded merge"
    embeds = sorted((i.a0, i.a1) for i in by_stage[(Opcode.EMBED, 0)])
    assert embeds == embed_ranges(layout.batch), f"{what}: EMBED covers sequences {embeds}"
    assert sum(n for _, n in embeds) == layout.batch and (len(embeds) == 1 or layout.batch > SPLIT_BATCH), what
    qkv0_a3 = {i.a3 for i in by_stage[(Opcode.QKV, 0)] + by_stage[(Opcode.QKV, 0, "parts")]}
    assert qkv0_a3 == ({1} if folded else {0}), f"{what}: layer 0 QKV a3 {qkv0_a3}"
    assert all(i.a3 == 0 for i in instrs if i.opcode == Opcode.QKV and i.layer > 0), what


def check_queues(program: StepProgram, queues: list[list[Instruction]], policy: str) -> None:
    what = _what(program, policy)
    assert len(queues) == program.layout.num_sms, what
    placed = sorted(i.index for q in queues for i in q)
    assert placed == list(range(len(program.instructions))), f"{what}: instructions lost or duplicated"
    for sm, q in enumerate(queues):
        order = [i.index for i in q]
        assert order == sorted(order), f"{what}: SM {sm} queue leaves the global order: {order[:12]}"
        assert all(i == program.instructions[i.index] for i in q), f"{what}: SM {sm} altered an instruction"
    done = simulate(queues, program.num_counters)
    assert sorted(i.index for i in done) == placed, f"{what}: simulate finished {len(done)} instructions"
    finished: set[int] = set()
    signallers = defaultdict(set)
    for ins in program.instructions:
        signallers[ins.signal_id].add(ins.index)
    for ins in done:
        if ins.wait_id != NO_COUNTER:
            assert signallers[ins.wait_id] <= finished, f"{what}: #{ins.index} ran before its producers"
        finished.add(ins.index)


# ---- every preset, every batch, both policies ------------------------------------------------------------

@pytest.mark.parametrize("fuse,fold", [(None, False), (False, False), (None, True)],
                         ids=("fused-reduce", "reduce-stage", "fused-reduce-folded-embed"))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_fully(name, batch, fuse, fold):
    for num_sms in (NUM_SMS, FEW_SMS):
        program = _program(name, batch, num_sms, fuse=fuse, fold=fold)
        assert program.layout.fused_reduce == (fuse is None), _what(program)
        assert program.layout.embed_folded == fold, _what(program)
        check_program(program)
        races = find_races(program)
        assert races == [], f"{_what(program)}: {races}"
        for policy in POLICIES:
            check_queues(program, assign(program, policy), policy)


# Batch buckets past SPLIT_BATCH: wide inputs that no
# longer fit the staging rule take the ATTN_REDUCE stage
@pytest.mark.parametrize("batch", (16, 32, MAX_BATCH))
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_large_batch_buckets_are_race_and_deadlock_free(name, batch):
    for num_sms in (NUM_SMS, FEW_SMS):
        program = _program(name, batch, num_sms)
        check_program(program)
        races = find_races(program)
        assert races == [], f"{_what(program)}: {races}"
        for policy in POLICIES:
            check_queues(program, assign(program, policy), policy)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_presets_program_and_queues(name, batch):
    program = _program(name, batch)
    assert program.layout.config.num_layers == get_preset(name).num_layers
    check_program(program)
    for policy in POLICIES:
        check_queues(program, assign(program, policy), policy)


# The real shapes past SPLIT_BATCH (two layers of each): QKV split over K, its K ranges closed by the attention
@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_presets_past_split_batch_are_race_and_deadlock_free(name):
    for num_sms in (NUM_SMS, FEW_SMS):
        program = _program(name, 16, num_sms, num_layers=2)
        check_program(program)
        races = find_races(program)
        assert races == [], f"{_what(program)}: {races}"
        for policy in POLICIES:
            check_queues(program, assign(program, policy), policy)


@pytest.mark.parametrize("fold", (False, True), ids=("embed-stage", "folded-embed"))
@pytest.mark.parametrize("name,batch", [(name, 1) for name in REAL_PRESETS] + [("qwen3-0.6b", 8)])
def test_real_preset_shapes_are_race_free(name, batch, fold):
    program = _program(name, batch, num_layers=2, fold=fold)
    check_program(program)
    races = find_races(program)
    assert races == [], f"{_what(program)}: {races}"


@pytest.mark.parametrize("change", ("attention-one-short", "qkv0-waits-on-x"))
def test_find_races_catches_a_folded_embed_with_a_missing_edge(change):
    """With the embedding folded into layer 0's QKV, EMBED is ordered before O_PROJ (which reads x[0]) only
    through layer 0's attention waiting for EMBED's signal too; a count one short leaves x[0] unordered.
    And a layer-0 QKV tile that reads x[0] (a3 = 0) while waiting on nothing races EMBED."""
    program = broken = _program("tiny-llama", 2, FEW_SMS, fold=True)
    for ins in program.instructions:
        if change == "attention-one-short" and ins.opcode == Opcode.ATTN_PARTIAL and ins.layer == 0:
            broken = _with(broken, ins.index, wait_count=ins.wait_count - 1)
        if change == "qkv0-waits-on-x" and ins.opcode == Opcode.QKV and ins.layer == 0 and ins.a2 == 0:
            broken = _with(broken, ins.index, a3=0)
    assert broken != program, change
    races = find_races(broken)
    assert races, f"{change}: no race found"


def test_every_preset_is_covered():
    assert set(TINY_PRESETS) | set(REAL_PRESETS) == set(PRESETS)


# ---- the program without the LM head (build_program(lm_head=False)) -------------------------------------

# what only the LM head and ARGMAX may write: a step without them must leave these alone
LM_OUTPUTS = {"logits", "lm_tile", "out_tokens", "tokens", "positions"}


def _written(program: StepProgram) -> dict[str, list[tuple[int, int, int]]]:
    """buffer name -> (layer, lo, hi) of every region the program's instructions write."""
    out: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for ins in program.instructions:
        for name, layer, lo, hi in STAGE_MODULES[ins.opcode].writes(ins, program.layout):
            out[name].append((layer, lo, hi))
    return out


@pytest.mark.parametrize("fuse", (None, False), ids=("fused-reduce", "reduce-stage"))
@pytest.mark.parametrize("batch", (1, 3, 8))
@pytest.mark.parametrize("name", TINY_PRESETS + REAL_PRESETS)
def test_program_without_lm_head_is_the_step_up_to_x_L(name, batch, fuse):
    """The same instructions (indices, waits, signals) as the full program up to the last layer's DOWN,
    closed under dependencies (every producer of every counter it waits on is in it), writing all of
    x[L] exactly once and none of what LM_HEAD / ARGMAX write; the queues of both policies complete."""
    full = _program(name, batch, fuse=fuse)
    bare = _program(name, batch, fuse=fuse, lm_head=False)
    what = _what(bare)
    n = len(bare.instructions)
    assert bare.lm_tiles == 0 and not bare.has_lm_head and full.has_lm_head, what
    assert bare.num_counters == full.num_counters, what
    assert bare.instructions == full.instructions[:n], f"{what}: not a prefix of the full program"
    tail = Counter(i.opcode for i in full.instructions[n:])
    assert tail == Counter({Opcode.LM_HEAD: full.lm_tiles, Opcode.ARGMAX: 1}), f"{what}: full program adds {tail}"
    full_prod, bare_prod = producers(full), producers(bare)
    for ins in bare.instructions:
        if ins.wait_id != NO_COUNTER:
            assert bare_prod[ins.wait_id] == full_prod[ins.wait_id], \
                f"{what}: #{ins.index} {ins.opcode.name} waits on counter {ins.wait_id}, whose producers " \
                f"{sorted(set(full_prod[ins.wait_id]) - set(bare_prod[ins.wait_id]))[:4]} are left out"
    check_program(bare)
    written = _written(bare)
    assert not LM_OUTPUTS & set(written), f"{what}: writes {sorted(LM_OUTPUTS & set(written))}"
    c = bare.layout.config
    x_last = sorted((lo, hi) for layer, lo, hi in written["x"] if layer == c.num_layers)
    covered = 0
    for lo, hi in x_last:
        assert lo == covered, f"{what}: x[L] regions {x_last[:6]} leave a gap or overlap at {covered}"
        covered = hi
    assert covered == batch * c.hidden_size, f"{what}: x[L] written up to {covered} of {batch * c.hidden_size}"
    for policy in POLICIES:
        check_queues(bare, assign(bare, policy), policy)


@pytest.mark.parametrize("fuse", (None, False), ids=("fused-reduce", "reduce-stage"))
@pytest.mark.parametrize("batch", (1, 3, 8))
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_program_without_lm_head_is_race_free(name, batch, fuse):
    for num_sms in (NUM_SMS, FEW_SMS):
        program = _program(name, batch, num_sms, fuse=fuse, lm_head=False)
        races = find_races(program)
        assert races == [], f"{_what(program)}: {races}"


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_preset_shapes_without_lm_head_are_race_free(name):
    program = _program(name, 1, num_layers=2, lm_head=False)
    races = find_races(program)
    assert races == [], f"{_what(program)}: {races}"


@pytest.mark.parametrize("op", (Opcode.DOWN, Opcode.GATE_UP), ids=lambda op: op.name)
def test_find_races_catches_a_missing_wait_in_the_last_layer_without_lm_head(op):
    """The race check still bites on the shorter program: the last layer's stage loses its wait."""
    program = _program("tiny-llama", 2, FEW_SMS, lm_head=False)
    last = program.layout.config.num_layers - 1
    index = _first(program, op, last)
    races = find_races(_with(program, index, wait_id=NO_COUNTER, wait_count=0))
    assert any(f"#{index} {op.name}" in r for r in races), f"{_what(program)}: {races}"


# ---- the balanced policy ---------------------------------------------------------------------------------

def _matvec_bytes(program: StepProgram, ins: Instruction) -> int:
    c = program.layout.config
    k = {Opcode.QKV: c.hidden_size, Opcode.O_PROJ: c.q_size, Opcode.GATE_UP: c.hidden_size,
         Opcode.DOWN: c.intermediate_size, Opcode.LM_HEAD: c.hidden_size}[ins.opcode]
    return ins.a1 * k * 2


def _largest_tile(program: StepProgram) -> int:
    return max(_matvec_bytes(program, i) for i in program.instructions if i.opcode in MATVEC_OPCODES)


@pytest.mark.parametrize("batch", (1, 2, 5, 8))
@pytest.mark.parametrize("name", TINY_PRESETS + REAL_PRESETS)
def test_balanced_policy_spreads_step_bytes(name, batch):
    """Bound: the per-SM weight bytes of the whole step differ by at most two of the largest tiles (round-robin:
    3-14), and the policy's own cost (bytes + a fixed cost per instruction) by at most the largest instruction
    cost. Round-robin is no better."""
    program = _program(name, batch)
    what = _what(program, "balanced")
    spread = {}
    for policy in POLICIES:
        queues = assign(program, policy)
        per_sm = [sum(_matvec_bytes(program, i) for i in q if i.opcode in MATVEC_OPCODES) for q in queues]
        spread[policy] = max(per_sm) - min(per_sm)
        if policy == "balanced":
            largest = _largest_tile(program)
            assert spread[policy] <= 2 * largest, \
                f"{what}: weight bytes per SM range {min(per_sm)}..{max(per_sm)}, largest tile {largest}"
            cost = [sum(i.cost for i in q) for q in queues]
            max_cost = max(i.cost for i in program.instructions)
            assert max(cost) - min(cost) <= max_cost, f"{what}: cost per SM {min(cost)}..{max(cost)}, max {max_cost}"
    assert spread["balanced"] <= spread["round-robin"], f"{what}: {spread}"


@pytest.mark.parametrize("batch", (1, 8))
@pytest.mark.parametrize("name", TINY_PRESETS + REAL_PRESETS)
def test_balanced_policy_spreads_each_stage(name, batch):
    """Bound (the policy's promise: every SM streams about the same bytes per stage): within
    each matvec stage, per-SM weight bytes differ by at most one tile of that stage: a stage's consumers wait
    for its slowest SM, so two tiles on one SM while another has none doubles the stage's time."""
    program = _program(name, batch)
    what = _what(program, "balanced")
    queues = assign(program, "balanced")
    worst = []
    for op in MATVEC_OPCODES:
        for layer in range(program.layout.config.num_layers if op != Opcode.LM_HEAD else 1):
            stage = [[_matvec_bytes(program, i) for i in q if i.opcode == op and i.layer == layer] for q in queues]
            tile = max(max(s, default=0) for s in stage)
            totals = [sum(s) for s in stage]
            if max(totals) - min(totals) > tile:
                worst.append(f"{op.name} layer {layer}: {max(totals) // tile} tiles on one SM, "
                             f"{min(totals) // tile} on another")
    assert not worst, f"{what}: {worst[:4]}"


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="policy='fastest'"):
        assign(_program("tiny-llama", 1), "fastest")


# ---- broken schedules are caught -------------------------------------------------------------------------

def _first(program: StepProgram, op: Opcode, layer: int = 0) -> int:
    return next(i.index for i in program.instructions if i.opcode == op and i.layer == layer)


def _with(program: StepProgram, index: int, **changes) -> StepProgram:
    instrs = list(program.instructions)
    instrs[index] = dataclasses.replace(instrs[index], **changes)
    return dataclasses.replace(program, instructions=tuple(instrs))


def _waiting_on(program: StepProgram, index: int, op: Opcode, layer: int) -> StepProgram:
    """The program with instruction `index` waiting for all of stage (op, layer) instead of its own producer."""
    counter = program.instructions[_first(program, op, layer)].signal_id
    count = sum(1 for i in program.instructions if i.opcode == op and i.layer == layer)
    return _with(program, index, wait_id=counter, wait_count=count)


STAGES_THAT_WAIT = [(Opcode.QKV, 0), (Opcode.QKV, 1), (Opcode.ATTN_PARTIAL, 1), (Opcode.ATTN_REDUCE, 0),
                    (Opcode.O_PROJ, 1), (Opcode.GATE_UP, 0), (Opcode.DOWN, 1), (Opcode.LM_HEAD, 0),
                    (Opcode.ARGMAX, 0)]


# (ATTN_REDUCE exists only where O_PROJ does not merge the splits itself)
MISSING_WAIT_CASES = [(op, layer, fuse) for fuse in (None, False) for op, layer in STAGES_THAT_WAIT
                      if not (op == Opcode.ATTN_REDUCE and fuse is None)]


@pytest.mark.parametrize("op,layer,fuse", MISSING_WAIT_CASES,
                         ids=[f"{op.name}-L{layer}-{'fused' if fuse is None else 'reduce'}"
                              for op, layer, fuse in MISSING_WAIT_CASES])
def test_find_races_catches_a_missing_wait(op, layer, fuse):
    """One instruction loses its wait: it may now run before the stage that writes its input."""
    program = _program("tiny-qwen3", 3, FEW_SMS, fuse=fuse)
    index = _first(program, op, layer)
    broken = _with(program, index, wait_id=NO_COUNTER, wait_count=0)
    races = find_races(broken)
    assert any(f"#{index} {op.name}" in r for r in races), \
        f"{_what(program)}: #{index} {op.name} layer {layer} without its wait; find_races said {races}"


def test_find_races_catches_a_wait_on_the_wrong_stage():
    """O_PROJ waiting on the attention partials instead of their reduction reads attn_out unordered."""
    program = _program("tiny-llama", 2, FEW_SMS, fuse=False)
    index = _first(program, Opcode.O_PROJ, 1)
    races = find_races(_waiting_on(program, index, Opcode.ATTN_PARTIAL, 1))
    assert any(f"#{index} O_PROJ" in r and "attn_out" in r for r in races), f"{_what(program)}: {races}"


def test_find_races_catches_a_fused_o_proj_waiting_on_qkv():
    """A merging O_PROJ waiting on QKV (the stage before the partials) reads attn_part unordered."""
    program = _program("tiny-llama", 2, FEW_SMS)
    assert program.layout.fused_reduce, _what(program)
    index = _first(program, Opcode.O_PROJ, 1)
    races = find_races(_waiting_on(program, index, Opcode.QKV, 1))
    assert any(f"#{index} O_PROJ" in r and "attn_part" in r for r in races), f"{_what(program)}: {races}"


@pytest.mark.parametrize("fuse", (None, False), ids=("fused-reduce", "reduce-stage"))
def test_find_races_catches_a_wait_that_is_one_short(fuse):
    program = _program("tiny-llama", 2, FEW_SMS, fuse=fuse)
    index = _first(program, Opcode.O_PROJ, 0)
    ins = program.instructions[index]
    broken = _with(program, index, wait_count=ins.wait_count - 1)
    races = find_races(broken)
    assert any(f"#{index} O_PROJ" in r for r in races), \
        f"{_what(program)}: #{index} waits for {ins.wait_count - 1} of {ins.wait_count} reductions; {races}"


def _ins(op: Opcode, index: int, wait: tuple[int, int] | None, signal: int) -> Instruction:
    wait_id, wait_count = wait if wait else (NO_COUNTER, 0)
    return Instruction(opcode=op, index=index, wait_id=wait_id, wait_count=wait_count, signal_id=signal)


def test_simulate_raises_on_a_cycle_between_two_queues():
    """SM 0: A waits for counter 1, then B signals counter 0.  SM 1: C waits for counter 0, then D signals 1.
    A needs D, D is behind C, C needs B, B is behind A: a cycle, so the GPU would hang."""
    a = _ins(Opcode.O_PROJ, 0, (1, 1), 2)
    b = _ins(Opcode.QKV, 1, None, 0)
    c = _ins(Opcode.GATE_UP, 2, (0, 1), 3)
    d = _ins(Opcode.DOWN, 3, None, 1)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[a, b], [c, d]], num_counters=4)
    # The same four instructions in an order consistent across queues complete.
    assert len(simulate([[b, a], [d, c]], num_counters=4)) == 4


def test_simulate_raises_when_a_target_is_never_reached():
    producer = _ins(Opcode.QKV, 0, None, 0)
    consumer = _ins(Opcode.ATTN_PARTIAL, 1, (0, 2), 1)   # waits for two signals, only one comes
    with pytest.raises(RuntimeError, match=r"#1 ATTN_PARTIAL waits counter 0 >= 2 \(is 1\)"):
        simulate([[producer], [consumer]], num_counters=2)


@pytest.mark.parametrize("policy", POLICIES)
def test_simulate_raises_on_reversed_queues(policy):
    program = _program("tiny-llama", 2, FEW_SMS)
    queues = [list(reversed(q)) for q in assign(program, policy)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(queues, program.num_counters)


def test_simulate_raises_when_a_consumer_precedes_its_producer_on_one_sm():
    program = _program("tiny-qwen3", 1, FEW_SMS)
    queues = assign(program, "round-robin")
    # move the last DOWN of layer 0 in front of the first instruction of its own queue
    target = max(i.index for i in program.instructions if i.opcode == Opcode.DOWN and i.layer == 0)
    sm = next(s for s, q in enumerate(queues) if any(i.index == target for i in q))
    q = queues[sm]
    moved = next(i for i in q if i.index == target)
    queues[sm] = [moved] + [i for i in q if i.index != target]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(queues, program.num_counters)


# ---- StepLayout.validate -------------------------------------------------------------------------------

def _layout(batch: int = 1, **config_changes) -> StepLayout:
    config = dataclasses.replace(get_preset("tiny-llama"), **config_changes)
    return StepLayout(config=config, batch=batch, kv_splits=2, block_size=16, max_blocks_per_seq=4, num_sms=8)


REJECTED = {
    "batch-0": (dict(batch=0), "batch=0"),
    "batch-past-the-buckets": (dict(batch=MAX_BATCH + 1), f"batch={MAX_BATCH + 1}"),
    "head-dim-96": (dict(head_dim=96, num_heads=8, num_kv_heads=2), "head_dim=96"),
    "hidden-384": (dict(hidden_size=384), "hidden_size=384"),
    "hidden-1000": (dict(hidden_size=1000), "hidden_size=1000"),
    "vocab-1001": (dict(vocab_size=1001), "vocab_size=1001"),
    "vocab-1020": (dict(vocab_size=1020), "vocab_size=1020"),
    "intermediate-700": (dict(intermediate_size=700), "intermediate_size=700"),
    "gqa-16": (dict(num_heads=16, num_kv_heads=1), "num_heads/num_kv_heads=16"),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_step_layout_rejects_unsupported_shapes(case):
    changes, match = REJECTED[case]
    changes = dict(changes)
    layout = _layout(changes.pop("batch", 1), **changes)
    with pytest.raises(ValueError, match=match):
        layout.validate()
    with pytest.raises(ValueError, match=match):
        build_program(layout)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_step_layout_accepts_every_preset(name):
    config = get_preset(name)
    for batch in (1, 8):
        StepLayout(config=config, batch=batch, kv_splits=1, block_size=16, max_blocks_per_seq=1,
                   num_sms=NUM_SMS).validate()


# ---- serialization -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,batch,policy,lm_head", [("tiny-llama", 3, "balanced", True),
                                                       ("tiny-qwen3", 8, "round-robin", True),
                                                       ("qwen3-0.6b", 2, "balanced", True),
                                                       ("tiny-qwen3", 8, "balanced", False),
                                                       ("llama-3.2-1b", 4, "round-robin", False)])
def test_serialize_round_trip(name, batch, policy, lm_head):
    program = _program(name, batch, lm_head=lm_head)
    queues = assign(program, policy)
    table, lengths = serialize(queues)
    what = _what(program, policy)
    longest = max(len(q) for q in queues)
    assert table.dtype == torch.int32 and lengths.dtype == torch.int32, what
    assert tuple(table.shape) == (len(queues), longest, WORDS), what
    assert lengths.tolist() == [len(q) for q in queues], what
    for sm, q in enumerate(queues):
        assert not table[sm, len(q):].any(), f"{what}: SM {sm} padding is not zero"
        for i, ins in enumerate(q):
            assert table[sm, i].tolist() == ins.encode(), f"{what}: SM {sm} slot {i}"
    assert deserialize(table, lengths) == queues, what


def test_instruction_encode_decode_round_trip():
    gen = torch.Generator().manual_seed(11)
    for op in Opcode:
        for _ in range(20):
            vals = torch.randint(-1, 2**31 - 1, (8,), generator=gen).tolist()
            ins = Instruction(opcode=op, layer=vals[0] % 128, a0=vals[1], a1=vals[2], a2=vals[3], a3=vals[4],
                              wait_id=vals[5] if vals[5] % 3 else NO_COUNTER, wait_count=vals[6] % 10_000,
                              signal_id=vals[7], index=vals[0])
            words = ins.encode()
            assert len(words) == WORDS and all(-2**31 <= w < 2**31 for w in words), f"seed=11 {ins}"
            assert Instruction.decode(words) == ins, f"seed=11 {ins}"
            assert Instruction.decode(torch.tensor(words, dtype=torch.int32)) == ins, f"seed=11 {ins}"


@pytest.mark.parametrize("vocab", [8, 1000, 32000, 50264, 128256, 151936])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
@pytest.mark.parametrize("policy", ["balanced", "round-robin"])
def test_lm_head_tiles_cover_every_vocabulary_row_exactly_once(vocab, num_sms, policy):
    """Vocabularies that are multiples of 8 but of no tile size (50264 = 8 x 6283), on machines whose SM
    count divides nothing: the LM head tiles, as assigned to the queues, cover rows 0 .. V-1 once each,
    every tile has its own argmax slot, and ARGMAX reduces exactly those slots."""
    config = dataclasses.replace(get_preset("tiny-llama"), vocab_size=vocab)
    layout = StepLayout(config=config, batch=1, kv_splits=1, block_size=16, max_blocks_per_seq=2, num_sms=num_sms)
    program = build_program(layout)
    queued = [ins for queue in assign(program, policy) for ins in queue]
    tiles = sorted((ins.a0, ins.a1, ins.a2) for ins in queued if ins.opcode == Opcode.LM_HEAD)
    rows = Counter(r for a0, a1, _ in tiles for r in range(a0, a0 + a1))
    what = f"vocab={vocab} num_sms={num_sms} policy={policy}"
    assert set(rows) == set(range(vocab)) and set(rows.values()) == {1}, f"{what}: rows covered {len(rows)}"
    assert sorted(t[2] for t in tiles) == list(range(program.lm_tiles)), f"{what}: argmax slots"
    assert all(a1 % ROW_GROUP == 0 and a1 > 0 for _, a1, _ in tiles), what
    argmax = [ins for ins in queued if ins.opcode == Opcode.ARGMAX]
    assert len(argmax) == 1 and argmax[0].a0 == program.lm_tiles, what


def test_attention_takes_several_sequences_only_past_batch_8_with_more_pairs_than_sms():
    """warp_attention's rule on the llama-3.2-1b shape (8 kv heads, 132 SMs): batch 64 takes 4 sequences an
    instruction whatever the cache's length; batch 16 (128 pairs), batch 8 or two KV splits keep one."""
    config = get_preset("llama-3.2-1b")

    def seqs(batch, max_seq, splits=1):
        layout = StepLayout(config=config, batch=batch, kv_splits=splits, block_size=16,
                            max_blocks_per_seq=max_seq // 16, num_sms=132)
        return {i.seqs for i in build_program(layout).instructions if i.opcode == Opcode.ATTN_PARTIAL}

    assert seqs(64, 512) == seqs(64, 8192) == {4} and seqs(32, 256) == seqs(32, 4096) == {2}
    assert seqs(16, 256) == seqs(8, 256) == seqs(64, 512, splits=2) == {1}


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), batch=st.integers(1, MAX_BATCH), num_sms=st.integers(1, 264),
       cache=st.integers(1, 20_000))
def test_default_kv_splits_fit_the_sms_and_keep_a_whole_cache_split_to_one_tensor_core_step(name, batch, num_sms,
                                                                                             cache):
    """default_kv_splits: at most one (sequence, kv head, split) item an SM and 32 splits; below that cap, the fewest
    splits, at least 4, such that every split of the whole cache (the kernel's split_range) is at most one
    tensor-core step a consumer warp (8 x MMA_TILES[head_dim] x NARROW_WARPS positions)."""
    config = get_preset(name)
    splits = default_kv_splits(config, batch, num_sms, cache)
    cap = max(1, min(32, num_sms // (batch * config.num_kv_heads)))
    step = 8 * MMA_TILES[config.head_dim] * NARROW_WARPS

    def longest(n: int) -> int:
        return max(hi - lo for lo, hi in (split_range(cache, s, n) for s in range(n)))

    assert min(4, cap) <= splits <= cap, (splits, cap)
    if splits < cap:
        assert longest(splits) <= step, (splits, longest(splits), step)
        assert splits == 4 or longest(splits - 1) > step, (splits, longest(splits - 1), step)
