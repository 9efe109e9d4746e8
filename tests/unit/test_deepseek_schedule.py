"""DeepSeek-V3 / Kimi-K2 decode schedule: the instruction DAG (MLA over the latent cache, routed +
shared experts) run by the instruction VM from the serialized per-SM queues, against the float32
DeepseekReferenceDecoder; race- and deadlock-freedom; one schedule for every routing; real shapes."""

from __future__ import annotations

import dataclasses
import time
from unittest import mock

import pytest
import torch

from megakernel.instructions import STAGE_MODULES, Opcode
from megakernel.instructions.deepseek.mla_partial import new_latent_row
from megakernel.instructions.deepseek.router_topk import select_experts
from megakernel.instructions.layout import MAX_BATCH
from megakernel.instructions.record import serialize
from megakernel.model.deepseek import reference as deepseek_reference
from megakernel.model.deepseek import (
    DeepseekReferenceDecoder,
    LatentKVCache,
    contiguous_block_table,
    get_preset,
    random_weights,
    route,
)
from megakernel.model.ops import rms_norm
from megakernel.schedule import POLICIES, assign, simulate
from megakernel.schedule.deepseek import (
    DeepseekStageContext,
    DeepseekStepLayout,
    DeepseekVMDecoder,
    allocate_buffers,
    build_program,
    pack_weights,
)
from megakernel.schedule.deepseek_checks import check_program, find_races
from megakernel.testing.tolerances import assert_close, tolerance_for

TINY = ("tiny-deepseek", "tiny-deepseek-qlora")
NUM_STEPS = 4
NUM_SMS = 16  # a small machine: several tiles per stage, and a VM step stays fast


# tiny torch ops on the CPU: one intra-op thread (the plugin's fixture)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


_WEIGHTS: dict = {}


def _weights(name: str, seed: int = 0):
    """bf16 random weights of a preset (cached: drawing them is the slow part)."""
    key = (name, seed)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = random_weights(get_preset(name), seed=seed, dtype=torch.bfloat16)
    return _WEIGHTS[key]


def _shuffled_block_table(batch: int, max_seq_len: int, block_size: int, gen: torch.Generator):
    """Pages of each sequence scattered over a pool larger than needed: -> (table int32, num_blocks)."""
    per_seq = -(-max_seq_len // block_size)
    num_blocks = batch * per_seq + 3
    table = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    return table, num_blocks


def _prefill_history(latents: list[torch.Tensor], table: torch.Tensor, start: list[int], block_size: int,
                     gen: torch.Generator) -> None:
    """The same random latent rows at positions < start[b] of every given cache [L, NB, bs, D]."""
    L, D = latents[0].shape[0], latents[0].shape[-1]
    for b, n in enumerate(start):
        for p in range(n):
            row = torch.randn(L, D, generator=gen).to(latents[0].dtype)
            for lat in latents:
                lat[:, int(table[b, p // block_size]), p % block_size] = row


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

# Odd tile sizes: tails in every row-tiled stage, tiles that stop inside a head / an expert.
ODD_TILES = {Opcode.MLA_QKV_A: 24, Opcode.MLA_Q_B: 40, Opcode.MLA_ABSORB: 24, Opcode.MLA_REDUCE: 24,
             Opcode.MLA_O_PROJ: 56, Opcode.GATE_UP: 48, Opcode.DOWN: 40, Opcode.ROUTER: 8,
             Opcode.SHARED_GATE_UP: 48, Opcode.SHARED_DOWN: 72, Opcode.EXPERT_GATE_UP: 48,
             Opcode.EXPERT_DOWN: 40, Opcode.MOE_COMBINE: 104, Opcode.LM_HEAD: 72}

# (preset, start positions per sequence, block size, kv_splits, head_group, policy, tile override, seed)
VM_CASES = [
    ("tiny-deepseek", [7], 16, None, None, "balanced", None, 0),
    ("tiny-deepseek", [0, 5, 11], 4, 3, 2, "round-robin", ODD_TILES, 1),
    ("tiny-deepseek-qlora", [3, 17], 8, 4, 1, "balanced", None, 2),
    ("tiny-deepseek-qlora", [0, 9, 2], 4, 2, 4, "round-robin", ODD_TILES, 3),
]


def _reference_step(ref, tokens, positions, cache: LatentKVCache, table, rows: torch.Tensor | None = None):
    """ref.step -> (logits, the new latent rows before their rounding to the cache dtype, float32 [L, B, D]).
    With `rows` [L, num_blocks, bs, D], each new row is stored (and attended to within the step) as `rows`
    holds it at that position instead of as the reference's own rounding of it."""
    layer_bytes = cache.latent[0].numel() * cache.latent.element_size()
    write_latent = deepseek_reference.write_latent
    unrounded: dict[int, torch.Tensor] = {}

    def write(latent, block_table, pos, new_rows):
        layer = (latent.data_ptr() - cache.latent.data_ptr()) // layer_bytes
        assert latent.data_ptr() == cache.latent[layer].data_ptr(), "write_latent of another cache"
        unrounded[layer] = new_rows.float().clone()
        if rows is None:
            write_latent(latent, block_table, pos, new_rows)
            return
        bs, pos = latent.shape[1], pos.long()
        blocks = block_table.long().gather(1, (pos // bs)[:, None])[:, 0]
        latent[blocks, pos % bs] = rows[layer, blocks, pos % bs]

    with mock.patch.object(deepseek_reference, "write_latent", write):
        logits = ref.step(tokens, positions, cache, table)
    return logits, torch.stack([unrounded[layer] for layer in range(cache.latent.shape[0])])


def _rounding_splits(vm, cache: LatentKVCache, positions, table, ref_rows: torch.Tensor, ctx: str) -> bool:
    """The step's new latent rows, VM against reference: before the rounding to bf16 within float32
    tolerance; after it bitwise equal, except where an element's exact value sits on a bf16 rounding
    midpoint and the two float32 values of it (~1e-7 apart) fall on either side of it. Asserts every
    differing element is such a split (neighbouring bf16 values, the two unrounded values on either
    side of their midpoint or on it); -> whether there is any."""
    L, B = cache.latent.shape[0], positions.shape[0]
    pos = positions.long()
    blocks = table.long().gather(1, (pos // cache.block_size)[:, None])[:, 0]
    offs = pos % cache.block_size
    ctx32 = dataclasses.replace(vm.ctx, bufs=dataclasses.replace(vm.bufs, positions=positions.to(torch.int32)),
                                latent=torch.empty(0, dtype=torch.float32))   # new_latent_row, unrounded
    vm_rows = torch.stack([torch.stack([new_latent_row(ctx32, layer, b) for b in range(B)]) for layer in range(L)])
    assert_close(vm_rows, ref_rows, torch.float32, context=f"{ctx}: new latent rows before rounding")
    earlier = (vm.cache.latent != cache.latent) & ~torch.isnan(cache.latent)
    earlier[:, blocks, offs] = False
    assert not earlier.any(), f"{ctx}: cache rows of earlier steps differ"
    got, want = vm.cache.latent[:, blocks, offs], cache.latent[:, blocks, offs]     # [L, B, D] bf16
    differ = got != want
    if not differ.any():
        return False
    got, want, vm_u, ref_u = got[differ], want[differ], vm_rows[differ], ref_rows[differ]
    neighbours = (torch.signbit(got.float()) == torch.signbit(want.float())) & (
        (got.view(torch.int16).int() - want.view(torch.int16).int()).abs() == 1)
    assert neighbours.all(), f"{ctx}: new latent rows differ by more than one bf16 step: {got} vs {want}"
    midpoint = (got.float() + want.float()) / 2     # exact in float32
    straddle = (vm_u - midpoint) * (ref_u - midpoint) <= 0
    assert straddle.all(), (f"{ctx}: new latent rows round apart, but not across the midpoint: VM {vm_u} -> "
                            f"{got}, reference {ref_u} -> {want}, midpoint {midpoint}")
    return True


@pytest.mark.parametrize("name,start,block_size,kv_splits,head_group,policy,tiles,seed", VM_CASES)
def test_vm_matches_reference_decoder(name, start, block_size, kv_splits, head_group, policy, tiles, seed):
    """Several greedy steps of a batch at different positions (a random cached history behind each,
    pages shuffled): logits within float32 tolerance, the same tokens, the same latent cache rows. Each step
    starts from the same bf16 cache on both sides (the VM's rows checked against the reference's at bf16
    tolerance, then replaced by them): a bf16 rounding of a new latent that lands the other way on one side
    would otherwise carry a 2^-8 difference into every later step's float32 comparison.
    Within a step the new token attends to its own bf16 row, so such a split rounding moves that step's
    logits too: tiny-deepseek-qlora seed=3 step=1, layer 2 sequence 2 c_kv[63] is 0.15478518 in float64,
    2.4e-8 (1.6 float32 ulps) above the bf16 midpoint 0.15478515625; the VM's float32 value 0.15478525
    rounds up (as float64 does), the reference's 0.15478495 down, and that one 2^-10 step moves the logits
    by 1.4e-4 (float64 with each side's rows: 1.41e-4 apart; each float32 side within 6e-6 of the float64
    step with its own rows). So where _rounding_splits finds one, the logits are compared (still at float32
    tolerance) with the reference step re-run on the VM's roundings."""
    weights = _weights(name)
    cfg = weights.config
    B = len(start)
    gen = torch.Generator().manual_seed(seed)
    max_seq_len = max(start) + NUM_STEPS + 1
    table, num_blocks = _shuffled_block_table(B, max_seq_len, block_size, gen)
    vm = DeepseekVMDecoder(weights, B, max_seq_len, block_size=block_size, num_sms=NUM_SMS, policy=policy,
                           kv_splits=kv_splits, head_group=head_group, num_blocks=num_blocks,
                           tile_rows_override=tiles)
    ref = DeepseekReferenceDecoder(weights)
    cache = LatentKVCache.allocate(cfg, num_blocks, block_size, dtype=weights.dtype)
    _prefill_history([cache.latent, vm.cache.latent], table, start, block_size, gen)
    tokens = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
    positions = torch.tensor(start)
    for step in range(NUM_STEPS):
        ctx = (f"{name} B={B} start={start} bs={block_size} splits={vm.layout.kv_splits} "
               f"group={vm.layout.head_group} policy={policy} odd_tiles={tiles is not None} seed={seed} step={step}")
        before = cache.latent.clone()
        want, ref_rows = _reference_step(ref, tokens, positions, cache, table)
        got_tokens, got = vm.step(tokens, positions, table)
        assert torch.equal(vm.bufs.positions, (positions + 1).to(torch.int32)), f"{ctx}: positions not advanced"
        written = ~torch.isnan(cache.latent.float())
        assert torch.equal(written, ~torch.isnan(vm.cache.latent.float())), f"{ctx}: cache rows written differ"
        assert_close(vm.cache.latent.float()[written], cache.latent.float()[written], torch.bfloat16, context=ctx)
        next_tokens = want.argmax(-1)
        if _rounding_splits(vm, cache, positions, table, ref_rows, ctx):
            want, _ = _reference_step(ref, tokens, positions, LatentKVCache(before, cache.block_size), table,
                                      rows=vm.cache.latent)
        assert_close(got, want, torch.float32, context=ctx)
        assert torch.equal(got_tokens, got.argmax(-1).to(torch.int32)), f"{ctx}: ARGMAX != argmax(logits)"
        _assert_same_greedy(got_tokens, want, ctx)
        vm.cache.latent.copy_(cache.latent)
        tokens, positions = next_tokens, positions + 1


def test_vm_generation_matches_reference_generate():
    """Prompts fed from position 0 through the VM (float32 latent cache), then greedy picks: the tokens
    DeepseekReferenceDecoder.generate gives."""
    weights = _weights("tiny-deepseek-qlora", seed=1)
    prompts = [[5, 9, 100, 3], [900, 2, 31, 64]]
    new_tokens = 5
    want = DeepseekReferenceDecoder(weights).generate(prompts, new_tokens, block_size=4)
    B, n = len(prompts), len(prompts[0])
    vm = DeepseekVMDecoder(weights, B, n + new_tokens, block_size=4, num_sms=NUM_SMS, cache_dtype=torch.float32)
    table = contiguous_block_table(B, vm.layout.max_seq_len, 4)
    generated: list[list[int]] = [[] for _ in range(B)]
    tokens = torch.tensor([p[0] for p in prompts])
    for t in range(n + new_tokens - 1):
        out, logits = vm.step(tokens, torch.full((B,), t), table)
        if t >= n - 1:
            for b in range(B):
                generated[b].append(int(out[b]))
        tokens = torch.tensor([p[t + 1] for p in prompts]) if t + 1 < n else out.long()
    for b in range(B):
        assert generated[b] == want.tokens[b], f"tiny-deepseek-qlora seed=1 prompt {b}: {generated[b]} != " \
                                               f"{want.tokens[b]}"


def test_vm_is_deterministic_across_policies_and_orders():
    """Every element has one writer and MOE_COMBINE adds in a fixed order: bitwise-equal logits whatever
    the SM assignment and the interleaving of the SMs."""
    weights = _weights("tiny-deepseek")
    B, start, bs = 3, [2, 6, 0], 4
    gen = torch.Generator().manual_seed(7)
    table = contiguous_block_table(B, 16, bs)
    history = LatentKVCache.allocate(weights.config, table.numel(), bs, dtype=weights.dtype)
    _prefill_history([history.latent], table, start, bs, gen)
    tokens = torch.randint(0, weights.config.vocab_size, (B,), generator=gen)
    results = {}
    for policy in POLICIES:
        vm = DeepseekVMDecoder(weights, B, 16, block_size=bs, num_sms=NUM_SMS, policy=policy, kv_splits=2)
        for order in ("round-robin", "reverse"):
            vm.cache.latent.copy_(history.latent)
            results[policy, order] = vm.step(tokens, torch.tensor(start), table, order=order)[1]
    first = next(iter(results.values()))
    for key, logits in results.items():
        assert torch.equal(logits, first), f"tiny-deepseek B={B} seed=7: logits of {key} differ bitwise"


# ---- one schedule for every routing -----------------------------------------------------------------

def test_routing_change_uses_the_same_schedule():
    """Different tokens route to different experts, through a byte-identical serialized queue table."""
    weights = _weights("tiny-deepseek-qlora")
    cfg = weights.config
    B, bs = 2, 8
    table = contiguous_block_table(B, 16, bs)
    ref = DeepseekReferenceDecoder(weights)
    runs = []
    for seed in (11, 12):
        gen = torch.Generator().manual_seed(seed)
        vm = DeepseekVMDecoder(weights, B, 16, block_size=bs, num_sms=NUM_SMS)
        queue_before = vm.table.clone()
        tokens = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
        positions = torch.tensor([0, 3])
        cache = LatentKVCache.allocate(cfg, table.numel(), bs, dtype=weights.dtype)
        _prefill_history([cache.latent, vm.cache.latent], table, [0, 3], bs, gen)
        _, logits = vm.step(tokens, positions, table)
        assert_close(logits, ref.step(tokens, positions, cache, table), torch.float32,
                     context=f"tiny-deepseek-qlora B={B} seed={seed}")
        assert torch.equal(vm.table, queue_before), f"seed={seed}: the queue table changed while running"
        # the experts the reference router picks for this step's MoE inputs are the ones the VM used
        for l in range(cfg.first_k_dense_replace, cfg.num_layers):
            m = l - cfg.first_k_dense_replace
            lw = weights.layers[l]
            _, ids = route(rms_norm(vm.bufs.h[l], lw.mlp_norm, cfg.rms_norm_eps), lw.router, lw.router_bias, cfg)
            assert torch.equal(vm.bufs.topk_ids[m].long(), ids), f"seed={seed} layer {l}: expert ids differ"
        runs.append((vm.table, vm.lengths, vm.bufs.topk_ids.clone()))
    (t0, n0, ids0), (t1, n1, ids1) = runs
    assert torch.equal(t0, t1) and torch.equal(n0, n1), "the serialized queues depend on the tokens"
    assert not torch.equal(ids0, ids1), "seeds 11/12 happened to route identically: pick other tokens"


def test_expert_reads_an_unwritten_expert_id_raise():
    """An expert instruction run before ROUTER_TOPK sees the poisoned id (-1) and raises, not wraps."""
    weights = _weights("tiny-deepseek")
    layout = DeepseekStepLayout.for_model(weights.config, 2, 16, num_sms=NUM_SMS)
    program = build_program(layout)
    bufs = allocate_buffers(layout, program.lm_tiles, program.num_counters)
    ctx = DeepseekStageContext(layout, pack_weights(weights, layout.max_seq_len), bufs,
                               LatentKVCache.allocate(weights.config, 2, 16).latent)
    bufs.h.normal_()
    ins = next(i for i in program.instructions if i.opcode == Opcode.EXPERT_GATE_UP)
    with pytest.raises(RuntimeError, match="expert id -1"):
        STAGE_MODULES[ins.opcode].reference(ins, ctx)


@pytest.mark.parametrize("n_routed,n_group,topk_group,top_k,norm,seed", [
    (8, 1, 1, 2, True, 0), (8, 4, 2, 3, True, 1), (256, 8, 4, 8, True, 2), (384, 1, 1, 8, True, 3),
    (64, 4, 2, 6, False, 4)])
def test_select_experts_matches_route(n_routed, n_group, topk_group, top_k, norm, seed):
    """ROUTER + ROUTER_TOPK's selection (argmax passes) == transformers-exact route() on the same input."""
    cfg = dataclasses.replace(get_preset("tiny-deepseek"), n_routed_experts=n_routed, n_group=n_group,
                              topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=norm)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, cfg.hidden_size, generator=gen)
    router = torch.randn(n_routed, cfg.hidden_size, generator=gen) / cfg.hidden_size ** 0.5
    bias = 0.05 * torch.randn(n_routed, generator=gen)
    want_w, want_ids = route(x, router, bias, cfg)
    ids, w = select_experts(torch.sigmoid(x @ router.T), bias, cfg)
    ctx = f"E={n_routed} groups={n_group}/{topk_group} k={top_k} norm={norm} seed={seed}"
    assert torch.equal(ids.long(), want_ids), f"{ctx}: ids {ids.tolist()} != {want_ids.tolist()}"
    assert_close(w, want_w, torch.float32, context=ctx)


# ---- program properties -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("batch,head_group,kv_splits", [(1, None, None), (2, 2, 3), (3, 1, 5)])
def test_program_is_race_and_deadlock_free(name, batch, head_group, kv_splits):
    cfg = get_preset(name)
    layout = DeepseekStepLayout.for_model(cfg, batch, 64, block_size=16, num_sms=NUM_SMS, kv_splits=kv_splits,
                                          head_group=head_group)
    program = build_program(layout)
    ctx = f"{name} B={batch} group={layout.head_group} splits={layout.kv_splits}"
    check_program(program)
    assert find_races(program) == [], ctx
    for policy in POLICIES:
        queues = assign(program, policy)
        assert sorted(i.index for q in queues for i in q) == list(range(len(program.instructions))), ctx
        for q in queues:   # every queue keeps the global (topological) order
            assert [i.index for i in q] == sorted(i.index for i in q), f"{ctx} {policy}"
        done = simulate(queues, program.num_counters)
        assert len(done) == len(program.instructions), f"{ctx} {policy}"
    # every (sequence, slot) of every MoE layer has its expert rows tiled exactly once
    K, Fe, H = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    for l in range(cfg.first_k_dense_replace, cfg.num_layers):
        for op, rows in ((Opcode.EXPERT_GATE_UP, 2 * Fe), (Opcode.EXPERT_DOWN, H)):
            tiles = sorted((i.a0, i.a1, i.a2, i.a3) for i in program.instructions if i.layer == l and i.opcode == op)
            for b in range(batch):
                for slot in range(K):
                    spans = [(lo, n) for bb, s, lo, n in tiles if (bb, s) == (b, slot)]
                    covered = [r for lo, n in spans for r in range(lo, lo + n)]
                    assert covered == list(range(rows)), f"{ctx} layer {l} {op.name} b={b} slot={slot}"


def test_race_checker_and_simulator_catch_planted_bugs():
    """Negative controls: a combine that does not wait for the experts, an expert that does not wait
    for the top-k, and a wait target one too high are all reported."""
    layout = DeepseekStepLayout.for_model(get_preset("tiny-deepseek"), 2, 32, num_sms=NUM_SMS)
    program = build_program(layout)
    ins = program.instructions
    egu = next(i for i in ins if i.opcode == Opcode.EXPERT_GATE_UP)
    router = next(i for i in ins if i.opcode == Opcode.ROUTER and i.layer == egu.layer)
    combine = next(i for i in ins if i.opcode == Opcode.MOE_COMBINE and i.layer == egu.layer)

    def planted(target, **changes):
        new = tuple(dataclasses.replace(i, **changes) if i.index == target.index else i for i in ins)
        return dataclasses.replace(program, instructions=new)

    races = find_races(planted(combine, wait_id=egu.signal_id, wait_count=egu.wait_count))
    assert any("expert_out" in r for r in races), races
    n_router = sum(1 for i in ins if i.signal_id == router.signal_id)
    races = find_races(planted(egu, wait_id=router.signal_id, wait_count=n_router))
    assert any("topk_ids" in r for r in races), races
    races = find_races(planted(combine, wait_count=combine.wait_count - 1))   # any one expert may be missing
    assert any("expert_out" in r or "shared_out" in r for r in races), races
    with pytest.raises(RuntimeError, match="deadlock"):
        stuck = planted(combine, wait_count=combine.wait_count + 1)
        simulate(assign(stuck, "balanced"), stuck.num_counters)


@pytest.mark.parametrize("name", ["moonlight-16b-a3b", "kimi-k2-slice"])
@pytest.mark.parametrize("batch", [1, 8])
def test_real_shapes_build_and_simulate(name, batch):
    """Full-size programs (no weights): built, structurally sound, deadlock-free under both policies,
    the routed-expert stage independent of routing, in well under a second each."""
    cfg = get_preset(name)
    t0 = time.perf_counter()
    layout = DeepseekStepLayout.for_model(cfg, batch, 4096)
    program = build_program(layout)
    check_program(program)
    for policy in POLICIES:
        queues = assign(program, policy)
        assert len(simulate(queues, program.num_counters)) == len(program.instructions), f"{name} B={batch}"
        table, lengths = serialize(queues)
        assert table.shape[0] == layout.num_sms and int(lengths.sum()) == len(program.instructions)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"{name} B={batch}: build + simulate took {elapsed:.1f} s"
    per_layer = {}
    for i in program.instructions:
        per_layer[i.layer, i.opcode] = per_layer.get((i.layer, i.opcode), 0) + 1
    K = cfg.num_experts_per_tok
    last = cfg.num_layers - 1
    assert per_layer[last, Opcode.EXPERT_GATE_UP] % (batch * K) == 0
    assert per_layer[last, Opcode.ROUTER_TOPK] == 1
    assert (per_layer[last, Opcode.MLA_PARTIAL]
            == batch * layout.num_head_groups * layout.kv_splits), f"{name} B={batch}"
    assert (0, Opcode.GATE_UP) in per_layer and (last, Opcode.GATE_UP) not in per_layer


@pytest.mark.parametrize("name,layers,batch", [("kimi-k2-slice", None, 1), ("moonlight-16b-a3b", 2, 2)])
def test_real_shapes_are_race_free(name, layers, batch):
    program = build_program(DeepseekStepLayout.for_model(get_preset(name, layers), batch, 4096))
    assert find_races(program) == [], f"{name} layers={layers} B={batch}"


def test_layout_rejects_unsupported_shapes():
    cfg = get_preset("tiny-deepseek")
    for batch in (0, MAX_BATCH + 1):
        with pytest.raises(ValueError, match=f"batch={batch}"):
            DeepseekStepLayout.for_model(cfg, batch, 32)
    with pytest.raises(ValueError, match="head_group=3"):
        DeepseekStepLayout.for_model(cfg, 1, 32, head_group=3)
    with pytest.raises(ValueError, match="moe_intermediate_size=60"):
        DeepseekStepLayout.for_model(dataclasses.replace(cfg, moe_intermediate_size=60), 1, 32)
    with pytest.raises(ValueError, match="EXPERT_GATE_UP"):   # a tile must hold whole gate/up pairs
        build_program(DeepseekStepLayout.for_model(cfg, 1, 32), {Opcode.EXPERT_GATE_UP: 24})


@pytest.mark.parametrize("bad", ["negative-token", "token-past-vocab", "negative-position", "position-past-cache",
                                 "block-table-shape", "block-id-past-pool"])
def test_vm_step_rejects_bad_inputs(bad):
    weights = _weights("tiny-deepseek")
    vm = DeepseekVMDecoder(weights, 2, 16, block_size=8, num_sms=NUM_SMS)
    tokens, positions = torch.tensor([1, 2]), torch.tensor([0, 3])
    table = contiguous_block_table(2, 16, 8)
    if bad == "negative-token":
        tokens[0] = -1
    elif bad == "token-past-vocab":
        tokens[1] = weights.config.vocab_size
    elif bad == "negative-position":
        positions[0] = -1
    elif bad == "position-past-cache":
        positions[1] = 16
    elif bad == "block-table-shape":
        table = table[:, :1]
    else:
        table[1, 1] = table.numel()
    with pytest.raises(ValueError):
        vm.step(tokens, positions, table)
