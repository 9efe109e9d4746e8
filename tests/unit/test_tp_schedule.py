"""Tensor parallelism simulated on the CPU: the weight shards, the program every rank runs, its queues, the
race check across ranks and steps, and the multi-rank VM against the float32 ReferenceDecoder and the
single-GPU VM (float32 weights and caches on every side, so only the order of sums differs).

The tiny presets split over 2 ranks only (2 kv heads); TP_CONFIGS adds two shapes with 4 and 8 kv heads
(otherwise tiny-llama and tiny-qwen3) so that 4 and 8 ranks run too.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megakernel.instructions.layout import ROW_GROUP, SPLIT_BATCH, StepLayout, pack_weights
from megakernel.instructions.opcodes import Opcode, Stage, counter_id
from megakernel.instructions.record import NO_COUNTER, W_SIGNAL_ID, Instruction, deserialize
from megakernel.instructions.tensor_parallel import EXCHANGE_OPCODES, reduce
from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.tensor_parallel import check_world_size, shard_config, shard_weights
from megakernel.model.weights import random_weights
from megakernel.schedule import assign
from megakernel.schedule.tensor_parallel import (TPInstructionVM, TPVMDecoder, build_tp_program, exchange_counter,
                                                 find_tp_races, happens_before, is_exchange_counter,
                                                 lm_exchange_counter, rank_tables, simulate_ranks)
from megakernel.schedule.vm import ScheduleError, VMDecoder
from megakernel.testing.strategies import kv_lengths, seeds
from megakernel.testing.tolerances import assert_close, greedy_tolerance_for

TP_CONFIGS = {
    "tiny-llama": get_preset("tiny-llama"),
    "tiny-qwen3": get_preset("tiny-qwen3"),
    "tiny-llama-kv4": dataclasses.replace(get_preset("tiny-llama"), num_heads=8, num_kv_heads=4,
                                          name="tiny-llama-kv4"),
    "tiny-qwen3-kv8": dataclasses.replace(get_preset("tiny-qwen3"), num_heads=8, num_kv_heads=8, head_dim=64,
                                          name="tiny-qwen3-kv8"),
}
WORLD_SIZES = {"tiny-llama": (1, 2), "tiny-qwen3": (1, 2), "tiny-llama-kv4": (2, 4), "tiny-qwen3-kv8": (2, 4, 8)}
SPLITS = [(name, w) for name, sizes in WORLD_SIZES.items() for w in sizes if w > 1]
ORDERS = ("round-robin", "reverse", "greedy")
POLICIES = ("balanced", "round-robin")
FEW_SMS = 5
# each example builds and runs every rank's decoder: bounded, unless a long (fuzz) profile was asked for
TP_EXAMPLES = min(settings.default.max_examples, 25) if settings.default.max_examples < 1000 \
    else settings.default.max_examples

# tiny torch ops on the CPU: one intra-op thread (the plugin's fixture)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _layout(name: str, batch: int, num_sms: int, fuse=None, fold=False, splits: int = 2) -> StepLayout:
    return StepLayout(config=TP_CONFIGS[name], batch=batch, kv_splits=splits, block_size=16, max_blocks_per_seq=4,
                      num_sms=num_sms, fuse_attn_reduce=fuse, fold_embed=fold)


def _what(program) -> str:
    lay = program.layout
    return (f"{lay.full_config.name} W={program.world_size} batch={lay.batch} splits={lay.kv_splits} "
            f"sms={lay.num_sms} fused_reduce={lay.fused_reduce} embed_folded={lay.embed_folded} "
            f"({len(program.instructions)} instructions)")


# ---- the shards -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,world", [(n, w) for n, sizes in WORLD_SIZES.items() for w in sizes])
def test_shards_put_back_together_are_the_model(name, world):
    """Each shard holds its ranks' query heads with the kv heads they read, its FFN slice, its O and down
    columns and its vocabulary rows; side by side in rank order they are the model's matrices again."""
    config = TP_CONFIGS[name]
    weights = random_weights(config, seed=21, dtype=torch.float32)
    shards = shard_weights(weights, world)
    sc = shard_config(config, world)
    assert (sc.num_heads * world, sc.num_kv_heads * world, sc.intermediate_size * world, sc.vocab_size * world) == \
        (config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size), name
    assert sc.hidden_size == config.hidden_size and sc.gqa_group == config.gqa_group, name
    q, kv, f = sc.q_size, sc.kv_size, sc.intermediate_size
    for l, lw in enumerate(weights.layers):
        parts = [s.layers[l] for s in shards]
        qkv = torch.cat([p.qkv[:q] for p in parts] + [p.qkv[q:q + kv] for p in parts] + [p.qkv[q + kv:] for p in parts])
        assert torch.equal(qkv, lw.qkv), f"{name} W={world} layer {l}: qkv rows"
        gate_up = torch.cat([p.gate_up[:f] for p in parts] + [p.gate_up[f:] for p in parts])
        assert torch.equal(gate_up, lw.gate_up), f"{name} W={world} layer {l}: gate/up rows"
        assert torch.equal(torch.cat([p.o_proj for p in parts], dim=1), lw.o_proj), f"{name} layer {l}: o_proj"
        assert torch.equal(torch.cat([p.down for p in parts], dim=1), lw.down), f"{name} layer {l}: down"
        for p in parts:
            assert p.attn_norm is lw.attn_norm and p.mlp_norm is lw.mlp_norm and p.q_norm is lw.q_norm, name
    assert torch.equal(torch.cat([s.lm_head for s in shards]), weights.lm_head), f"{name} W={world}: lm_head"
    assert all(s.embed is weights.embed and s.config == sc for s in shards), name
    packed = pack_weights(shards[-1], 16)
    assert tuple(packed.qkv.shape) == (config.num_layers, sc.qkv_rows, config.hidden_size), name
    assert tuple(packed.down.shape) == (config.num_layers, config.hidden_size, f), name


REFUSED = [
    ("tiny-llama", 3, "world_size=3"), ("tiny-llama", 0, "world_size=0"), ("tiny-llama", 16, "world_size=16"),
    ("tiny-llama", True, "world_size=True"), ("tiny-llama", 2.0, "world_size=2.0"),
    ("tiny-llama", 4, "num_kv_heads=2 .* world_size=4"), ("tiny-qwen3", 8, "num_heads=4 .* world_size=8"),
    ("tiny-llama-kv4", 8, "num_kv_heads=4"),
]


@pytest.mark.parametrize("name,world,match", REFUSED, ids=[f"{n}-W{w!r}" for n, w, _ in REFUSED])
def test_a_world_size_the_model_does_not_split_into_is_refused(name, world, match):
    """Refused with ValueError naming the field, by the shard config, the program and the decoder (before any
    weights are split)."""
    weights = random_weights(TP_CONFIGS[name], seed=3, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        check_world_size(TP_CONFIGS[name], world)
    with pytest.raises(ValueError, match=match):
        build_tp_program(_layout(name, 1, 7), world)
    with pytest.raises(ValueError, match=match):
        TPVMDecoder(weights, world, 1, 16, num_sms=7)


def test_shard_sizes_that_are_not_whole_row_groups_are_refused():
    """Divisible, but a rank would get 125 LM head rows (not a multiple of ROW_GROUP), or 100 FFN rows."""
    config = dataclasses.replace(TP_CONFIGS["tiny-qwen3-kv8"], vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocab_size=1000 / world_size=8 = 125 rows per rank"):
        build_tp_program(StepLayout(config=config, batch=1, kv_splits=1, block_size=16, max_blocks_per_seq=1,
                                    num_sms=7), 8)
    with pytest.raises(ValueError, match="intermediate_size=100 .* world_size=8"):
        check_world_size(dataclasses.replace(TP_CONFIGS["tiny-qwen3-kv8"], intermediate_size=100), 8)


def test_a_batch_past_split_batch_is_refused():
    """Past SPLIT_BATCH the attention sums QKV's K-range partials wherever QKV splits over K (split_k.py); the
    tensor-parallel program does not split QKV, so it takes batches up to SPLIT_BATCH."""
    build_tp_program(_layout("tiny-llama", SPLIT_BATCH, 7), 2)
    with pytest.raises(ValueError, match=f"batch={SPLIT_BATCH + 1}: tensor parallel runs batches up to"):
        build_tp_program(_layout("tiny-llama", SPLIT_BATCH + 1, 7), 2)


# ---- the program, written out independently of the builder ------------------------------------------------

def _covers(tiles: list[Instruction], rows: int, quantum: int, what: str) -> None:
    """The tiles' [a0, a0 + a1) partition [0, rows) in order, in multiples of `quantum`, a2 = position."""
    row = 0
    for t, ins in enumerate(sorted(tiles, key=lambda i: i.a0)):
        assert ins.a0 == row and ins.a1 > 0 and ins.a1 % quantum == 0 and ins.a2 == t, \
            f"{what}: tile {t} covers [{ins.a0}, {ins.a0 + ins.a1}) after {row}"
        row += ins.a1
    assert row == rows, f"{what}: tiles cover {row} of {rows} rows"


def check_tp_program(program) -> None:
    """Topological order; every wait counts every signal its counter gets per step on a rank (world_size per
    exchange instruction); the exchange stages and nothing else signal the exchange counters; the tiles of
    every stage cover the rank's rows once; each reduce closes its own layer's exchange."""
    what = _what(program)
    ins_list, W, lay = program.instructions, program.world_size, program.layout
    c, L = lay.config, lay.config.num_layers
    assert [i.index for i in ins_list] == list(range(len(ins_list))), what
    signals: Counter = Counter()
    for ins in ins_list:
        exchange = ins.opcode in EXCHANGE_OPCODES
        assert exchange == is_exchange_counter(ins.signal_id, L), \
            f"{what}: #{ins.index} {ins.opcode.name} signals counter {ins.signal_id}"
        if ins.wait_id != NO_COUNTER:
            assert signals[ins.wait_id] == ins.wait_count, \
                f"{what}: #{ins.index} {ins.opcode.name} waits for {ins.wait_count}, {signals[ins.wait_id]} precede it"
        signals[ins.signal_id] += W if exchange else 1
    stages = defaultdict(list)
    for ins in ins_list:
        stages[(ins.opcode, ins.layer, ins.a3 if ins.opcode == Opcode.TP_REDUCE else 0)].append(ins)
    for l in range(L):
        _covers(stages[(Opcode.QKV, l, 0)], c.qkv_rows, ROW_GROUP, f"{what} QKV layer {l}")
        _covers(stages[(Opcode.GATE_UP, l, 0)], 2 * c.intermediate_size, 2 * ROW_GROUP, f"{what} GATE_UP layer {l}")
        for op in (Opcode.TP_O_PROJ, Opcode.TP_DOWN):
            _covers(stages[(op, l, 0)], c.hidden_size, ROW_GROUP, f"{what} {op.name} layer {l}")
        partials = Counter((i.a0, i.a1, i.a2) for i in stages[(Opcode.ATTN_PARTIAL, l, 0)])
        assert partials == Counter((b, h, s) for b in range(lay.batch) for h in range(c.num_kv_heads)
                                   for s in range(lay.kv_splits)), f"{what}: layer {l} attention items"
        assert {i.a3 for i in stages[(Opcode.TP_O_PROJ, l, 0)]} == {lay.kv_splits if lay.fused_reduce else 0}, what
        for part, op in ((reduce.ATTENTION, Opcode.TP_O_PROJ), (reduce.FFN, Opcode.TP_DOWN)):
            tiles = stages[(Opcode.TP_REDUCE, l, part)]
            _covers(tiles, c.hidden_size, ROW_GROUP, f"{what} TP_REDUCE part {part} layer {l}")
            n = len(stages[(op, l, 0)])
            assert {(i.wait_id, i.wait_count) for i in tiles} == {(exchange_counter(L, l, part), W * n)}, what
    lm = stages[(Opcode.TP_LM_HEAD, 0, 0)]
    _covers(lm, c.vocab_size, ROW_GROUP, f"{what} TP_LM_HEAD")
    assert {i.a3 for i in lm} == {len(lm)} and program.lm_tiles == len(lm), what
    (argmax,) = stages[(Opcode.ARGMAX, 0, 0)]
    assert (argmax.a0, argmax.wait_id, argmax.wait_count) == (W * len(lm), lm_exchange_counter(L), W * len(lm)), what


def _programs(name_worlds, batches=(1, 3, 8), sms=(132, FEW_SMS)):
    for name, world in name_worlds:
        for batch in batches:
            for num_sms in sms:
                for fuse, fold in ((None, False), (False, False), (None, True)):
                    yield build_tp_program(_layout(name, batch, num_sms, fuse, fold), world)


@pytest.mark.parametrize("name,world", SPLITS)
def test_tp_programs_queues_and_tables(name, world):
    for program in _programs([(name, world)]):
        what = _what(program)
        check_tp_program(program)
        assert program.layout.embed_folded == program.layout.fold_embed, what
        for policy in POLICIES:
            queues = assign(program, policy)
            assert sorted(i.index for q in queues for i in q) == list(range(len(program.instructions))), what
            assert all([i.index for i in q] == sorted(i.index for i in q) for q in queues), f"{what} {policy}"
            done = simulate_ranks([queues] * world, program.num_counters, program.layout.config.num_layers)
            assert Counter(r for r, _, _ in done) == Counter({r: len(program.instructions) for r in range(world)}), what
            tables = rank_tables(program, policy)
            assert len(tables) == world and all(deserialize(t, n) == queues for t, n in tables), f"{what} {policy}"


@pytest.mark.parametrize("name,world", SPLITS)
def test_tp_programs_are_race_free_across_ranks_and_steps(name, world):
    for program in _programs([(name, world)], batches=(1, 3), sms=(FEW_SMS,)):
        assert find_tp_races(program) == [], _what(program)


@pytest.mark.parametrize("name,world", [("llama-3.2-1b", 8), ("qwen3-0.6b", 2), ("llama-3.1-8b", 4)])
def test_real_preset_shapes_split_are_race_free(name, world):
    """Real shapes (2 of their layers) over several ranks: thousands of nodes per step. At 32 SMs: the pairs
    of tiles touching one region grow with the square of the tiles per stage, and 132 SMs add nothing new."""
    layout = StepLayout(config=dataclasses.replace(get_preset(name), num_layers=2), batch=2, kv_splits=4,
                        block_size=16, max_blocks_per_seq=8, num_sms=32)
    program = build_tp_program(layout, world)
    check_tp_program(program)
    assert find_tp_races(program) == [], _what(program)


# ---- broken programs are caught ----------------------------------------------------------------------------

def _first(program, op: Opcode, layer: int = 0, part: int | None = None) -> Instruction:
    return next(i for i in program.instructions
                if i.opcode == op and i.layer == layer and (part is None or i.a3 == part))


def _with(program, index: int, **changes):
    ins_list = list(program.instructions)
    ins_list[index] = dataclasses.replace(ins_list[index], **changes)
    return dataclasses.replace(program, instructions=tuple(ins_list))


def _broken(program, change: str) -> tuple[object, Instruction, str]:
    """(the program with one instruction broken, that instruction, the buffer it then races on)."""
    W = program.world_size
    if change == "reduce-counts-its-own-rank-only":
        ins = _first(program, Opcode.TP_REDUCE, 1, reduce.ATTENTION)
        return _with(program, ins.index, wait_count=ins.wait_count // W), ins, "recv_o"
    if change == "ffn-reduce-waits-on-gate-up":
        ins = _first(program, Opcode.TP_REDUCE, 0, reduce.FFN)
        gate_up = sum(1 for i in program.instructions if i.opcode == Opcode.GATE_UP and i.layer == 0)
        return _with(program, ins.index, wait_id=counter_id(0, Stage.GATE_UP), wait_count=gate_up), ins, "recv_down"
    if change == "o-proj-without-wait":
        ins = _first(program, Opcode.TP_O_PROJ, 1)
        return _with(program, ins.index, wait_id=NO_COUNTER, wait_count=0), ins, "attn_part"
    if change == "lm-head-slots-collide":
        # a3 = 0 tiles per rank: every rank's tile t stores into slot t of every rank at once
        ins = _first(program, Opcode.TP_LM_HEAD)
        return _with(program, ins.index, a3=0), ins, "lm_tile"
    ins = _first(program, Opcode.ARGMAX)                       # "argmax-counts-its-own-tiles-only"
    return _with(program, ins.index, wait_count=program.lm_tiles, a0=W * program.lm_tiles), ins, "lm_tile"


BREAKS = ("reduce-counts-its-own-rank-only", "ffn-reduce-waits-on-gate-up", "o-proj-without-wait",
          "argmax-counts-its-own-tiles-only", "lm-head-slots-collide")


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("change", BREAKS)
def test_find_tp_races_catches_a_broken_program(change, world):
    program = build_tp_program(_layout("tiny-llama-kv4", 2, FEW_SMS), world)
    broken, ins, buffer = _broken(program, change)
    races = find_tp_races(broken, limit=40)
    named = [r for r in races if f"#{ins.index} {ins.opcode.name}" in r and f"{buffer}@rank" in r]
    assert named, f"{_what(program)} {change}: #{ins.index} {ins.opcode.name} not reported on {buffer}: {races}"


def test_happens_before_joins_ranks_only_through_exchanges():
    """Node (step, rank, i): a rank's O projection does not wait for a peer's QKV; its reduce follows every
    peer's partials; the next step starts after the peer's LM head tiles (through the global ARGMAX) but not
    after the peer's ARGMAX itself (the ranks are not launched together); the next step's first partial
    store into the peer follows every reduce of the peer's step that reads that slot."""
    program = build_tp_program(_layout("tiny-llama", 2, FEW_SMS), 2)
    bits, n = happens_before(program, steps=2), len(program.instructions)

    def node(step, rank, ins):
        return (step * 2 + rank) * n + ins.index

    def before(a, b) -> bool:
        return bool((bits[b] >> a) & 1)

    of = defaultdict(list)
    for ins in program.instructions:
        of[(ins.opcode, ins.layer, ins.a3 if ins.opcode == Opcode.TP_REDUCE else 0)].append(ins)
    qkv, o0 = of[(Opcode.QKV, 0, 0)][0], of[(Opcode.TP_O_PROJ, 0, 0)][0]
    assert not before(node(0, 1, qkv), node(0, 0, o0)), "an O projection waits for a peer's QKV"
    red = of[(Opcode.TP_REDUCE, 0, reduce.ATTENTION)][0]
    assert all(before(node(0, 1, o), node(0, 0, red)) for o in of[(Opcode.TP_O_PROJ, 0, 0)]), "reduce before a partial"
    embed, (argmax,) = of[(Opcode.EMBED, 0, 0)][0], of[(Opcode.ARGMAX, 0, 0)]
    assert all(before(node(0, 1, t), node(1, 0, embed)) for t in of[(Opcode.TP_LM_HEAD, 0, 0)])
    assert not before(node(0, 1, argmax), node(1, 0, embed)), "the ranks' launches are joined"
    assert before(node(0, 0, argmax), node(1, 0, embed)), "a rank's step does not follow its previous one"
    assert all(before(node(0, 1, r), node(1, 0, o0)) for r in of[(Opcode.TP_REDUCE, 0, reduce.ATTENTION)])


# ---- the VM ------------------------------------------------------------------------------------------------

PROMPT_LENS = (7, 1, 4)
NEW_TOKENS = 5
LAST_POSITION = max(PROMPT_LENS) - 1 + NEW_TOKENS - 1

# (config, world, policy, order, num_sms, kv_splits, block_size, shuffled block table, fold, fuse)
VM_CASES = [
    ("tiny-llama", 2, "balanced", "round-robin", 132, None, 16, False, False, None),
    ("tiny-llama", 2, "round-robin", "reverse", 7, 3, 4, True, True, None),
    ("tiny-qwen3", 2, "balanced", "greedy", 7, 2, 4, True, False, False),
    ("tiny-qwen3", 2, "round-robin", "reverse", 132, None, 16, True, False, None),
    ("tiny-llama-kv4", 4, "balanced", "reverse", 7, 2, 8, True, False, False),
    ("tiny-llama-kv4", 2, "round-robin", "greedy", 5, 1, 16, False, True, None),
    ("tiny-qwen3-kv8", 4, "round-robin", "round-robin", 5, 3, 4, True, False, None),
    ("tiny-qwen3-kv8", 8, "balanced", "reverse", 132, None, 16, True, True, None),
]


def _id(case) -> str:
    name, world, policy, order, sms, splits, bs, shuffled, fold, fuse = case
    return (f"{name}-W{world}-{policy}-{order}-sms{sms}-splits{splits or 'auto'}-bs{bs}"
            + ("-shuffled" if shuffled else "") + ("-folded" if fold else "")
            + ("-reduce-stage" if fuse is False else ""))


def _block_table(batch, max_seq_len, block_size, num_blocks, shuffled, gen) -> torch.Tensor:
    if not shuffled:
        return contiguous_block_table(batch, max_seq_len, block_size)
    per_seq = -(-max_seq_len // block_size)
    return torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)


def _check_ranks_agree(tp: TPVMDecoder, what: str) -> None:
    """Every rank holds a bit-identical residual stream (x, h of every layer) and the same next tokens."""
    first = tp.contexts[0].bufs
    assert not torch.isnan(first.x).any() and not torch.isnan(first.h).any(), f"{what}: x or h not written"
    for r, ctx in enumerate(tp.contexts[1:], 1):
        for name in ("x", "h", "out_tokens", "tokens", "positions"):
            mine, theirs = getattr(ctx.bufs, name), getattr(first, name)
            assert torch.equal(mine, theirs), f"{what}: rank {r} {name} differs from rank 0"


@pytest.mark.parametrize("case", VM_CASES, ids=[_id(c) for c in VM_CASES])
def test_tp_vm_equals_reference_and_single_gpu_vm(case):
    """Prompts of different lengths fed through the TP VM, the single-GPU VM and the float32 reference, then
    greedy steps: logits within float32 tolerance of both every step, the same tokens (near-tie rule), every
    rank's x and h bit-identical, and each rank's KV cache the reference's at its own kv heads."""
    name, world, policy, order, num_sms, kv_splits, block_size, shuffled, fold, fuse = case
    config, seed = TP_CONFIGS[name], 500 + VM_CASES.index(case)
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    batch, max_seq_len = len(PROMPT_LENS), LAST_POSITION + 1
    num_blocks = batch * -(-max_seq_len // block_size) + (3 if shuffled else 0)
    kw = dict(block_size=block_size, num_sms=num_sms, policy=policy, kv_splits=kv_splits, num_blocks=num_blocks,
              fold_embed=fold)
    tp = TPVMDecoder(weights, world, batch, max_seq_len, fuse_attn_reduce=fuse, **kw)
    one = VMDecoder(weights, batch, max_seq_len, **kw)
    assert tp.program.layout.fused_reduce == (fuse is None), _id(case)
    ref = ReferenceDecoder(weights)
    cache = PagedKVCache.allocate(config, num_blocks, block_size, dtype=torch.float32)
    table = _block_table(batch, max_seq_len, block_size, num_blocks, shuffled, gen)
    tol = greedy_tolerance_for(torch.float32)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    longest = max(PROMPT_LENS)
    padded = torch.tensor([[p[0]] * (longest - len(p)) + p for p in prompts]).T
    offsets = torch.tensor([longest - n for n in PROMPT_LENS])
    what = f"{_id(case)} seed={seed} batch={batch} splits={tp.layout.kv_splits} float32"
    tokens, generated = padded[0], []
    for t in range(longest - 1 + NEW_TOKENS):
        positions = (t - offsets).clamp(min=0)
        if t < longest:
            tokens = padded[t]
        step = f"{what} step {t} positions {positions.tolist()}"
        ref_logits = ref.step(tokens, positions, cache, table)
        one_tokens, one_logits = one.step(tokens, positions, table)
        tp_tokens, tp_logits = tp.step(tokens, positions, table, order=order)
        assert_close(tp_logits, ref_logits, torch.float32, context=f"{step} vs reference")
        assert_close(tp_logits, one_logits, torch.float32, context=f"{step} vs the single-GPU VM")
        _check_ranks_agree(tp, step)
        top2 = ref_logits.topk(2, dim=-1).values
        for b in range(batch):
            gap = float(top2[b, 0] - top2[b, 1])
            assert int(tp_tokens[b]) == int(ref_logits[b].argmax()) or gap < tol.near_tie_gap, \
                f"{step} sequence {b}: token {int(tp_tokens[b])} vs {int(ref_logits[b].argmax())}, gap {gap:.3g}"
            assert int(tp_tokens[b]) == int(one_tokens[b]) or gap < tol.near_tie_gap, f"{step} sequence {b}"
        assert torch.equal(tp.contexts[-1].bufs.positions.long(), positions + 1), step
        if t >= longest - 1:
            tokens = tp_tokens.long()
            generated.append(tokens.tolist())
    for label, mine, theirs in (("k", tp.k_caches, cache.k), ("v", tp.v_caches, cache.v)):
        joined = torch.cat(mine, dim=3)            # the ranks' kv heads side by side
        written = ~torch.isnan(theirs)
        assert torch.equal(~torch.isnan(joined), written), f"{what}: {label} cache written at other slots"
        assert_close(joined[written], theirs[written], torch.float32, context=f"{what} {label} cache")
    assert len({tok for row in generated for tok in row}) > NEW_TOKENS // 2, f"{what}: degenerate {generated}"


@pytest.mark.parametrize("name,fold,fuse", [("tiny-llama", False, None), ("tiny-qwen3", True, None),
                                            ("tiny-llama", False, False)])
def test_one_rank_is_the_single_gpu_vm_bit_for_bit(name, fold, fuse):
    """World size 1: the partial sum of one rank plus the residual is the O_PROJ / DOWN epilogue's x + y,
    over the same tiles, so logits and tokens equal the single-GPU VM's exactly, step after step."""
    weights = random_weights(TP_CONFIGS[name], seed=31, dtype=torch.float32)
    kw = dict(num_sms=7, kv_splits=2, fold_embed=fold)
    tp = TPVMDecoder(weights, 1, 3, 32, fuse_attn_reduce=fuse, **kw)
    one = VMDecoder(weights, 3, 32, **kw)
    table = contiguous_block_table(3, 32, 16)
    tokens = torch.randint(0, weights.config.vocab_size, (3,), generator=torch.Generator().manual_seed(31))
    positions = torch.zeros(3, dtype=torch.long)
    for t in range(5):
        got, want = tp.step(tokens, positions, table), one.step(tokens, positions, table)
        assert not torch.isnan(got[1]).any(), f"{name} step {t}: logits not written"
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), f"{name} fold={fold} step {t}"
        tokens, positions = want[0].long(), positions + 1


@pytest.mark.parametrize("name,world", [("tiny-llama", 2), ("tiny-qwen3-kv8", 4)])
def test_tp_vm_with_bf16_weights_follows_the_single_gpu_vm(name, world):
    """The kernel's weights and cache dtype: bf16 shards, float32 activations. Greedy steps of the TP VM and
    the single-GPU VM over the same bf16 weights agree to the bf16 tolerance (both round the same k and v
    into their caches, up to the order of sums), with the same tokens (near-tie rule)."""
    config = TP_CONFIGS[name]
    weights = random_weights(config, seed=45, dtype=torch.bfloat16)
    tp = TPVMDecoder(weights, world, 2, 32, num_sms=7, kv_splits=2)
    one = VMDecoder(weights, 2, 32, num_sms=7, kv_splits=2)
    assert tp.contexts[0].weights.o_proj.dtype == torch.bfloat16 and tp.k_caches[0].dtype == torch.bfloat16
    table, tol = contiguous_block_table(2, 32, 16), greedy_tolerance_for(torch.bfloat16)
    tokens, positions = torch.tensor([11, 400]), torch.tensor([0, 0])
    for t in range(6):
        got, want = tp.step(tokens, positions, table, order="reverse"), one.step(tokens, positions, table)
        what = f"{name} W={world} seed=45 bf16 step {t}"
        assert_close(got[1], want[1], torch.bfloat16, context=what)
        _check_ranks_agree(tp, what)
        top2 = want[1].topk(2, dim=-1).values
        for b in range(2):
            assert int(got[0][b]) == int(want[0][b]) or float(top2[b, 0] - top2[b, 1]) < tol.near_tie_gap, what
        tokens, positions = want[0].long(), positions + 1


@pytest.mark.parametrize("name,world", [("tiny-qwen3", 2), ("tiny-qwen3-kv8", 8)])
def test_tp_vm_is_deterministic_across_orders_and_runs(name, world):
    """Two decoders, every interleaving order, several steps: bit-identical logits, tokens and residual
    streams, though the orders really run the instructions (and the ranks) in different sequences."""
    weights = random_weights(TP_CONFIGS[name], seed=41, dtype=torch.float32)
    decoders = {order: TPVMDecoder(weights, world, 2, 32, num_sms=7, kv_splits=2) for order in ORDERS}
    again = TPVMDecoder(weights, world, 2, 32, num_sms=7, kv_splits=2)
    table = contiguous_block_table(2, 32, 16)
    tokens, positions = torch.tensor([5, 77]), torch.tensor([0, 0])
    for t in range(4):
        results = {order: tp.step(tokens, positions, table, order=order) for order, tp in decoders.items()}
        results["again"] = again.step(tokens, positions, table)
        traces = {order: [(r, i) for r, _, i in tp.vm.trace] for order, tp in decoders.items()}
        assert len(set(map(tuple, traces.values()))) == len(ORDERS), f"{name} step {t}: orders ran alike"
        for order, (tok, logits) in results.items():
            assert torch.equal(tok, results["round-robin"][0]) and torch.equal(logits, results["round-robin"][1]), \
                f"{name} W={world} step {t}: {order} differs"
        x = decoders["round-robin"].contexts[0].bufs.x
        assert all(torch.equal(tp.contexts[-1].bufs.x, x) for tp in decoders.values()), f"{name} step {t}: x"
        tokens, positions = results["again"][0].long(), positions + 1


@settings(max_examples=TP_EXAMPLES)
@given(split=st.sampled_from(SPLITS), seed=seeds(), batch=st.integers(1, 4), num_sms=st.sampled_from((1, 7, 132)),
       kv_splits=st.integers(1, 4), block_size=st.sampled_from((4, 8, 16)), order=st.sampled_from(ORDERS),
       policy=st.sampled_from(POLICIES), data=st.data())
def test_tp_vm_step_over_random_caches(split, seed, batch, num_sms, kv_splits, block_size, order, policy, data):
    """One step at drawn positions (1, block edges, the cache limit) over a KV cache of random values: the TP
    logits within float32 tolerance of the reference, every rank's residual stream bit-identical."""
    name, world = split
    config, max_seq_len = TP_CONFIGS[name], 3 * block_size
    lens = data.draw(st.lists(kv_lengths(max_seq_len, block_size), min_size=batch, max_size=batch))
    positions = torch.tensor(lens) - 1
    gen = torch.Generator().manual_seed(seed)
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    tp = TPVMDecoder(weights, world, batch, max_seq_len, block_size=block_size, num_sms=num_sms, policy=policy,
                     kv_splits=kv_splits)
    cache = PagedKVCache.allocate(config, tp.num_blocks, block_size, dtype=torch.float32)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    per_rank = config.num_kv_heads // world
    for r in range(world):
        tp.k_caches[r].copy_(cache.k[:, :, :, r * per_rank:(r + 1) * per_rank])
        tp.v_caches[r].copy_(cache.v[:, :, :, r * per_rank:(r + 1) * per_rank])
    table = _block_table(batch, max_seq_len, block_size, tp.num_blocks, True, gen)
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen)
    what = f"{name} W={world} seed={seed} batch={batch} sms={num_sms} splits={kv_splits} bs={block_size} " \
           f"{order} {policy} positions={positions.tolist()}"
    _, logits = tp.step(tokens, positions, table, order=order)
    assert_close(logits, ReferenceDecoder(weights).step(tokens, positions, cache, table), torch.float32, context=what)
    _check_ranks_agree(tp, what)


def test_reduce_sums_the_partials_in_rank_order():
    """Partials 1e8, 1, -1e8, 0.5 from ranks 0..3 and a residual 0.25: rank order gives ((1e8 + 1) - 1e8) + 0.5
    = 0.5 in float32 (1e8 + 1 rounds to 1e8), then 0.75 with the residual, on every rank; any other order
    of those sums gives 0.25, 1.25 or 1.75."""
    weights = random_weights(TP_CONFIGS["tiny-qwen3-kv8"], seed=51, dtype=torch.float32)
    tp = TPVMDecoder(weights, 4, 2, 16, num_sms=7, kv_splits=1)
    program = tp.program
    tile = _first(program, Opcode.TP_REDUCE, 1, reduce.FFN)
    lo, hi = tile.a0, tile.a0 + tile.a1
    partials = torch.tensor([1e8, 1.0, -1e8, 0.5])
    for ctx in tp.contexts:
        ctx.bufs.recv_down[1] = partials[:, None, None]
        ctx.bufs.h[1] = 0.25
        reduce.reference(tile, ctx)
        out = ctx.bufs.x[2, :, lo:hi]
        assert torch.equal(out, torch.full_like(out, 0.75)), f"rank {ctx.layout.rank}: {out.unique().tolist()}"
        assert torch.isnan(ctx.bufs.x[2, :, hi:]).all(), f"rank {ctx.layout.rank}: wrote past row {hi}"


@pytest.mark.parametrize("order", ORDERS)
def test_tied_maxima_across_ranks_and_tiles_go_to_the_lowest_id(order):
    """Identical LM head rows at the same offset of same-sized tiles give bit-equal logits: rows 5 and 165 of
    rank 0 (tiles 0 and 2) and row 517 (rank 1, tile 0) tie for the largest logit: every rank picks 5; with
    row 5 back as it was, 165 (on rank 0) over 517 (on rank 1), whichever rank runs first."""
    config = TP_CONFIGS["tiny-qwen3"]
    weights = random_weights(config, seed=61, dtype=torch.float32)
    tp = TPVMDecoder(weights, 2, 2, 16, num_sms=7, kv_splits=1)
    assert tp.program.lm_tiles == 7 and tp.program.instructions[-2].a1 == 32, "tiles of 80 rows expected"
    table, tokens, positions = contiguous_block_table(2, 16, 16), torch.tensor([3, 300]), torch.tensor([0, 0])
    tp.step(tokens, positions, table)
    xn = torch.nn.functional.rms_norm(tp.contexts[0].bufs.x[-1], (config.hidden_size,), weights.final_norm,
                                      config.rms_norm_eps)
    row = 4 * (xn / xn.norm(dim=1, keepdim=True)).sum(0)
    assert bool((xn @ row > 3.0).all()), "the tied row does not stand out"
    for ties, want in (((5, 165, 517), 5), ((165, 517), 165)):
        lm_head = weights.lm_head.clone()
        lm_head[list(ties)] = row
        tied = TPVMDecoder(dataclasses.replace(weights, lm_head=lm_head), 2, 2, 16, num_sms=7, kv_splits=1)
        out, logits = tied.step(tokens, positions, table, order=order)
        assert (logits[:, list(ties)] == logits[:, ties[:1]]).all(), f"{ties}: not bit-equal {logits[:, list(ties)]}"
        picked = [c.bufs.out_tokens.tolist() for c in tied.contexts]
        assert out.tolist() == [want, want] and picked == [[want, want]] * 2, f"{order} ties {ties}: {picked}"


# ---- a dropped exchange signal hangs: the VM says where --------------------------------------------------

DROPS = [(Opcode.TP_O_PROJ, 1, "layer 1 attention exchange", Opcode.TP_REDUCE),
         (Opcode.TP_DOWN, 0, "layer 0 FFN exchange", Opcode.TP_REDUCE),
         (Opcode.TP_LM_HEAD, 0, "LM head exchange", Opcode.ARGMAX)]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("op,layer,counter,consumer", DROPS, ids=[f"{d[0].name}-L{d[1]}" for d in DROPS])
def test_a_dropped_exchange_signal_deadlocks_naming_rank_and_instruction(op, layer, counter, consumer, world):
    """The last rank's first tile of an exchange stage loses its signal in its serialized table: the consumers
    on every rank wait one signal short, and the VM (and the data-free simulation) raise ScheduleError naming
    each stuck rank, SM, instruction and counter, instead of hanging."""
    weights = random_weights(TP_CONFIGS["tiny-llama-kv4"], seed=71, dtype=torch.float32)
    tp = TPVMDecoder(weights, world, 2, 16, num_sms=7, kv_splits=1)
    program, victim = tp.program, world - 1
    dropped = _first(program, op, layer)
    table, lengths = (t.clone() for t in tp.tables[victim])
    hits = 0
    for sm in range(table.shape[0]):
        for slot in range(int(lengths[sm])):
            if Instruction.decode(table[sm, slot].tolist()).index == dropped.index:
                table[sm, slot, W_SIGNAL_ID] = NO_COUNTER
                hits += 1
    assert hits == 1, f"#{dropped.index} found {hits} times in rank {victim}'s table"
    tables = list(tp.tables)
    tables[victim] = (table, lengths)
    waiting = {i.index for i in program.instructions if i.opcode == consumer and i.wait_id == dropped.signal_id}
    target = next(i.wait_count for i in program.instructions if i.index in waiting)
    vm = TPInstructionVM(tp.contexts, tables, program.num_counters)
    for ctx in tp.contexts:
        ctx.bufs.tokens.copy_(torch.tensor([1, 2]))
        ctx.bufs.block_table.copy_(contiguous_block_table(2, 16, 16))
    with pytest.raises(ScheduleError) as err:
        vm.step("reverse")
    message = str(err.value)
    for rank in range(world):
        stuck = re.findall(rf"rank {rank} SM \d+: #(\d+) {consumer.name} layer \d+ waits counter {dropped.signal_id} "
                           rf"\({counter}\) for {target}, has {target - 1}", message)
        assert stuck and set(map(int, stuck)) <= waiting, f"W={world} rank {rank} not named stuck: {message}"
    with pytest.raises(ScheduleError, match=rf"rank {victim} SM \d+: #\d+ {consumer.name}"):
        simulate_ranks([deserialize(t, n) for t, n in tables], program.num_counters, program.layout.config.num_layers)


def test_reversed_queues_on_one_rank_deadlock_naming_that_rank():
    weights = random_weights(TP_CONFIGS["tiny-llama"], seed=81, dtype=torch.float32)
    tp = TPVMDecoder(weights, 2, 1, 16, num_sms=5)
    tp.vm.queues[1] = [list(reversed(q)) for q in tp.vm.queues[1]]
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 1 SM \d+: #\d+ "):
        tp.step(torch.tensor([4]), torch.tensor([0]), contiguous_block_table(1, 16, 16))
