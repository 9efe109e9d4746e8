"""The instruction VM (the serialized per-SM queues run with each stage's torch reference) against the float32
ReferenceDecoder: same weights, same paged cache geometry, several steps of a batch whose sequences sit at
different positions. Float32 weights and caches on both sides, so only op order differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.instructions.context import matvec, rms_normalize
from megakernel.model.config import RopeScaling
from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.weights import random_weights
from megakernel.schedule import ScheduleError
from megakernel.schedule.vm import VMDecoder
from megakernel.testing.tolerances import assert_close, greedy_tolerance_for

PROMPT_LENS = (11, 1, 6)     # sequences at different positions (and one that starts at position 0)
NEW_TOKENS = 8

# (preset, policy, interleaving order, num_sms, kv_splits, block_size, shuffled block table)
VM_CASES = [
    ("tiny-llama", "balanced", "round-robin", 132, None, 16, False),
    ("tiny-llama", "balanced", "reverse", 7, 3, 6, True),
    ("tiny-llama", "round-robin", "round-robin", 7, 1, 6, True),
    ("tiny-llama", "round-robin", "reverse", 132, None, 16, True),
    ("tiny-qwen3", "balanced", "round-robin", 7, 2, 6, True),
    ("tiny-qwen3", "balanced", "reverse", 132, None, 16, True),
    ("tiny-qwen3", "round-robin", "round-robin", 132, None, 16, False),
    ("tiny-qwen3", "round-robin", "reverse", 7, 5, 1, True),
]


# tiny torch ops on the CPU: one intra-op thread (the plugin's fixture)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _ids(case) -> str:
    preset, policy, order, sms, splits, bs, shuffled = case
    return f"{preset}-{policy}-{order}-sms{sms}-splits{splits or 'auto'}-bs{bs}" + ("-shuffled" if shuffled else "")


def _block_table(batch: int, max_seq_len: int, block_size: int, num_blocks: int, shuffled: bool,
                 gen: torch.Generator) -> torch.Tensor:
    if not shuffled:
        return contiguous_block_table(batch, max_seq_len, block_size)
    per_seq = -(-max_seq_len // block_size)
    # every sequence gets a random, interleaved subset of a pool with spare blocks
    return torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)


@pytest.mark.parametrize("case", VM_CASES, ids=[_ids(c) for c in VM_CASES])
def test_vm_decoder_equals_reference_decoder(case):
    preset, policy, order, num_sms, kv_splits, block_size, shuffled = case
    _check_vm_against_reference(get_preset(preset), policy, order, num_sms, kv_splits, block_size, shuffled,
                                seed=100 + VM_CASES.index(case), label=_ids(case))


# Axes real checkpoints vary, each away from the presets' values: an RMSNorm eps large enough to matter,
# other RoPE bases and scalings (bands inside this test's 18 positions), tied and untied embeddings, a
# vocabulary that is a multiple of 8 but of no tile size
MODEL_AXES = [
    dict(rms_norm_eps=1e-2, tie_word_embeddings=True, vocab_size=1000),
    dict(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8), vocab_size=1016),
    dict(rope_theta=1e6, rope_scaling=RopeScaling("linear", 2.0), tie_word_embeddings=False, rms_norm_eps=1e-6),
]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("axes", MODEL_AXES, ids=[",".join(f"{k}={v}" for k, v in a.items()) for a in MODEL_AXES])
def test_vm_equals_reference_across_model_axes(preset, axes):
    config = dataclasses.replace(get_preset(preset), **axes)
    _check_vm_against_reference(config, "balanced", "round-robin", 7, 2, 16, True, seed=300,
                                label=f"{preset} {axes}")


# Batch buckets past SPLIT_BATCH (the matvecs split over K: split_k.py); sequences of
# different lengths, 1 to 11 tokens of prompt
@pytest.mark.parametrize("batch", [16, 64])
def test_vm_equals_reference_at_large_batch_buckets(batch):
    lens = tuple(1 + (7 * b) % 11 for b in range(batch))
    _check_vm_against_reference(get_preset("tiny-llama"), "balanced", "round-robin", 132, None, 16, True,
                                seed=400 + batch, label=f"tiny-llama batch {batch}", prompt_lens=lens)


# A shape whose four layer matvecs all split over K past the megakernel's batch (instructions/split_k.py: QKV and
# O_PROJ into 4 ranges, GATE_UP 2, DOWN 8 on 132 SMs), the sequences' partials summed by MV_REDUCE (QKV's by the
# attention)
WIDE = dict(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=2, head_dim=128)


@pytest.mark.parametrize("preset,order", [("tiny-llama", "round-robin"), ("tiny-qwen3", "reverse")])
def test_vm_with_every_layer_matvec_split_over_k_equals_reference(preset, order):
    from megakernel.instructions.layout import StepLayout
    from megakernel.instructions.split_k import SPLIT_STAGES, k_splits

    config = dataclasses.replace(get_preset(preset), **WIDE)
    lens = tuple(1 + (5 * b) % 9 for b in range(16))
    layout = StepLayout(config=config, batch=16, kv_splits=1, block_size=16, max_blocks_per_seq=2, num_sms=132)
    splits = {op.name: k_splits(layout, op) for op in SPLIT_STAGES}
    assert min(splits.values()) > 1, f"the wide shape at batch 16 no longer splits every stage: {splits}"
    _check_vm_against_reference(config, "balanced", order, 132, None, 16, True, seed=77,
                                label=f"wide {preset} batch 16 split {splits}", prompt_lens=lens)


def _check_vm_against_reference(config, policy, order, num_sms, kv_splits, block_size, shuffled, seed, label,
                                prompt_lens=PROMPT_LENS):
    """Prompts of `prompt_lens` tokens fed through the VM and the float32 reference decoder, then NEW_TOKENS
    greedy steps: logits within float32 tolerance every step, the same tokens (near-tie rule), the same KV cache
    slots written with the same values, ARGMAX advancing the step inputs in place."""
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    batch = len(prompt_lens)
    last_position = max(prompt_lens) - 1 + NEW_TOKENS - 1
    max_seq_len = last_position + 1
    per_seq = -(-max_seq_len // block_size)
    num_blocks = batch * per_seq + (5 if shuffled else 0)

    vm = VMDecoder(weights, batch, max_seq_len, block_size=block_size, num_sms=num_sms, policy=policy,
                   kv_splits=kv_splits, num_blocks=num_blocks)
    table = _block_table(batch, max_seq_len, block_size, num_blocks, shuffled, gen)
    assert tuple(table.shape) == (batch, vm.layout.max_blocks_per_seq)
    ref = ReferenceDecoder(weights)
    cache = PagedKVCache.allocate(config, num_blocks, block_size, dtype=torch.float32)
    tol = greedy_tolerance_for(torch.float32)

    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    longest = max(prompt_lens)
    # right-aligned prompts: a shorter sequence repeats its first token at position 0 until its prompt starts
    padded = torch.tensor([[p[0]] * (longest - len(p)) + p for p in prompts]).T          # [longest, B]
    offsets = torch.tensor([longest - n for n in prompt_lens])
    what = (f"{label} seed={seed} batch={batch} prompt_lens={prompt_lens} V={config.vocab_size} "
            f"splits={vm.layout.kv_splits} float32")
    generated = []
    tokens = padded[0]
    for t in range(longest - 1 + NEW_TOKENS):
        positions = (t - offsets).clamp(min=0)
        if t < longest:
            tokens = padded[t]
        ref_logits = ref.step(tokens, positions, cache, table)
        vm_tokens, vm_logits = vm.step(tokens, positions, table, order=order)
        step = f"{what} step {t} positions {positions.tolist()}"
        assert_close(vm_logits, ref_logits, torch.float32, context=step)
        expected = ref_logits.argmax(-1)
        gaps = ref_logits.topk(2, dim=-1).values
        gaps = (gaps[:, 0] - gaps[:, 1]).tolist()
        for b in range(batch):
            assert int(vm_tokens[b]) == int(expected[b]) or gaps[b] < tol.near_tie_gap, \
                f"{step} sequence {b}: token {int(vm_tokens[b])} vs {int(expected[b])}, top-2 gap {gaps[b]:.3g}"
        # ARGMAX advances the step inputs in place, ready for the next launch
        assert torch.equal(vm.ctx.bufs.tokens, vm_tokens) and torch.equal(
            vm.ctx.bufs.positions.long(), positions + 1), step
        if t >= longest - 1:
            tokens = vm_tokens.long()
            generated.append(tokens.tolist())
    assert int((last_position - offsets).max()) == last_position
    if block_size == 6:   # the cache is exactly full: the last step decoded at the cache limit - 1
        assert vm.layout.max_seq_len == last_position + 1, what
    # same KV cache contents, same slots written (the rest still NaN)
    for name, mine, theirs in (("k", vm.ctx.k_cache, cache.k), ("v", vm.ctx.v_cache, cache.v)):
        written = ~torch.isnan(theirs)
        assert torch.equal(~torch.isnan(mine), written), f"{what}: {name} cache written at other slots"
        assert_close(mine[written], theirs[written], torch.float32, context=f"{what} {name} cache")
    distinct = len({tok for row in generated for tok in row})
    assert distinct > NEW_TOKENS // 2, f"{what}: degenerate generation {generated}"


def test_vm_orders_really_interleave_differently():
    weights = random_weights(get_preset("tiny-llama"), seed=5, dtype=torch.float32)
    table = contiguous_block_table(2, 16, 16)
    traces = {}
    outputs = {}
    for order in ("round-robin", "reverse"):
        vm = VMDecoder(weights, 2, 16, num_sms=7)
        out, logits = vm.step(torch.tensor([3, 9]), torch.tensor([0, 0]), table, order=order)
        traces[order] = [index for _, index in vm.vm.trace]
        outputs[order] = (out, logits)
    assert sorted(traces["reverse"]) == sorted(traces["round-robin"])
    assert traces["reverse"] != traces["round-robin"], "tiny-llama seed=5 batch=2 sms=7: same execution order"
    assert torch.equal(outputs["reverse"][0], outputs["round-robin"][0])
    assert_close(outputs["reverse"][1], outputs["round-robin"][1], torch.float32, context="tiny-llama seed=5")


@pytest.mark.parametrize("position", [16, 17, 1000])
def test_positions_past_the_cache_raise(position):
    weights = random_weights(get_preset("tiny-qwen3"), seed=6, dtype=torch.float32)
    vm = VMDecoder(weights, 2, 16, block_size=8, num_sms=4)
    assert vm.layout.max_seq_len == 16
    table = contiguous_block_table(2, 16, 8)
    with pytest.raises(ValueError, match=f"position {position} is past the KV cache"):
        vm.step(torch.tensor([1, 2]), torch.tensor([0, position]), table)


@pytest.mark.parametrize("tokens,positions", [([1, 2], [-1, 0]), ([-3, 2], [0, 0]), ([1024, 2], [0, 0])],
                         ids=["negative-position", "negative-token", "token-past-vocab"])
def test_bad_inputs_raise_value_error(tokens, positions):
    weights = random_weights(get_preset("tiny-llama"), seed=7, dtype=torch.float32)
    vm = VMDecoder(weights, 2, 32, num_sms=4)
    with pytest.raises(ValueError):
        vm.step(torch.tensor(tokens), torch.tensor(positions), contiguous_block_table(2, 32, 16))


def _aliasing_tables():
    good = contiguous_block_table(2, 32, 8)                 # [[0..3], [4..7]]
    zero = torch.zeros_like(good)                            # every position of both sequences in block 0
    shared_tail = good.clone()
    shared_tail[1, 1] = good[0, 1]                           # sequence 1 appends into a block sequence 0 reads
    repeat = good.clone()
    repeat[0, 2] = good[0, 0]                                # sequence 0's position 16 lands on its position 0
    return [("zero", zero, [20, 9]), ("shared-current-block", shared_tail, [12, 9]),
            ("repeated-block", repeat, [16, 3])]


@pytest.mark.parametrize("name,table,positions", _aliasing_tables(), ids=lambda v: v if isinstance(v, str) else "")
def test_block_tables_whose_append_aliases_a_read_slot_raise(name, table, positions):
    weights = random_weights(get_preset("tiny-llama"), seed=8, dtype=torch.float32)
    vm = VMDecoder(weights, 2, 32, block_size=8, num_sms=4)
    vm.ctx.bufs.logits.fill_(7.0)
    with pytest.raises(ValueError, match="slot"):
        vm.step(torch.tensor([1, 2]), torch.tensor(positions), table)
    assert bool((vm.ctx.bufs.logits == 7.0).all()), f"{name}: the step ran before the table was refused"


def test_appends_into_the_scratch_block_are_exempt_from_the_aliasing_rule():
    """vLLM's padded rows: position 0 and an all-zero table row, so they all append to slot 0 of block 0, which no
    sequence reads. Named as the layout's scratch block, those appends pass; without it they are refused; and a real
    sequence's append onto a slot it reads is refused either way (aliased_appends names it, and only it)."""
    from megakernel.instructions.layout import aliased_appends, check_block_aliasing

    table = contiguous_block_table(4, 32, 8) + 1             # blocks 1..16: block 0 is nobody's
    table[2:] = 0                                            # rows 2 and 3 are padding
    pos = torch.tensor([11, 30, 0, 0])
    assert aliased_appends(table, pos, 8, scratch_block=0) == {}
    check_block_aliasing(table, pos, 8, scratch_block=0)
    assert set(aliased_appends(table, pos, 8)) == {2, 3}
    with pytest.raises(ValueError, match="both append their token to KV slot 0 of block 0"):
        check_block_aliasing(table, pos, 8)
    table[0, 1] = table[0, 0]                                # sequence 0's position 11 lands on its position 3
    assert set(aliased_appends(table, pos, 8, scratch_block=0)) == {0}
    with pytest.raises(ValueError, match="sequence 0 appends to at position 11"):
        check_block_aliasing(table, pos, 8, scratch_block=0)


def test_a_layout_refuses_a_negative_scratch_block():
    from megakernel.instructions.layout import StepLayout

    layout = StepLayout(config=get_preset("tiny-llama"), batch=1, kv_splits=1, block_size=16, max_blocks_per_seq=2,
                        num_sms=4, scratch_block=-2)
    with pytest.raises(ValueError, match="scratch_block=-2"):
        layout.validate()


def test_prefix_shared_full_blocks_are_accepted():
    """Two sequences may share full blocks they only read (prefix sharing); each appends in its own block."""
    weights = random_weights(get_preset("tiny-llama"), seed=9, dtype=torch.float32)
    vm = VMDecoder(weights, 2, 32, block_size=8, num_sms=4)
    table = contiguous_block_table(2, 32, 8)
    table[1, :2] = table[0, :2]
    vm.ctx.k_cache.normal_(); vm.ctx.v_cache.normal_()
    tokens, logits = vm.step(torch.tensor([1, 2]), torch.tensor([17, 20]), table)
    assert torch.isfinite(logits).all() and tokens.shape == (2,)


def test_vm_raises_on_a_deadlocking_queue_instead_of_hanging():
    weights = random_weights(get_preset("tiny-llama"), seed=8, dtype=torch.float32)
    vm = VMDecoder(weights, 1, 16, num_sms=5)
    vm.vm.queues = [list(reversed(q)) for q in vm.vm.queues]
    with pytest.raises(ScheduleError, match="deadlock"):
        vm.step(torch.tensor([4]), torch.tensor([0]), contiguous_block_table(1, 16, 16))


# ---- the step without the LM head (VMDecoder(lm_head=False)) ----------------------------------------------

BARE_CASES = [("tiny-llama", "balanced", "reverse", 7, 3, 6),
              ("tiny-qwen3", "round-robin", "round-robin", 132, None, 16)]


@pytest.mark.parametrize("case", BARE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-sms{c[3]}-bs{c[5]}")
def test_vm_without_lm_head_ends_at_the_same_x_L(case):
    """Same weights, inputs and paged cache: the VM without LM head leaves x[L] bit-equal to the one the
    full step computes (the same instructions up to the last DOWN), the final norm and LM head applied to
    it give the reference decoder's logits, it writes the same KV cache, and it leaves tokens, positions,
    out_tokens and logits alone (no ARGMAX advances them)."""
    preset, policy, order, num_sms, kv_splits, block_size = case
    seed = 300 + BARE_CASES.index(case)
    config = get_preset(preset)
    weights = random_weights(config, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    batch, steps = 3, 9
    offsets = torch.tensor([0, 2, 5])             # sequences start at different steps, so positions differ
    max_seq_len = steps
    num_blocks = batch * -(-max_seq_len // block_size) + 3
    kw = dict(block_size=block_size, num_sms=num_sms, policy=policy, kv_splits=kv_splits, num_blocks=num_blocks)
    full = VMDecoder(weights, batch, max_seq_len, **kw)
    bare = VMDecoder(weights, batch, max_seq_len, lm_head=False, **kw)
    assert bare.program.lm_tiles == 0 and bare.ctx.bufs.logits.numel() == 0
    table = _block_table(batch, max_seq_len, block_size, num_blocks, True, gen)
    ref = ReferenceDecoder(weights)
    cache = PagedKVCache.allocate(config, num_blocks, block_size, dtype=torch.float32)
    what = f"{preset} seed={seed} batch={batch} splits={bare.layout.kv_splits} sms={num_sms} bs={block_size} {order}"
    for t in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen)     # teacher-forced, fresh each step
        positions = (t - offsets).clamp(min=0)
        step = f"{what} step {t} positions {positions.tolist()}"
        x_full = full.step_hidden(tokens, positions, table, order=order)
        x_bare = bare.step_hidden(tokens, positions, table, order=order)
        assert x_bare.shape == (batch, config.hidden_size) and not torch.isnan(x_bare).any(), step
        assert torch.equal(x_bare, x_full), f"{step}: max |diff| {(x_bare - x_full).abs().max():.3g}"
        ref_logits = ref.step(tokens, positions, cache, table)
        logits = matvec(weights.lm_head, rms_normalize(x_bare, weights.final_norm, config.rms_norm_eps))
        assert_close(logits, ref_logits, torch.float32, context=f"{step}: LM head of x[L] vs reference logits")
        b = bare.ctx.bufs
        assert torch.equal(b.tokens.long(), tokens) and torch.equal(b.positions.long(), positions), \
            f"{step}: tokens/positions changed without an LM head: {b.tokens.tolist()} {b.positions.tolist()}"
        assert torch.equal(b.out_tokens, torch.full((batch,), -1, dtype=torch.int32)), f"{step}: out_tokens written"
        # the full step's ARGMAX did advance its own copy
        assert torch.equal(full.ctx.bufs.positions.long(), positions + 1), step
    for name in ("k_cache", "v_cache"):
        mine, theirs = getattr(bare.ctx, name), getattr(full.ctx, name)
        written = ~torch.isnan(theirs)
        assert written.any() and torch.equal(~torch.isnan(mine), written), f"{what}: {name} written at other slots"
        assert torch.equal(mine[written], theirs[written]), f"{what}: {name} differs"
    with pytest.raises(RuntimeError, match="lm_head=False"):
        bare.step(tokens, positions, table)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("order", ["round-robin", "reverse"])
def test_vm_with_the_embedding_folded_into_layer_0_gives_the_same_steps(name, order):
    """fold_embed: layer 0's QKV tiles read embed[token] themselves and wait on nothing. Same arithmetic
    on the same float32 values as reading x[0], so the logits equal the unfolded program's bit for bit,
    step after step, with the VM checking every counter before each instruction."""
    weights = random_weights(get_preset(name), seed=12, dtype=torch.float32)
    plain = VMDecoder(weights, 3, 32, num_sms=7, kv_splits=2)
    folded = VMDecoder(weights, 3, 32, num_sms=7, kv_splits=2, fold_embed=True)
    assert folded.layout.embed_folded and not plain.layout.embed_folded
    table = contiguous_block_table(3, 32, 16)
    gen = torch.Generator().manual_seed(12)
    tokens = torch.randint(0, weights.config.vocab_size, (3,), generator=gen)
    positions = torch.zeros(3, dtype=torch.long)
    for t in range(5):
        got = folded.step(tokens, positions, table, order=order)
        want = plain.step(tokens, positions, table, order=order)
        assert not torch.isnan(got[1]).any(), f"{name} step {t}: logits not written"
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), f"{name} {order} step {t}"
        tokens, positions = want[0].long(), positions + 1


def test_argmax_slots_tie_to_the_lowest_row():
    """Equal maxima in two argmax slots: the token is the lower row, even when the lower slot holds the
    higher row (the rule is on rows, not on slots)."""
    from megakernel.instructions import argmax
    from megakernel.instructions.record import Instruction
    from megakernel.instructions.opcodes import Opcode

    class Bufs:
        lm_max = torch.tensor([[2.0, 2.0, 1.0], [0.5, 3.0, 3.0]])
        lm_idx = torch.tensor([[900, 120, 5], [1, 700, 300]], dtype=torch.int32)
        out_tokens = torch.full((2,), -1, dtype=torch.int32)
        tokens = torch.zeros(2, dtype=torch.int32)
        positions = torch.zeros(2, dtype=torch.int32)

    class Ctx:
        bufs = Bufs()

    argmax.reference(Instruction(index=0, opcode=Opcode.ARGMAX, a0=3), Ctx())
    assert Ctx.bufs.out_tokens.tolist() == [120, 300] and Ctx.bufs.positions.tolist() == [1, 1]
