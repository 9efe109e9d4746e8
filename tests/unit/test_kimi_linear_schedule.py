"""Kimi Linear decode schedule: the instruction DAG (KDA over a per-sequence recurrent state, NoPE MLA over
the latent cache, dense / MoE MLPs) run by the instruction VM from the serialized per-SM queues, against
the float32 KimiLinearReferenceDecoder; each stage block against the decoder's own computation; race- and
deadlock-freedom for every preset, batch 1-8 and both policies."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from megakernel.instructions import STAGE_MODULES, Opcode
from megakernel.instructions.kimi_linear.common import kda_offsets, kda_proj_rows
from megakernel.instructions.layout import MAX_BATCH
from megakernel.instructions.record import serialize
from megakernel.model.deepseek.reference import contiguous_block_table
from megakernel.model.kimi_linear import (
    PRESETS,
    KimiLinearCache,
    KimiLinearReferenceDecoder,
    get_preset,
    random_weights,
)
from megakernel.model.ops import rms_norm
from megakernel.schedule import POLICIES, assign, simulate
from megakernel.schedule.kimi_linear import (
    KimiLinearStageContext,
    KimiLinearStepLayout,
    KimiLinearVMDecoder,
    LayerRows,
    allocate_buffers,
    build_program,
    check_program,
    find_races,
    pack_weights,
)
from megakernel.testing.tolerances import assert_close, tolerance_for

TINY = ("tiny-kimi-linear", "tiny-kimi-linear-qlora")
NUM_SMS = 16  # a small machine: several tiles per stage, and a VM step stays fast

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

_WEIGHTS: dict = {}


def _weights(name: str, seed: int = 0):
    """bf16 random weights of a preset (cached: drawing them is the slow part)."""
    key = (name, seed)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = random_weights(get_preset(name), seed=seed, dtype=torch.bfloat16)
    return _WEIGHTS[key]


def _assert_same_greedy(got: torch.Tensor, want_logits: torch.Tensor, context: str) -> None:
    """Greedy picks equal the reference's, unless the reference's own top-2 gap is within float32 noise."""
    want = want_logits.argmax(dim=-1)
    atol = tolerance_for(torch.float32).atol
    for b in range(want.shape[0]):
        if int(got[b]) != int(want[b]):
            top2 = want_logits[b].topk(2).values
            assert float(top2[0] - top2[1]) < 10 * atol, (
                f"{context} seq {b}: token {int(got[b])} != reference {int(want[b])} (top-2 gap "
                f"{float(top2[0] - top2[1]):.3g})")


# ---- VM == reference decoder ------------------------------------------------------------------------

# Odd tile sizes: tails in every row-tiled stage, tiles that stop inside a head / an expert / a KDA part.
ODD_TILES = {Opcode.KDA_PROJ: 24, Opcode.KDA_OUT_NORM: 40, Opcode.MLA_QKV_A: 24, Opcode.MLA_Q_B: 40,
             Opcode.MLA_ABSORB: 24, Opcode.MLA_REDUCE: 8, Opcode.MLA_O_PROJ: 56, Opcode.GATE_UP: 48,
             Opcode.DOWN: 40, Opcode.ROUTER: 8, Opcode.SHARED_GATE_UP: 48, Opcode.SHARED_DOWN: 72,
             Opcode.EXPERT_GATE_UP: 16, Opcode.EXPERT_DOWN: 40, Opcode.MOE_COMBINE: 104, Opcode.LM_HEAD: 72}

# (preset, restart step per sequence, block size, kv_splits, head_group, kda_head_group, policy, tiles,
#  state slots (None: 0..B-1), seed). Sequence b decodes from position 0 at step 0 and starts a new
# sequence (position 0 again, its slot holding the old one's state) at step restart[b] (0: never).
VM_CASES = [
    ("tiny-kimi-linear", [0], 16, None, None, None, "balanced", None, None, 0),
    ("tiny-kimi-linear", [0, 2, 4], 4, 3, 2, 2, "round-robin", ODD_TILES, [4, 0, 2], 1),
    ("tiny-kimi-linear-qlora", [0, 1, 2, 3, 4, 5, 2, 3], 4, 2, 3, 1, "balanced", None, None, 2),
    ("tiny-kimi-linear-qlora", [3, 0, 1], 8, 4, 1, 2, "round-robin", ODD_TILES, [1, 2, 0], 3),
]
NUM_STEPS = 6


def _compare_steps(weights, restart: list[int], num_steps: int, slots: list[int] | None, seed: int, label: str,
                   **vm_kwargs) -> None:
    """Greedy steps of the VM and the reference decoder side by side. Sequence b decodes from position 0 at
    step 0 and starts a new sequence (position 0 again, over its slot's stale state and its old latent rows)
    at step restart[b] (0: never): logits within float32 tolerance, the same tokens, the same KDA
    recurrent / conv states and latent rows."""
    cfg = weights.config
    B = len(restart)
    gen = torch.Generator().manual_seed(seed)
    num_slots = B if slots is None else max(slots) + 1
    slot_t = torch.arange(B) if slots is None else torch.tensor(slots)
    vm = KimiLinearVMDecoder(weights, B, num_steps + 1, num_state_slots=num_slots, **vm_kwargs)
    ref = KimiLinearReferenceDecoder(weights)
    bs = vm.layout.block_size
    table = contiguous_block_table(B, vm.layout.max_seq_len, bs)
    cache = KimiLinearCache.allocate(cfg, num_slots, table.numel(), bs)
    tokens = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
    positions = torch.zeros(B, dtype=torch.long)
    for step in range(num_steps):
        restarting = torch.tensor([r == step for r in restart]) if step else torch.zeros(B, dtype=torch.bool)
        positions = torch.where(restarting, 0, positions)
        tokens = torch.where(restarting, torch.randint(0, cfg.vocab_size, (B,), generator=gen), tokens)
        ctx = (f"{label} B={B} restart={restart} bs={bs} splits={vm.layout.kv_splits} group={vm.layout.head_group} "
               f"kda_group={vm.layout.kda_head_group} slots={slots} seed={seed} step={step} "
               f"positions={positions.tolist()}")
        want = ref.step(tokens, positions, cache, table, slots=slot_t)
        got_tokens, got = vm.step(tokens, positions, table, slots=slot_t)
        assert_close(got, want, torch.float32, context=ctx)
        assert torch.equal(got_tokens, got.argmax(-1).to(torch.int32)), f"{ctx}: ARGMAX != argmax(logits)"
        _assert_same_greedy(got_tokens, want, ctx)
        assert torch.equal(vm.bufs.positions, (positions + 1).to(torch.int32)), f"{ctx}: positions not advanced"
        used = slot_t.long()
        assert_close(vm.cache.kda.recurrent[:, used], cache.kda.recurrent[:, used], torch.float32,
                     context=f"{ctx}: recurrent state")
        assert_close(vm.cache.kda.conv[:, used], cache.kda.conv[:, used], torch.float32, context=f"{ctx}: conv state")
        written = ~torch.isnan(cache.latent.latent)
        assert torch.equal(written, ~torch.isnan(vm.cache.latent.latent)), f"{ctx}: latent rows written differ"
        assert_close(vm.cache.latent.latent[written], cache.latent.latent[written], torch.float32, context=ctx)
        tokens, positions = want.argmax(-1), positions + 1


@pytest.mark.parametrize("name,restart,block_size,kv_splits,head_group,kda_group,policy,tiles,slots,seed",
                         VM_CASES)
def test_vm_matches_reference_decoder(name, restart, block_size, kv_splits, head_group, kda_group, policy, tiles,
                                      slots, seed):
    """Batch 1, 3 and 8 at different positions (restarts at position 0 included), permuted state slots,
    odd tiles, both policies."""
    label = f"{name} policy={policy} odd_tiles={tiles is not None}"
    _compare_steps(_weights(name), restart, NUM_STEPS, slots, seed, label, block_size=block_size,
                   num_sms=NUM_SMS, policy=policy, kv_splits=kv_splits, head_group=head_group,
                   kda_head_group=kda_group, tile_rows_override=tiles)


@pytest.mark.parametrize("batch", [2, 4, 5, 6, 7])
def test_vm_matches_reference_decoder_at_the_other_batch_sizes(batch):
    """Batch 2 and 4-7 (1, 3 and 8 are above): three steps, one sequence restarting at step 2."""
    name = "tiny-kimi-linear" if batch % 2 else "tiny-kimi-linear-qlora"
    restart = [2 if b == batch - 1 else 0 for b in range(batch)]
    _compare_steps(_weights(name), restart, 3, None, 10 + batch, f"{name} batch={batch}", block_size=4,
                   num_sms=NUM_SMS)


def test_vm_matches_reference_decoder_on_real_attention_shapes():
    """The 4-layer Kimi-Linear-48B slice with its real KDA (32 heads of 128, kernel 4) and MLA (32 heads,
    c = 512, r = 64, no q LoRA) shapes and hidden size, the MLPs, experts and vocabulary shrunk so that its
    weights fit a CPU test: three steps at batch 2, one sequence restarting."""
    cfg = dataclasses.replace(get_preset("kimi-linear-slice"), vocab_size=1024, n_routed_experts=16,
                              moe_intermediate_size=64, intermediate_size=512, name="kimi-linear-slice-small-mlp")
    weights = random_weights(cfg, seed=0, dtype=torch.bfloat16)
    _compare_steps(weights, [0, 2], 3, None, 0, cfg.name, block_size=16, num_sms=32)


def test_vm_generation_matches_reference_generate():
    """Prompts fed from position 0 through the VM, then greedy picks: KimiLinearReferenceDecoder.generate's
    tokens."""
    weights = _weights("tiny-kimi-linear", seed=1)
    prompts = [[5, 9, 100, 3], [300, 2, 31, 64]]
    new_tokens = 4
    want = KimiLinearReferenceDecoder(weights).generate(prompts, new_tokens, block_size=4)
    B, n = len(prompts), len(prompts[0])
    vm = KimiLinearVMDecoder(weights, B, n + new_tokens, block_size=4, num_sms=NUM_SMS)
    table = contiguous_block_table(B, vm.layout.max_seq_len, 4)
    generated: list[list[int]] = [[] for _ in range(B)]
    tokens = torch.tensor([p[0] for p in prompts])
    for t in range(n + new_tokens - 1):
        out, _ = vm.step(tokens, torch.full((B,), t), table)
        if t >= n - 1:
            for b in range(B):
                generated[b].append(int(out[b]))
        tokens = torch.tensor([p[t + 1] for p in prompts]) if t + 1 < n else out.long()
    assert generated == want.tokens, f"tiny-kimi-linear seed=1: {generated} != {want.tokens}"


def test_vm_is_deterministic_across_policies_and_orders():
    """Every element has one writer: bitwise-equal logits and states whatever the SM assignment and the
    interleaving of the SMs."""
    weights = _weights("tiny-kimi-linear-qlora")
    B, bs = 3, 4
    gen = torch.Generator().manual_seed(7)
    table = contiguous_block_table(B, 8, bs)
    steps = [(torch.randint(0, weights.config.vocab_size, (B,), generator=gen), torch.full((B,), t))
             for t in range(2)]
    results = {}
    for policy in POLICIES:
        vm = KimiLinearVMDecoder(weights, B, 8, block_size=bs, num_sms=NUM_SMS, policy=policy, kv_splits=2)
        for order in ("round-robin", "reverse"):
            for tokens, positions in steps:
                logits = vm.step(tokens, positions, table, order=order)[1]
            results[policy, order] = (logits, vm.cache.kda.recurrent.clone())
    first = next(iter(results.values()))
    for key, (logits, state) in results.items():
        assert torch.equal(logits, first[0]), f"tiny-kimi-linear-qlora B={B} seed=7: logits of {key} differ"
        assert torch.equal(state, first[1]), f"tiny-kimi-linear-qlora B={B} seed=7: KDA state of {key} differs"


# ---- stage blocks == the decoder's own computation ------------------------------------------------------

def _stage_setup(name: str, batch: int, seed: int, tiles: dict | None = None):
    weights = _weights(name)
    cfg = weights.config
    layout = KimiLinearStepLayout.for_model(cfg, batch, 16, block_size=4, num_sms=NUM_SMS, kda_head_group=1)
    program = build_program(layout, tiles)
    cache = KimiLinearCache.allocate(cfg, batch + 1, batch * layout.max_blocks_per_seq, 4)
    gen = torch.Generator().manual_seed(seed)
    cache.kda.recurrent.copy_(0.3 * torch.randn(cache.kda.recurrent.shape, generator=gen))
    cache.kda.conv.copy_(torch.randn(cache.kda.conv.shape, generator=gen))
    bufs = allocate_buffers(layout, program.lm_tiles, program.num_counters, cache)
    ctx = KimiLinearStageContext(layout, pack_weights(weights, layout.max_seq_len), bufs,
                                 LayerRows(cache.latent.latent, cfg.mla_layers))
    return weights, cfg, layout, program, cache, ctx, gen


def _run(program, ctx, layer: int, opcodes) -> None:
    """Every instruction of `layer` with one of `opcodes`, in the global order."""
    for ins in program.instructions:
        if ins.layer == layer and ins.opcode in opcodes:
            STAGE_MODULES[ins.opcode].reference(ins, ctx)


KDA_OPS = (Opcode.KDA_PROJ, Opcode.KDA_STATE, Opcode.KDA_OUT_NORM)
MLA_OPS = (Opcode.MLA_QKV_A, Opcode.MLA_Q_B, Opcode.MLA_ABSORB, Opcode.MLA_PARTIAL, Opcode.MLA_REDUCE,
           Opcode.MLA_O_PROJ)
MOE_OPS = (Opcode.ROUTER, Opcode.ROUTER_TOPK, Opcode.SHARED_GATE_UP, Opcode.SHARED_DOWN, Opcode.EXPERT_GATE_UP,
           Opcode.EXPERT_DOWN, Opcode.MOE_COMBINE)


@pytest.mark.parametrize("name,seed,tiles", [("tiny-kimi-linear", 0, None), ("tiny-kimi-linear-qlora", 1, ODD_TILES)])
def test_kda_stages_match_decoder(name, seed, tiles):
    """KDA_PROJ (each part of the fused projection), then KDA_STATE + KDA_OUT_NORM of one KDA layer on a
    random hidden state and a random stored state (one sequence at position 0, its slot's state ignored,
    two past it, slots permuted), against the reference decoder's _kda: the layer output h[l] and the
    new recurrent and conv states."""
    weights, cfg, layout, program, cache, ctx, gen = _stage_setup(name, 3, seed, tiles)
    ref = KimiLinearReferenceDecoder(weights)
    bufs = ctx.bufs
    slots = torch.tensor([2, 0, 3])
    bufs.kda_slots.copy_(slots.to(torch.int32))
    bufs.positions.copy_(torch.tensor([5, 0, 9], dtype=torch.int32))
    want_cache = KimiLinearCache(kda=dataclasses.replace(cache.kda, recurrent=cache.kda.recurrent.clone(),
                                                         conv=cache.kda.conv.clone()), latent=cache.latent)
    want_cache.kda.reset(slots[1:2])   # the decoder resets a sequence at position 0
    for row, l in enumerate(cfg.kda_layers):
        lw = weights.layers[l].kda
        bufs.x[l] = torch.randn(3, cfg.hidden_size, generator=gen)
        xn = rms_norm(bufs.x[l], weights.layers[l].attn_norm, cfg.rms_norm_eps)
        _run(program, ctx, l, (Opcode.KDA_PROJ,))
        off = kda_offsets(cfg)
        proj = bufs.kda_proj[l]
        for part, w, lo in (("qkv", lw.qkv, 0), ("f_a", lw.f_a, off["f_a"]), ("g_a", lw.g_a, off["g_a"]),
                            ("b_proj", lw.b_proj, off["beta"])):
            assert_close(proj[:, lo:lo + w.shape[0]], ref._linear(xn, w), torch.float32,
                         context=f"{name} layer {l} KDA_PROJ {part}")
        assert proj.shape[1] == kda_proj_rows(cfg) and not torch.isnan(proj).any()
        _run(program, ctx, l, (Opcode.KDA_STATE, Opcode.KDA_OUT_NORM))
        want_h = bufs.x[l] + ref._kda(row, lw, xn, want_cache.kda, slots)
        ctx_s = f"{name} seed={seed} layer {l}"
        assert_close(bufs.h[l], want_h, torch.float32, context=f"{ctx_s}: h")
        assert_close(cache.kda.recurrent[row], want_cache.kda.recurrent[row], torch.float32, context=f"{ctx_s}: state")
        assert_close(cache.kda.conv[row], want_cache.kda.conv[row], torch.float32, context=f"{ctx_s}: conv")


@pytest.mark.parametrize("name,seed", [("tiny-kimi-linear", 2), ("tiny-kimi-linear-qlora", 3)])
def test_mla_stages_match_decoder(name, seed):
    """The DeepSeek MLA stages with the NoPE tables over a random latent history == the decoder's NoPE
    _mla_attn (the new rows are written unrotated, the query is not rotated)."""
    weights, cfg, layout, program, cache, ctx, gen = _stage_setup(name, 3, seed)
    ref = KimiLinearReferenceDecoder(weights)
    bufs = ctx.bufs
    positions = torch.tensor([6, 0, 11])
    table = contiguous_block_table(3, layout.max_seq_len, 4)
    bufs.positions.copy_(positions.to(torch.int32))
    bufs.block_table.copy_(table)
    cache.latent.latent.copy_(torch.randn(cache.latent.latent.shape, generator=gen))
    want_latent = cache.latent.latent.clone()
    for row, l in enumerate(cfg.mla_layers):
        bufs.x[l] = torch.randn(3, cfg.hidden_size, generator=gen)
        xn = rms_norm(bufs.x[l], weights.layers[l].attn_norm, cfg.rms_norm_eps)
        _run(program, ctx, l, MLA_OPS)
        want_cache = dataclasses.replace(cache.latent, latent=want_latent)
        want_h = bufs.x[l] + ref._mla_attn(row, weights.layers[l].mla, xn, positions, want_cache, table)
        assert_close(bufs.h[l], want_h, torch.float32, context=f"{name} seed={seed} layer {l}")
        assert_close(cache.latent.latent, want_latent, torch.float32, context=f"{name} seed={seed} layer {l} latent")


@pytest.mark.parametrize("name,seed", [("tiny-kimi-linear", 4), ("tiny-kimi-linear-qlora", 5)])
def test_mlp_stages_match_decoder(name, seed):
    """Dense GATE_UP/DOWN and the DeepSeek MoE stages (sigmoid routing, bias for the choice, groups,
    renormalisation, routed_scaling_factor, shared experts) == the decoder's _mlp / _moe."""
    weights, cfg, layout, program, cache, ctx, gen = _stage_setup(name, 4, seed)
    ref = KimiLinearReferenceDecoder(weights)
    bufs = ctx.bufs
    for l in range(cfg.num_layers):
        lw = weights.layers[l]
        bufs.h[l] = torch.randn(4, cfg.hidden_size, generator=gen)
        xn = rms_norm(bufs.h[l], lw.mlp_norm, cfg.rms_norm_eps)
        if cfg.is_moe_layer(l):
            _run(program, ctx, l, MOE_OPS)
            want = bufs.h[l] + ref._moe(lw, xn)
        else:
            _run(program, ctx, l, (Opcode.GATE_UP, Opcode.DOWN))
            want = bufs.h[l] + ref._mlp(xn, lw.gate_up, lw.down)
        assert_close(bufs.x[l + 1], want, torch.float32,
                     context=f"{name} seed={seed} layer {l} moe={cfg.is_moe_layer(l)}")


# ---- program properties -----------------------------------------------------------------------------

def _check_queues(program, ctx: str) -> None:
    for policy in POLICIES:
        queues = assign(program, policy)
        assert sorted(i.index for q in queues for i in q) == list(range(len(program.instructions))), ctx
        for q in queues:   # every queue keeps the global (topological) order
            assert [i.index for i in q] == sorted(i.index for i in q), f"{ctx} {policy}"
        assert len(simulate(queues, program.num_counters)) == len(program.instructions), f"{ctx} {policy}"


@pytest.mark.parametrize("name", TINY)
def test_tiny_programs_are_race_and_deadlock_free(name):
    """Batch 1-8 (head groups and splits varied), both policies; every (sequence, KDA head) has exactly one
    KDA_STATE, every row of each KDA tile stage one tile."""
    cfg = get_preset(name)
    for batch in range(1, 9):
        kda_group = (1, 2)[batch % 2]
        layout = KimiLinearStepLayout.for_model(cfg, batch, 64, block_size=16, num_sms=NUM_SMS,
                                                kv_splits=1 + batch % 3, kda_head_group=kda_group)
        program = build_program(layout)
        ctx = f"{name} B={batch} kda_group={kda_group} splits={layout.kv_splits}"
        check_program(program)
        assert find_races(program) == [], ctx
        _check_queues(program, ctx)
        for l in cfg.kda_layers:
            mine = [i for i in program.instructions if i.layer == l]
            heads = sorted((i.a0, h) for i in mine if i.opcode == Opcode.KDA_STATE
                           for h in range(i.a1 * kda_group, (i.a1 + 1) * kda_group))
            assert heads == [(b, h) for b in range(batch) for h in range(cfg.linear_num_heads)], ctx
            for op, rows in ((Opcode.KDA_PROJ, kda_proj_rows(cfg)), (Opcode.KDA_OUT_NORM, cfg.hidden_size)):
                covered = sorted(r for i in mine if i.opcode == op for r in range(i.a0, i.a0 + i.a1))
                assert covered == list(range(rows)), f"{ctx} layer {l} {op.name}"
            assert not any(i.opcode in MLA_OPS for i in mine), ctx
        for l in cfg.mla_layers:
            assert not any(i.opcode in KDA_OPS for i in program.instructions if i.layer == l), ctx


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_simulates(name):
    """Every preset at its real size (no weights), batch 1-8: structurally sound and deadlock-free under
    both policies, serialized, in bounded time."""
    cfg = get_preset(name)
    t0 = time.perf_counter()
    for batch in range(1, 9):
        layout = KimiLinearStepLayout.for_model(cfg, batch, 4096)
        program = build_program(layout)
        check_program(program)
        _check_queues(program, f"{name} B={batch}")
        table, lengths = serialize(assign(program, "balanced"))
        assert table.shape[0] == layout.num_sms and int(lengths.sum()) == len(program.instructions)
        per_layer = {}
        for i in program.instructions:
            per_layer[i.layer, i.opcode] = per_layer.get((i.layer, i.opcode), 0) + 1
        for l in cfg.kda_layers:
            assert per_layer[l, Opcode.KDA_STATE] == batch * layout.num_kda_head_groups
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"{name}: build + simulate of batch 1-8 took {elapsed:.1f} s"


@pytest.mark.parametrize("name,batches,num_sms", [
    pytest.param("kimi-linear-48b-a3b", (1, 2, 4, 8), 132, marks=pytest.mark.slow),
    ("kimi-linear-slice", tuple(range(1, 9)), 32),
])
def test_real_shapes_are_race_free(name, batches, num_sms):
    """The real shapes' programs are race-free (the full 48B model on 132 SMs at the power-of-two batch
    buckets, ~45 s: 33,716 instructions at batch 8; its 4-layer slice, every layer kind, at every batch 1-8
    on a 32-SM tiling)."""
    for batch in batches:
        program = build_program(KimiLinearStepLayout.for_model(get_preset(name), batch, 4096, num_sms=num_sms))
        assert find_races(program) == [], f"{name} B={batch} sms={num_sms}"


def test_race_checker_and_simulator_catch_planted_bugs():
    """Negative controls: an output norm that does not wait for the state update, a second writer of one
    head's state, a state update that does not wait for the projection, and a wait target one too high."""
    layout = KimiLinearStepLayout.for_model(get_preset("tiny-kimi-linear"), 2, 32, num_sms=NUM_SMS)
    program = build_program(layout)
    ins = program.instructions
    state = next(i for i in ins if i.opcode == Opcode.KDA_STATE)
    proj = next(i for i in ins if i.opcode == Opcode.KDA_PROJ and i.layer == state.layer)
    out_norm = next(i for i in ins if i.opcode == Opcode.KDA_OUT_NORM and i.layer == state.layer)

    def planted(target, **changes):
        new = tuple(dataclasses.replace(i, **changes) if i.index == target.index else i for i in ins)
        return dataclasses.replace(program, instructions=new)

    races = find_races(planted(out_norm, wait_id=state.wait_id, wait_count=state.wait_count))
    assert any("kda_o" in r or "kda_gate" in r for r in races), races
    other = next(i for i in ins if i.opcode == Opcode.KDA_STATE and i.layer == state.layer and i.index != state.index)
    races = find_races(planted(other, a0=state.a0, a1=state.a1))
    assert any("kda_state" in r for r in races), races
    races = find_races(planted(state, wait_id=proj.wait_id, wait_count=proj.wait_count))
    assert any("kda_proj" in r for r in races), races
    with pytest.raises(RuntimeError, match="deadlock"):
        stuck = planted(out_norm, wait_count=out_norm.wait_count + 1)
        simulate(assign(stuck, "balanced"), stuck.num_counters)


def test_layout_rejects_unsupported_shapes():
    cfg = get_preset("tiny-kimi-linear")
    for batch in (0, MAX_BATCH + 1):
        with pytest.raises(ValueError, match=f"batch={batch}"):
            KimiLinearStepLayout.for_model(cfg, batch, 32)
    with pytest.raises(ValueError, match="kda_head_group=3"):
        KimiLinearStepLayout.for_model(cfg, 1, 32, kda_head_group=3)
    with pytest.raises(ValueError, match="head_group=3"):
        KimiLinearStepLayout.for_model(cfg, 1, 32, head_group=3)
    with pytest.raises(ValueError, match="num_state_slots=1"):
        KimiLinearStepLayout.for_model(cfg, 2, 32, num_state_slots=1)
    with pytest.raises(ValueError, match="qk_rope_head_dim=7"):
        KimiLinearStepLayout.for_model(dataclasses.replace(cfg, qk_rope_head_dim=7), 1, 32)
    with pytest.raises(ValueError, match="EXPERT_GATE_UP"):
        build_program(KimiLinearStepLayout.for_model(cfg, 1, 32), {Opcode.EXPERT_GATE_UP: 24})


@pytest.mark.parametrize("bad", ["negative-token", "position-past-cache", "duplicate-slot", "slot-past-pool"])
def test_vm_step_rejects_bad_inputs(bad):
    weights = _weights("tiny-kimi-linear")
    vm = KimiLinearVMDecoder(weights, 2, 16, block_size=8, num_sms=NUM_SMS)
    tokens, positions, slots = torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([0, 1])
    table = contiguous_block_table(2, 16, 8)
    if bad == "negative-token":
        tokens[0] = -1
    elif bad == "position-past-cache":
        positions[1] = 16
    elif bad == "duplicate-slot":
        slots[1] = 0
    else:
        slots[1] = 2
    with pytest.raises(ValueError):
        vm.step(tokens, positions, table, slots=slots)
