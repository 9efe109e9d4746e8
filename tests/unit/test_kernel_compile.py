"""The decode kernel compiles for sm_90a without a GPU, and the SASS is what the streaming core needs: weight
tiles brought into shared memory by the bulk copy engine (cp.async.bulk completing on mbarriers), read from
there with 128-bit shared loads, and no local-memory spills on the real presets at any batch.

The root conftest.py sets the target (CUTE_DSL_ARCH=sm_90a) and a private artifact folder before cutlass
is first imported.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

from megakernel.instructions.layout import MMA_TILES, StepLayout, default_kv_splits
from megakernel.instructions.record import serialize
from megakernel.kernel.compile import (KernelKey, compile_decode_kernel, nvdisasm_path, resource_usage, sass,
                                       spill_instructions)
from megakernel.kernel.interpreter import DecodeKernel, KernelOptions
from megakernel.kernel.stream import SLAB_COLS, slot_parts
from megakernel.model.presets import get_preset
from megakernel.schedule import assign, build_program

TINY_PRESETS = ("tiny-llama", "tiny-qwen3")
REAL_PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b")
BATCHES = (1, 8)
NUM_SMS = 132
BLOCK_SIZE = 16
MAX_SEQ_LEN = 256

CASES = [(name, batch) for name in TINY_PRESETS + REAL_PRESETS for batch in BATCHES]
REAL_CASES = [(name, batch) for name in REAL_PRESETS for batch in BATCHES]


@functools.lru_cache(maxsize=None)
def compiled(name: str, batch: int, slab_staging: bool = True, split_seq_len: int = 4096,
             options: KernelOptions = KernelOptions()) -> dict:
    """PTX, SASS and resource usage of the kernel for a preset at a batch size (compiled once per module), its KV
    splits those the engine picks for a cache of split_seq_len positions."""
    config = get_preset(name)
    layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, NUM_SMS, split_seq_len),
                        block_size=BLOCK_SIZE, max_blocks_per_seq=MAX_SEQ_LEN // BLOCK_SIZE, num_sms=NUM_SMS,
                        slab_staging=slab_staging)
    program = build_program(layout)
    table, _ = serialize(assign(program, "balanced"))
    # the engine's own cache geometry: one contiguous block range per sequence, default strides
    known = {"layout": layout, "lm_tiles": program.lm_tiles, "num_counters": program.num_counters,
             "max_queue_len": table.shape[1], "num_blocks": batch * layout.max_blocks_per_seq, "kv_strides": None,
             "options": options}
    key = KernelKey(**{f.name: known[f.name] for f in dataclasses.fields(KernelKey)})
    kernel = compile_decode_kernel(key, keep_artifacts=True)
    device_code = DecodeKernel(key.layout, key.lm_tiles, key.num_counters, key.max_queue_len, key.kv_strides,
                               key.options)
    cubin = kernel.__cubin__
    sass_text = sass(cubin)
    return {"ptx": kernel.__ptx__, "cubin": cubin, "sass": sass_text, "usage": resource_usage(cubin),
            "spills": spill_instructions(sass_text), "device_code": device_code}


def _what(name: str, batch: int, art: dict) -> str:
    u = art["usage"]
    return (f"{name} batch={batch} sm_90a: regs={u.get('regs')} frame_bytes={u.get('frame_bytes')} "
            f"code_bytes={u.get('code_bytes')} LDL/STL={art['spills']}")


@pytest.fixture(scope="module", autouse=True)
def _needs_nvdisasm():
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm): SASS cannot be read")


@pytest.mark.parametrize("name,batch", CASES)
def test_kernel_compiles_for_sm90a(name, batch):
    art = compiled(name, batch)
    what = _what(name, batch, art)
    target = re.search(r"^\s*\.target\s+(\S+)", art["sass"], re.MULTILINE)
    assert target and target.group(1) == "sm_90a", \
        f"{what}: compiled for {target.group(1) if target else '?'}; set CUTE_DSL_ARCH=sm_90a before importing cutlass"
    assert art["cubin"][:4] == b"\x7fELF", what
    assert 0 < art["usage"].get("regs", 0) <= 255, what
    assert re.search(r"\.entry\s+kernel_", art["ptx"]), f"{what}: no kernel entry in the PTX"


def assert_hop_word_atomic(art, what):
    """The hop word (stream.mark_hop / read_hop) written and read by shared-memory atomics, which racecheck does not
    report, where a plain store and load of it were 100 hazards (H100, 2026-12-06)."""
    assert re.search(r"\bATOMS\.EXCH\b", art["sass"]) and re.search(r"\bATOMS\.OR\b", art["sass"]), \
        f"{what}: the hop word is not written and read by shared-memory atomics"


@pytest.mark.parametrize("name,batch", CASES)
def test_weights_stream_through_bulk_copies_into_shared_memory(name, batch):
    """The producer's cp.async.bulk (SASS UBLKCP) completing on mbarriers (try_wait.parity: SYNCS), and the
    consumers' 128-bit shared loads of the landed weights (LDS.128); no weight is read from global memory by
    a consumer (no L1-bypassing read-only global load is left in the kernel)."""
    art = compiled(name, batch)
    what = _what(name, batch, art)
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in art["ptx"], \
        f"{what}: no bulk copy into shared memory in the PTX"
    assert "mbarrier.try_wait.parity" in art["ptx"] and "mbarrier.arrive.expect_tx" in art["ptx"], what
    assert re.search(r"\bUBLKCP\b", art["sass"]), f"{what}: no UBLKCP in the SASS"
    assert re.search(r"\bSYNCS\.", art["sass"]), f"{what}: no mbarrier instruction in the SASS"
    assert re.search(r"\bLDS\.128\b", art["sass"]), f"{what}: no 128-bit shared load in the SASS"
    assert_hop_word_atomic(art, what)
    assert not re.findall(r"ld\.global\.nc\.L1::no_allocate\S*", art["ptx"]), \
        f"{what}: a consumer still loads weights from global memory"
    dk = art["device_code"]
    assert 4 <= dk.ring_slots <= 12 and dk.smem_bytes() <= 227 * 1024, \
        f"{what}: {dk.ring_slots} ring slots, {dk.smem_bytes()} bytes of shared memory"


def test_the_no_copy_diagnostic_copies_no_weights_and_still_multiplies():
    """KernelOptions(diag_no_copy=True), the timing-only build behind the step-without-weight-copies figures: no
    bulk copy is left in it, and the consumers' MMAs are."""
    art = compiled("llama-3.2-1b", 1, options=KernelOptions(diag_no_copy=True))
    what = _what("llama-3.2-1b", 1, art)
    assert not re.search(r"\bUBLKCP\b", art["sass"]), f"{what}: a bulk copy in the no-copy build"
    assert re.findall(r"\bHMMA\.16816\.F32\.BF16\b", art["sass"]), f"{what}: no MMA in the no-copy build"


def test_the_no_stage_diagnostic_stages_no_input_and_still_multiplies():
    """KernelOptions(diag_no_stage=True), the timing-only build without the consumers' input staging (each window
    zeroed instead): the staging's bf16 conversions are gone (those left: other stages', the attention's tensor-core
    pass's query and weight halves among them: 24 of 88 at llama-3.2-1b 8), the MMAs are not."""
    plain = compiled("llama-3.2-1b", 8)
    art = compiled("llama-3.2-1b", 8, options=KernelOptions(diag_no_stage=True))
    what = _what("llama-3.2-1b", 8, art)
    packs = [len(re.findall(r"\bF2FP\.BF16\.F32\.PACK_AB\b", a["sass"])) for a in (plain, art)]
    assert packs[1] * 2 < packs[0], f"{what}: {packs[1]} bf16 conversions left of {packs[0]}"
    assert re.findall(r"\bHMMA\.16816\.F32\.BF16\b", art["sass"]), f"{what}: no MMA in the no-stage build"


def test_the_no_stage_diagnostic_past_batch_8_copies_no_input_window_and_still_multiplies():
    """Past SPLIT_BATCH the same diagnostic skips the bulk copies of the pre-staged input's windows (each window
    zeroed instead): one bulk-copy site fewer (the weight slots' stay), the wgmmas stay."""
    plain = compiled("llama-3.2-1b", 64)
    art = compiled("llama-3.2-1b", 64, options=KernelOptions(diag_no_stage=True))
    what = _what("llama-3.2-1b", 64, art)
    copies = [len(re.findall(r"\bUBLKCP\b", a["sass"])) for a in (plain, art)]
    assert 0 < copies[1] < copies[0], f"{what}: bulk-copy sites {copies[1]} against {copies[0]} in the plain build"
    assert re.findall(r"\bHGMMA\.64x64x16\.F32\.BF16\b", art["sass"]), f"{what}: no wgmma in the no-stage build"


@pytest.mark.parametrize("name,batch", [("llama-3.2-1b", 1), ("llama-3.1-8b", 8), ("llama-3.2-1b", 64)])
def test_the_trace_build_compiles_without_spills_and_the_plain_build_reads_no_timer_for_it(name, batch):
    """KernelOptions(trace=True), the build behind every trace in profiles/ (its stamps and the weight ring's
    wait durations, stream.TRACE_WORDS): no spills on the narrow and the wide path, and the globaltimer reads
    it adds (SASS ...GLOBALTIMER...) are not in the plain build, which keeps only its bounded waits' reads."""
    plain, traced = compiled(name, batch), compiled(name, batch, options=KernelOptions(trace=True))
    what = _what(name, batch, traced)
    assert traced["spills"] == 0 and traced["usage"].get("frame_bytes", 0) == 0, \
        f"{what}: local-memory loads/stores in the trace build"
    reads = [len(re.findall(r"GLOBALTIMER", a["sass"])) for a in (plain, traced)]
    assert reads[1] >= reads[0] + 12, f"{what}: {reads} globaltimer reads (plain, trace)"


@pytest.mark.parametrize("name,batch", CASES)
def test_matvecs_multiply_on_the_tensor_cores(name, batch):
    """Every matvec work item is m16n8k16 bf16 MMAs with float32 accumulation (SASS HMMA.16816.F32.BF16),
    its weights read from the landed slots by the 128-bit shared loads checked above."""
    art = compiled(name, batch)
    what = _what(name, batch, art)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in art["ptx"], f"{what}: no bf16 MMA in the PTX"
    hmma = re.findall(r"\bHMMA\.16816\.F32\.BF16\b", art["sass"])
    want = SLAB_COLS // slot_parts(batch) // 16           # an item: one per 16-column step (bf16 inputs)
    assert len(hmma) >= want, f"{what}: {len(hmma)} HMMA.16816.F32.BF16 in the SASS, expected a work item's {want}"


@pytest.mark.parametrize("name,batch", REAL_CASES)
def test_long_attention_splits_run_on_the_tensor_cores(name, batch):
    """Up to SPLIT_BATCH a split of more tokens than warps is softmax_pass.stream_tokens_mma: per 8-token tile, the
    scores by m16n8k16 (query hi and lo: two a 16-element chunk of the head) and the output by m16n8k8 (weights hi
    and lo: two a 16-element m-tile), the values' operands paired by prmt; m16n8k8 is the attention's alone."""
    art = compiled(name, batch)
    what = _what(name, batch, art)
    d = get_preset(name).head_dim
    per_tile = 2 * (d // 16)                       # the output's MMAs of one tile (and the scores', as m16n8k16)
    tiles = MMA_TILES[d] + 1                       # a step's tiles, and the new token's
    hmma8 = re.findall(r"\bHMMA\.1688\.F32\.BF16\b", art["sass"])
    assert len(hmma8) == per_tile * tiles, f"{what}: {len(hmma8)} HMMA.1688.F32.BF16, expected {per_tile * tiles}"
    assert len(re.findall(r"\bPRMT\b", art["sass"])) >= per_tile * tiles, f"{what}: the values' operands unpaired"


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_batch_1_hands_x_h_act_and_qkv_on_as_flagged_words_and_batch_2_does_not(name):
    """At batch 1 (instructions.flagged) x, h, act and qkv are {value, epoch} words: EMBED's octet of columns (8),
    GATE_UP's and the other matvecs' epilogue stores (at least 1 each: the compiler may unroll) are 64-bit stores at
    gpu scope, and the polled staging (2) and the attention's poll of q, k and v (at least 1) load 16 bytes (two
    words) at gpu scope; at batch 2 neither is in the SASS (float32 stores, counter waits)."""
    for batch in (1, 2):
        art = compiled(name, batch)
        what = _what(name, batch, art)
        stores = len(re.findall(r"\bSTG\.E\.64\.STRONG\.GPU\b", art["sass"]))
        polls = len(re.findall(r"\bLDG\.E\.128\.STRONG\.GPU\b", art["sass"]))
        if batch == 1:
            assert stores >= 8 + 2 and polls >= 2 + 1, f"{what}: {stores} flagged stores, {polls} polled loads"
        else:
            assert stores == 0 and polls == 0, f"{what}: {stores} flagged stores, {polls} polled loads at batch 2"


@pytest.mark.parametrize("name,batch", REAL_CASES)
def test_no_local_memory_spills_on_real_presets(name, batch):
    art = compiled(name, batch)
    what = _what(name, batch, art)
    assert art["spills"] == 0, f"{what}: local-memory loads/stores in the SASS"
    assert art["usage"].get("frame_bytes", 0) == 0, f"{what}: a stack frame"


# The batches between, as the engine lays them out. Register pressure changes with the batch (the work
# item's shape, accumulators, 15 or 8 consumer warps), so every batch is compiled.
MID_CASES = [(name, batch) for name in REAL_PRESETS for batch in range(2, 8)]


@pytest.mark.parametrize("name,batch", MID_CASES)
def test_no_local_memory_spills_at_every_batch_of_the_engines_layout(name, batch):
    art = compiled(name, batch)
    what = _what(name, batch, art)
    assert art["spills"] == 0, f"{what}: local-memory loads/stores in the SASS"
    assert art["usage"].get("frame_bytes", 0) == 0, f"{what}: a stack frame"
    dk = art["device_code"]
    assert dk.smem_bytes() <= 227 * 1024 and dk.ring_slots >= 4, what


# Batches whose widest input row (batch x K float32) exceeds what is staged whole: the matvecs stage
# and consume K one column slab at a time.
SLAB_CASES = [("llama-3.2-1b", 8), ("llama-3.1-8b", 4), ("llama-3.1-8b", 8)]


@pytest.mark.parametrize("name,batch", SLAB_CASES)
def test_slab_staging_compiles_without_spills(name, batch):
    art = compiled(name, batch)
    config = get_preset(name)
    plan = art["device_code"].plan
    down = plan.geometry(config.intermediate_size)
    what = _what(name, batch, art) + f" DOWN slabs {down.n_slab} x {down.slab_cols}"
    assert not down.x_whole and down.n_slab > 1, f"{what}: the kernel stages DOWN's input whole"
    assert plan.x_floats == batch * max(g.x_stride for g in plan.by_k.values()) < batch * config.intermediate_size, what
    assert art["spills"] == 0 and art["usage"].get("frame_bytes", 0) == 0, \
        f"{what}: local-memory loads/stores in the SASS"


# A short cache (the perf suite's 32-token context: a 256-position cache) gets 4 KV splits where the cases above
# get 16 at batch 1; O_PROJ's merge then loads two quads per thread per round.
SHORT_CASES = [(name, batch) for name in REAL_PRESETS for batch in (1, 2)]


@pytest.mark.parametrize("name,batch", SHORT_CASES)
def test_short_cache_layouts_compile_without_spills(name, batch):
    art = compiled(name, batch, split_seq_len=256)
    what = _what(name, batch, art) + f" splits={art['device_code'].S}"
    assert art["device_code"].S < compiled(name, batch)["device_code"].S, what
    assert art["spills"] == 0 and art["usage"].get("frame_bytes", 0) == 0, \
        f"{what}: local-memory loads/stores in the SASS"


# Batches past SPLIT_BATCH: the wide consumers (row-group owners) and, on the real widths, the tiles of K ranges and
# MV_REDUCE. llama-3.2-1b at 16 compiles without spills; at 32 and 64 the real presets still spill a few registers
# (docs/batch_path.md), which these cases do not hide: they check the stream and the MMAs, and the shared memory.
WIDE_CASES = [("llama-3.2-1b", 16), ("tiny-llama", 64), ("llama-3.1-8b", 32), ("qwen3-0.6b", 20)]


def wgmma_sets(sass: str) -> list[list[str]]:
    """The SASS's runs of wgmmas (HGMMA with float32 accumulators; no gap of 60 instructions): a warpgroup's set
    of row groups over one slab."""
    ins = [line.split("*/", 1)[1].strip() for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
    at = [i for i, x in enumerate(ins) if re.search(r"\bHGMMA\.\S+\.F32\.BF16\b", x)]
    runs = [[at[0]]]
    for i in at[1:]:
        if i - runs[-1][-1] < 60:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [ins[r[0]:r[-1] + 1] for r in runs]


@pytest.mark.parametrize("name,batch", WIDE_CASES)
def test_wide_batches_stream_and_multiply(name, batch):
    art = compiled(name, batch)
    what = _what(name, batch, art)
    dk = art["device_code"]
    assert dk.wide and dk.warps == 8, what
    assert re.search(r"\bUBLKCP\b", art["sass"]), f"{what}: no UBLKCP in the SASS"
    assert_hop_word_atomic(art, what)
    assert 4 <= dk.ring_slots and dk.smem_bytes() <= 227 * 1024, what
    if name != "tiny-llama":
        assert dk.split_widths, f"{what}: no stage split over K"
    if (name, batch) == ("llama-3.2-1b", 16):
        assert art["spills"] == 0 and art["usage"].get("frame_bytes", 0) == 0, what
    # the MMA loop (wgmma_set): a wgmma m64nNk16 per k-step of a slab for each row group a warp owns (N = the padded
    # batch), its A registers loaded from the slot and B read from the staged input by the tensor cores; nothing
    # spilled between them
    n = dk.wgmma_n()
    hg = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\.BF16\b", art["sass"])
    assert hg and set(hg) == {str(n)}, f"{what}: wgmmas {sorted(set(hg))}, expected N = {n}"
    assert len(hg) == SLAB_COLS // 16 * dk.wide_groups, f"{what}: {len(hg)} wgmmas"
    assert not re.search(r"\bHMMA\b", art["sass"]), f"{what}: an mma.sync left in the wide kernel"
    for body in wgmma_sets(art["sass"]):
        assert not any(re.search(r"\b(LDL|STL)\b", x) for x in body), f"{what}: a spill among the wgmmas"
    # the inputs, every one pre-staged by its producer (matvec_wide.input_window; no consumer stages the B operand
    # with ordinary stores): one bulk copy per window under an L2 policy that keeps them for the other SMs, after a
    # proxy fence that orders the producers' stores (acquired through the counter) and the consumers' earlier
    # generic accesses of the window before the copy engine's
    assert "createpolicy.fractional.L2::evict_last" in art["ptx"], f"{what}: no input copy under evict_last"
    assert re.search(r"fence\.proxy\.async;", art["ptx"]), f"{what}: no proxy fence before the input copy"
    assert re.search(r"\bFENCE\.VIEW\.ASYNC\.S\b", art["sass"]), f"{what}: no proxy fence in the SASS"
    assert len(re.findall(r"cp\.async\.bulk\.shared::cluster\.global", art["ptx"])) >= 2, \
        f"{what}: the weights' bulk copies and no input copy"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_compiles_with_its_exchanges(rank, batch):
    """A rank of llama-3.2-1b split two ways (schedule.tensor_parallel's program, the rank's shard): no spills,
    and its exchange stages signal with a system-scope release (a peer GPU's counter); the one-GPU kernel has none."""
    from megakernel.schedule.tensor_parallel import build_tp_program
    lay = StepLayout(config=get_preset("llama-3.2-1b"), batch=batch, kv_splits=1, block_size=16,
                     max_blocks_per_seq=32, num_sms=66)
    prog = build_tp_program(lay, 2)
    table, _ = serialize(assign(prog, "balanced"))
    key = KernelKey(layout=prog.rank_layout(rank), lm_tiles=2 * prog.lm_tiles, num_counters=prog.num_counters,
                    max_queue_len=table.shape[1], kv_strides=None, options=KernelOptions())
    kernel = compile_decode_kernel(key, keep_artifacts=True)
    text = sass(kernel.__cubin__)
    what = f"llama-3.2-1b TP=2 rank {rank} batch={batch}"
    assert spill_instructions(text) == 0, f"{what}: local-memory loads/stores in the SASS"
    assert "red.release.sys.global.add.s32" in kernel.__ptx__, f"{what}: no system-scope release"
    assert "red.release.sys" not in compiled("llama-3.2-1b", batch)["ptx"], "the one-GPU kernel signals a peer"


def test_a_tensor_parallel_rank_without_the_lm_head_compiles_with_no_argmax_slots():
    """vLLM's ranks run the program without TP_LM_HEAD and ARGMAX (build_tp_program(lm_head=False)): the key the
    runtime compiles it with has no argmax slots (world_size x 0 LM head tiles), as the dense engine's lm_head=False;
    the kernel compiles without spills and still signals its exchanges at system scope."""
    from megakernel.schedule.tensor_parallel import build_tp_program
    lay = StepLayout(config=get_preset("llama-3.2-1b"), batch=1, kv_splits=1, block_size=16, max_blocks_per_seq=32,
                     num_sms=132, scratch_block=0)
    prog = build_tp_program(lay, 2, lm_head=False)
    assert prog.lm_tiles == 0 and not prog.has_lm_head
    table, _ = serialize(assign(prog, "balanced"))
    # (vLLM's interleaved K|V cache strides for the rank's 4 kv heads of dim 64)
    key = KernelKey(layout=prog.rank_layout(1), lm_tiles=2 * prog.lm_tiles, num_counters=prog.num_counters,
                    max_queue_len=table.shape[1], kv_strides=(16 * 4 * 128, 4 * 128, 128), options=KernelOptions())
    kernel = compile_decode_kernel(key, keep_artifacts=True)
    what = "llama-3.2-1b TP=2 rank 1 batch=1 without the LM head"
    assert spill_instructions(sass(kernel.__cubin__)) == 0, f"{what}: local-memory loads/stores in the SASS"
    assert "red.release.sys.global.add.s32" in kernel.__ptx__, f"{what}: no system-scope release"
