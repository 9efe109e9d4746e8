"""MegakernelEngine's optional constructor options (docs/vllm.md, "What the engine / kernel must provide"):
lm_head=False, packed_weights=, own_kv_cache=False.

CPU: the checks of packed weights (validate_packed_weights), the engine's guards (no next tokens without an
LM head, no launch before a KV cache is bound) on an engine object built without its constructor (which needs
a GPU), the signature the vLLM integration detects, and one sm_90a compile of the kernel of a program without
LM head (lm_tiles = 0). The program and the VM without LM head are tested in test_schedule.py and test_vm.py.
GPU (marker `gpu`): the same options on real engines against engines without them, on the same inputs.

The root conftest.py sets the target (CUTE_DSL_ARCH=sm_90a) and a private artifact folder before cutlass
is first imported (cutlass is only imported inside tests).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from megakernel.instructions.layout import (KERNEL_MAX_BATCH, MAX_BATCH, PackedWeights, StepLayout, allocate_buffers,
                                            default_kv_splits, pack_weights, validate_packed_weights)
from megakernel.integrations import vllm_mapping, vllm_model
from megakernel.model.kv_cache import contiguous_block_table
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.schedule import build_program
from megakernel.testing.tolerances import assert_close

GPU = "cuda"
BF16 = torch.bfloat16


def _layout(name: str = "tiny-qwen3", batch: int = 2, max_seq_len: int = 40, block_size: int = 16,
            num_sms: int = 132, **layout_options) -> StepLayout:
    """The layout MegakernelEngine builds for these arguments (and StepLayout options such as fold_embed)."""
    config = get_preset(name)
    blocks = -(-max_seq_len // block_size)
    splits = default_kv_splits(config, batch, num_sms, blocks * block_size)
    return StepLayout(config=config, batch=batch, kv_splits=splits, block_size=block_size, max_blocks_per_seq=blocks,
                      num_sms=num_sms, **layout_options)


def _compile_without_spills(layout: StepLayout, program, options, what: str, kv_strides=None, max_regs: int = 255):
    """Compile the kernel of `program` for sm_90a (no GPU) -> the compiled kernel, after checking its cubin:
    an ELF, at most max_regs registers, no stack frame, and (where nvdisasm exists) no local-memory
    loads or stores in the SASS."""
    from megakernel.instructions.record import serialize
    from megakernel.kernel.compile import (KernelKey, compile_decode_kernel, nvdisasm_path, resource_usage, sass,
                                           spill_instructions)
    from megakernel.schedule import assign

    table, _ = serialize(assign(program, "balanced"))
    key = KernelKey(layout, program.lm_tiles, program.num_counters, table.shape[1], kv_strides, options)
    kernel = compile_decode_kernel(key, keep_artifacts=True)
    cubin = kernel.__cubin__
    assert cubin[:4] == b"\x7fELF", what
    usage = resource_usage(cubin)
    assert 0 < usage.get("regs", 0) <= max_regs and usage.get("frame_bytes", 0) == 0, f"{what}: {usage}"
    if nvdisasm_path() is not None:
        assert spill_instructions(sass(cubin)) == 0, f"{what}: local-memory loads/stores in the SASS"
    return kernel


@pytest.mark.parametrize("spec,message", [("wide_groups=3", r"wide_groups=3: 0 \(by the batch and tiles\), 1 or 2"),
                                          ("timeout_ns=0", r"timeout_ns=0: every wait needs a positive bound"),
                                          ("max_in_flight=-1", r"max_in_flight=-1: 0 \(by the batch and the")])
def test_kernel_options_out_of_range_are_refused_when_parsed(spec, message):
    """A kernel option outside what the device code is built for is refused where it is parsed (`megakernel
    bench --kernel-options`, tools/gpu_sweep.py), before a compile or a launch."""
    from megakernel.kernel.interpreter import KernelOptions
    from megakernel.runtime.engine import split_engine_options

    kernel_kw, _ = split_engine_options(spec)
    with pytest.raises(ValueError, match=message):
        KernelOptions(**kernel_kw)


# ---- packed_weights: what the engine accepts --------------------------------------------------------------

@pytest.mark.parametrize("name", ("tiny-llama", "tiny-qwen3"))
def test_pack_weights_output_is_accepted_when_it_covers_the_cache(name):
    """max_seq_len 40 in blocks of 16: the engine decodes positions up to 47, so RoPE tables of 40 rows are
    refused and 48 (what the vLLM integration packs: rope_positions) or more accepted."""
    layout = _layout(name, max_seq_len=40, block_size=16)
    assert layout.max_seq_len == 48 == vllm_mapping.rope_positions(40, 16)
    weights = random_weights(layout.config, seed=21, dtype=BF16)
    for rows in (48, 64):
        validate_packed_weights(pack_weights(weights, rows), layout, "cpu")
    message = r"packed_weights\.rope_cos has 40 positions.*up to 47.*pack_weights\(weights, 48\)"
    with pytest.raises(ValueError, match=message):
        validate_packed_weights(pack_weights(weights, 40), layout, "cpu")


def _bad(packed: PackedWeights, field: str, value) -> PackedWeights:
    return dataclasses.replace(packed, **{field: value})


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and values as t, with a row stride twice its width."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and values as t, contiguous, starting one element (2 bytes) past an aligned address."""
    flat = torch.cat([t.flatten()[:1], t.flatten()])
    return flat[1:].view(t.shape)


REFUSED = {
    # case: (field, how to break it, message)
    "qkv-of-fewer-layers": ("qkv", lambda t: t[:-1].clone(),
                            r"packed_weights\.qkv has shape \(1, 1024, 256\); tiny-qwen3 needs \(2, 1024, 256\)"),
    "embed-other-vocab": ("embed", lambda t: t[:-8].clone(), r"packed_weights\.embed has shape \(1016, 256\)"),
    "final-norm-float32": ("final_norm", lambda t: t.float(),
                           r"packed_weights\.final_norm is torch\.float32; the kernel reads torch\.bfloat16"),
    "down-float32": ("down", lambda t: t.float(), r"packed_weights\.down is torch\.float32"),
    "rope-bf16": ("rope_sin", lambda t: t.to(BF16),
                  r"packed_weights\.rope_sin is torch\.bfloat16; the kernel reads torch\.float32"),
    "rope-other-head-dim": ("rope_cos", lambda t: t[:, :-1].clone(),
                            r"packed_weights\.rope_cos has shape \(48, 63\); expected \(positions, 64\)"),
    "rope-short": ("rope_sin", lambda t: t[:47].clone(), r"packed_weights\.rope_sin has 47 positions"),
    "gate-up-strided": ("gate_up", _non_contiguous, r"packed_weights\.gate_up must be contiguous"),
    "lm-head-misaligned": ("lm_head", _misaligned, r"packed_weights\.lm_head must be contiguous and 16-byte aligned"),
    "k-norm-on-meta": ("k_norm", lambda t: t.to("meta"),
                       r"packed_weights\.k_norm is on meta; the engine runs on cpu"),
    "o-proj-missing": ("o_proj", lambda t: None, r"packed_weights\.o_proj is a NoneType, not a tensor"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_packed_weights_that_do_not_fit_are_refused_naming_the_field(case):
    field, breaker, message = REFUSED[case]
    layout = _layout("tiny-qwen3", max_seq_len=40, block_size=16)
    weights = random_weights(layout.config, seed=22, dtype=BF16)
    packed = pack_weights(weights, layout.max_seq_len)
    validate_packed_weights(packed, layout, "cpu")                 # the unbroken weights pass
    with pytest.raises(ValueError, match=message):
        validate_packed_weights(_bad(packed, field, breaker(getattr(packed, field))), layout, "cpu")


def test_packed_weights_of_another_model_or_type_are_refused():
    layout = _layout("tiny-qwen3")
    other = pack_weights(random_weights(get_preset("tiny-llama"), seed=23, dtype=BF16), layout.max_seq_len)
    with pytest.raises(ValueError, match=r"packed_weights\.\w+ has shape .* tiny-qwen3 needs"):
        validate_packed_weights(other, layout, "cpu")
    with pytest.raises(ValueError, match="packed_weights must be a PackedWeights .* got dict"):
        validate_packed_weights(dataclasses.asdict(other), layout, "cpu")


# ---- the engine: signature and guards ---------------------------------------------------------------------

def test_an_engines_own_kv_cache_is_nan_filled_and_its_layers_are_in_the_kernels_table():
    """allocate_kv_cache (MegakernelEngine's and a tensor-parallel rank's own cache): [layers, blocks, block_size,
    Hkv, D] bf16 of NaN, every layer's K and V address in the table (poisoned first), the per-layer strides, and
    the contiguous block table where the blocks suffice (left alone where they do not)."""
    from megakernel.runtime.engine import allocate_kv_cache
    layout = _layout("tiny-llama", batch=2, max_seq_len=40, block_size=16)
    c = layout.config
    table = torch.full((c.num_layers, 2), -1, dtype=torch.int64)
    poison = torch.full((2, layout.max_blocks_per_seq), -7, dtype=torch.int32)
    block_table = poison.clone()
    allocate_kv_cache(layout, 2 * layout.max_blocks_per_seq - 1, table, block_table, torch.device("cpu"))
    assert torch.equal(block_table, poison), "a block table set where the blocks do not suffice"
    k, v, strides = allocate_kv_cache(layout, 7, table, block_table, torch.device("cpu"))
    assert torch.equal(block_table, contiguous_block_table(2, layout.max_seq_len, 16)), block_table
    assert k.shape == v.shape == (c.num_layers, 7, 16, c.num_kv_heads, c.head_dim)
    assert k.dtype == v.dtype == BF16 and k.data_ptr() != v.data_ptr()
    assert torch.isnan(k).all() and torch.isnan(v).all()
    assert table.tolist() == [[k[i].data_ptr(), v[i].data_ptr()] for i in range(c.num_layers)]
    assert strides == (16 * c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim) == k[0].stride()[:3]


def test_engine_signature_offers_the_options_the_vllm_integration_detects():
    from megakernel.runtime.engine import MegakernelEngine

    params = inspect.signature(MegakernelEngine).parameters
    defaults = {name: params[name].default for name in ("own_kv_cache", "packed_weights", "lm_head")}
    assert defaults == {"own_kv_cache": True, "packed_weights": None, "lm_head": True}, defaults
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in defaults)
    want = dict(packed_weights=object(), own_kv_cache=False, lm_head=False)
    assert vllm_mapping.engine_kwargs(MegakernelEngine, **want) == want


def _engine_without_gpu(lm_head: bool, bound: bool):
    """A MegakernelEngine object with the state its constructor leaves for these options, without the
    constructor (which needs a GPU): a program, CPU buffers, and no kernel when no cache is bound."""
    from megakernel.runtime.engine import MegakernelEngine

    layout = _layout("tiny-llama", batch=2, max_seq_len=32)
    eng = object.__new__(MegakernelEngine)
    eng.layout = layout
    eng.program = build_program(layout, lm_head=lm_head)
    eng.bufs = allocate_buffers(layout, eng.program.lm_tiles, eng.program.num_counters)
    eng.device = torch.device("cpu")
    eng.num_blocks = None if not bound else 2 * layout.max_blocks_per_seq
    eng.compiled = None if not bound else object()
    return eng


def test_engine_without_lm_head_has_no_step_tokens_or_logits():
    eng = _engine_without_gpu(lm_head=False, bound=True)
    assert not eng.has_lm_head and eng.bufs.logits.shape == (2, 0) and eng.bufs.lm_max.shape == (2, 0)
    table = contiguous_block_table(2, 32, 16)
    tokens = torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match=r"step\(\): this engine was built with lm_head=False.*step_hidden"):
        eng.step(tokens, torch.tensor([0, 0]), table)
    with pytest.raises(RuntimeError, match="lm_head=False.*bufs.x"):
        _ = eng.logits
    assert torch.equal(eng.bufs.tokens, torch.zeros(2, dtype=torch.int32)), "step() copied inputs before refusing"
    assert _engine_without_gpu(lm_head=True, bound=True).has_lm_head


@pytest.mark.parametrize("lm_head", (True, False))
def test_engine_without_a_bound_cache_refuses_to_launch(lm_head):
    """own_kv_cache=False before bind_kv_caches: no kernel to launch on a null address table."""
    eng = _engine_without_gpu(lm_head=lm_head, bound=False)
    assert not eng.kv_bound
    table = contiguous_block_table(2, 32, 16)
    tokens, positions = torch.tensor([3, 4]), torch.tensor([0, 0])
    with pytest.raises(RuntimeError, match=r"launch\(\) before bind_kv_caches\(\).*own_kv_cache=False"):
        eng.launch()
    with pytest.raises(RuntimeError, match=r"step_hidden\(\) before bind_kv_caches\(\)"):
        eng.step_hidden(tokens, positions, table)
    with pytest.raises(RuntimeError, match=r"set_inputs\(\) before bind_kv_caches\(\)"):
        eng.set_inputs(tokens, positions, table)
    if lm_head:
        with pytest.raises(RuntimeError, match=r"step\(\) before bind_kv_caches\(\)"):
            eng.step(tokens, positions, table)
    assert not eng.bufs.tokens.any() and not eng.bufs.block_table.any(), "inputs copied before the refusal"


@pytest.mark.parametrize("option", ("lm_head", "own_kv_cache"))
def test_decode_backend_refuses_options_it_cannot_serve(option):
    """The DecodeBackend returns the kernel's own next tokens from the engine's own cache."""
    from megakernel.runtime.engine import MegakernelBackend

    weights = random_weights(get_preset("tiny-llama"), seed=24, dtype=BF16)
    with pytest.raises(ValueError, match=f"{option}=False"):
        MegakernelBackend(weights, device="cpu", **{option: False})


class _EngineTakingEverything:
    """Records the keywords the vLLM adapter builds an engine with (CPU stand-in)."""

    def __init__(self, weights, batch, max_seq_len, *, block_size=16, device="cpu", packed_weights=None,
                 own_kv_cache=True, lm_head=True, fold_embed=True, options=None):
        self.kw = dict(block_size=block_size, packed_weights=packed_weights, own_kv_cache=own_kv_cache,
                       lm_head=lm_head, fold_embed=fold_embed, options=options)
        self.bufs = SimpleNamespace(block_table=torch.full((batch, -(-max_seq_len // block_size)), -1))
        self.bound = None

    def bind_kv_caches(self, k, v):
        self.bound = (k, v)


@pytest.mark.parametrize("cache_block_size,shared", [(16, True), (8, True), (32, False)])
def test_vllm_adapter_shares_packed_weights_only_where_they_cover_the_engine(cache_block_size, shared):
    """The adapter packs once for max_model_len rounded up to cache_config's block size (40 -> 48); an engine
    on a cache of larger blocks (40 -> 64 positions) packs its own instead of being refused; every engine is
    built without its own cache and LM head, and bound before anything else happens to it."""
    config = get_preset("tiny-llama")
    weights = random_weights(config, seed=25, dtype=BF16)
    adapter = object.__new__(vllm_model.MegakernelDecode)
    adapter.max_seq_len, adapter.block_size, adapter.buckets = 40, 16, (1, 2, 4, 8)
    adapter.engines, adapter.engine_cls, adapter.weights, adapter.device = {}, _EngineTakingEverything, weights, "cpu"
    adapter.disabled = None
    adapter.layout_kw = {"fold_embed": False, "options": "pinned"}     # a layout pinned for vLLM reaches it
    adapter.packed = pack_weights(weights, vllm_mapping.rope_positions(adapter.max_seq_len, adapter.block_size))
    assert adapter.packed.rope_cos.shape[0] == 48
    k = [torch.zeros(4, cache_block_size, config.num_kv_heads, config.head_dim, dtype=BF16)] * config.num_layers
    geom = vllm_mapping.KVGeometry(num_blocks=4, block_size=cache_block_size, num_kv_heads=config.num_kv_heads,
                                 head_dim=config.head_dim, block_stride=0, token_stride=0, head_stride=0)
    adapter.kv = (k, k, geom)
    eng = adapter._engine(3)
    assert adapter.disabled is None and adapter.engines == {4: eng}
    assert eng.kw["own_kv_cache"] is False and eng.kw["lm_head"] is False and eng.kw["block_size"] == cache_block_size
    assert eng.kw["fold_embed"] is False and eng.kw["options"] == "pinned", eng.kw
    assert (eng.kw["packed_weights"] is adapter.packed) == shared, eng.kw
    assert eng.bound == (k, k) and not eng.bufs.block_table.any()


# ---- the kernel of a program without LM head compiles --------------------------------------------------

def test_kernel_without_lm_head_compiles_for_sm90a():
    """The vLLM engine's kernel: llama-3.2-1b at batch 8, lm_tiles = 0, vLLM's interleaved K|V strides."""
    from megakernel.kernel.interpreter import KernelOptions

    layout = _layout("llama-3.2-1b", batch=8, max_seq_len=256, block_size=16)
    program = build_program(layout, lm_head=False)
    assert program.lm_tiles == 0
    c = layout.config
    strides = (16 * c.num_kv_heads * 2 * c.head_dim, c.num_kv_heads * 2 * c.head_dim, 2 * c.head_dim)
    what = f"llama-3.2-1b batch=8 lm_tiles=0 strides={strides}"
    kernel = _compile_without_spills(layout, program, KernelOptions(), what, kv_strides=strides)
    assert re.search(r"\.entry\s+kernel_", kernel.__ptx__), f"{what}: no kernel entry in the PTX"
    assert re.search(r"^\s*\.target\s+sm_90a\b", kernel.__ptx__, re.MULTILINE), f"{what}: PTX not for sm_90a"


@pytest.mark.parametrize("name,batch", [("llama-3.2-1b", 1), ("qwen3-0.6b", 4), ("llama-3.1-8b", 1)])
def test_folded_embed_kernel_compiles_without_spills(name, batch):
    """StepLayout(fold_embed=True): layer 0's QKV tiles stage embed[token] (16-bit loads of the table) and
    wait on nothing."""
    from megakernel.kernel.interpreter import KernelOptions

    layout = _layout(name, batch, max_seq_len=256, block_size=16, fold_embed=True)
    assert layout.embed_folded, name
    program = build_program(layout)
    qkv0 = [i for i in program.instructions if i.opcode.name == "QKV" and i.layer == 0]
    assert qkv0 and all(i.a3 == 1 and i.wait_id < 0 for i in qkv0), name
    _compile_without_spills(layout, program, KernelOptions(), f"{name} batch={batch} fold_embed", max_regs=128)


# ---- GPU: real engines -------------------------------------------------------------------------------------

BATCH, MAX_SEQ_LEN, BLOCK_SIZE, STEPS = 3, 40, 16, 20   # positions up to 19: two blocks of 16
OFFSETS = torch.tensor([0, 2, 5])          # sequences start at different steps: different positions


def _gpu_weights(seed: int, name: str = "tiny-qwen3"):
    return random_weights(get_preset(name), seed=seed, dtype=BF16, device=GPU, rng_device=GPU)


def _steps(config, seed: int):
    """(tokens, positions) of STEPS decode steps: fresh random tokens (teacher-forced), rising positions."""
    gen = torch.Generator().manual_seed(seed)
    for t in range(STEPS):
        yield (torch.randint(0, config.vocab_size, (BATCH,), generator=gen).int(),
               (t - OFFSETS).clamp(min=0).int())


def _run(engine, tokens, positions, table) -> torch.Tensor:
    """Load the inputs, poison x, one launch, check the error word -> x[L] (a copy)."""
    engine.set_inputs(tokens, positions, table)
    engine.bufs.x.fill_(float("nan"))
    engine.launch()
    engine.check()
    return engine.bufs.x[-1].clone()


@pytest.mark.gpu
@pytest.mark.hopper
def test_engine_without_lm_head_writes_the_x_L_of_the_full_engine():
    from megakernel.runtime.engine import MegakernelEngine

    weights = _gpu_weights(31)
    c = weights.config
    full = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, block_size=BLOCK_SIZE, device=GPU)
    bare = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, block_size=BLOCK_SIZE, device=GPU, lm_head=False)
    assert bare.key.lm_tiles == 0 and bare.program.lm_tiles == 0 and full.key.lm_tiles > 0
    assert len(bare.program.instructions) == len(full.program.instructions) - full.program.lm_tiles - 1
    table = contiguous_block_table(BATCH, MAX_SEQ_LEN, BLOCK_SIZE, GPU)
    for t, (tokens, positions) in enumerate(_steps(c, 31)):
        what = f"tiny-qwen3 seed=31 batch={BATCH} step {t} positions {positions.tolist()}"
        x_full = _run(full, tokens, positions, table)
        bare.bufs.out_tokens.fill_(-7)
        x_bare = _run(bare, tokens, positions, table)
        assert not torch.isnan(x_bare).any(), f"{what}: x[L] not fully written"
        assert_close(x_bare, x_full, torch.float32, context=f"{what}: x[L] without vs with the LM head")
        # nothing advanced the inputs or wrote the next tokens; the full engine's ARGMAX did advance its own
        assert torch.equal(bare.bufs.tokens.cpu(), tokens) and torch.equal(bare.bufs.positions.cpu(), positions), what
        assert (bare.bufs.out_tokens == -7).all(), what
        assert torch.equal(full.bufs.positions.cpu(), positions + 1), what
        assert torch.equal(full.bufs.out_tokens.cpu(), full.bufs.logits.argmax(-1).int().cpu()), what
        # step_hidden, the checked path, gives the same x[L] (the cache slots it rewrites hold the same K/V)
        assert_close(bare.step_hidden(tokens, positions, table).clone(), x_bare, torch.float32, context=what)
    with pytest.raises(RuntimeError, match="lm_head=False"):
        bare.step(tokens, positions, table)


@pytest.mark.gpu
@pytest.mark.hopper
def test_engines_sharing_packed_weights_give_identical_logits():
    from megakernel.runtime.engine import MegakernelEngine

    weights = _gpu_weights(32)
    c = weights.config
    kw = dict(block_size=BLOCK_SIZE, device=GPU)
    rows = vllm_mapping.rope_positions(MAX_SEQ_LEN, BLOCK_SIZE)
    packed = pack_weights(weights, rows).to(GPU)
    a = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=packed, **kw)
    b = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=packed, **kw)
    own = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, **kw)
    assert a.weights is packed and b.weights is packed and own.weights is not packed
    assert a._arg_tensors()["w_qkv"].data_ptr() == b._arg_tensors()["w_qkv"].data_ptr() == packed.qkv.data_ptr()
    table = contiguous_block_table(BATCH, MAX_SEQ_LEN, BLOCK_SIZE, GPU)
    for t, (tokens, positions) in enumerate(_steps(c, 32)):
        what = f"tiny-qwen3 seed=32 step {t} positions {positions.tolist()}"
        logits = []
        for eng in (a, b, own):
            eng.bufs.logits.fill_(float("nan"))
            eng.step(tokens, positions, table)
            logits.append(eng.logits.clone())
        assert not torch.isnan(logits[0]).any(), what
        assert torch.equal(logits[0], logits[1]), f"{what}: two engines on one packed copy differ"
        assert torch.equal(logits[0], logits[2]), f"{what}: shared packed weights differ from the engine's own"
    with pytest.raises(ValueError, match=r"packed_weights\.rope_cos has 40 positions"):
        MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=pack_weights(weights, MAX_SEQ_LEN).to(GPU), **kw)
    with pytest.raises(ValueError, match=r"packed_weights\.embed is on cpu"):
        MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=pack_weights(weights.to("cpu"), rows), **kw)


def _vllm_cache(config, num_blocks: int):
    """Per-layer K and V views of vLLM 0.26's FlashAttention cache, NaN: logical (blocks, kv heads, block
    size, 2 * head_dim) in NHD memory order, K and V interleaved in the last dim, split as the adapter does."""
    hkv, d = config.num_kv_heads, config.head_dim
    ks, vs = [], []
    for _ in range(config.num_layers):
        kv = torch.full((num_blocks, BLOCK_SIZE, hkv, 2 * d), float("nan"), dtype=BF16, device=GPU).transpose(1, 2)
        k, v = vllm_mapping.split_kv_cache(kv, hkv, d)
        assert k.stride() == (BLOCK_SIZE * hkv * 2 * d, hkv * 2 * d, 2 * d, 1) and v.data_ptr() == k.data_ptr() + 2 * d
        ks.append(k)
        vs.append(v)
    return ks, vs


@pytest.mark.gpu
@pytest.mark.hopper
def test_engine_without_own_cache_runs_on_the_cache_it_is_bound_to():
    from megakernel.runtime.engine import MegakernelEngine

    weights = _gpu_weights(33)
    c = weights.config
    kw = dict(block_size=BLOCK_SIZE, device=GPU, lm_head=False)
    packed = pack_weights(weights, vllm_mapping.rope_positions(MAX_SEQ_LEN, BLOCK_SIZE)).to(GPU)
    own = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=packed, **kw)
    with pytest.raises(ValueError, match="num_blocks=9 sizes the engine's own KV cache"):
        MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=packed, own_kv_cache=False, num_blocks=9, **kw)
    table = contiguous_block_table(BATCH, MAX_SEQ_LEN, BLOCK_SIZE, GPU)
    tokens, positions = next(_steps(c, 33))
    for layout_name in ("engine", "vllm"):
        eng = MegakernelEngine(weights, BATCH, MAX_SEQ_LEN, packed_weights=packed, own_kv_cache=False, **kw)
        assert eng.k_cache is None and eng.v_cache is None and not eng.kv_bound and eng.compiled is None
        assert eng.num_blocks is None and not eng.kv_table.any(), "an address table before any cache is bound"
        with pytest.raises(RuntimeError, match=r"launch\(\) before bind_kv_caches\(\)"):
            eng.launch()
        with pytest.raises(RuntimeError, match=r"step_hidden\(\) before bind_kv_caches\(\)"):
            eng.step_hidden(tokens, positions, table)
        num_blocks = BATCH * 3 + 4                   # a pool larger than the table uses, like vLLM's
        if layout_name == "engine":
            k_all = torch.full((c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim), float("nan"),
                               dtype=BF16, device=GPU)
            v_all = torch.full_like(k_all, float("nan"))
            ks, vs = list(k_all.unbind(0)), list(v_all.unbind(0))
        else:
            ks, vs = _vllm_cache(c, num_blocks)
        eng.bind_kv_caches(ks, vs)
        assert eng.kv_bound and eng.num_blocks == num_blocks and eng.key.kv_strides == tuple(ks[0].stride()[:3])
        # blocks of the pool in a shuffled order, as vLLM hands them out
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(33))[: BATCH * 3]
        shuffled = perm.view(BATCH, 3).int().to(GPU)
        own.k_cache.fill_(float("nan"))
        own.v_cache.fill_(float("nan"))
        for t, (tokens, positions) in enumerate(_steps(c, 33)):
            what = f"tiny-qwen3 seed=33 {layout_name} cache step {t} positions {positions.tolist()}"
            x_own = _run(own, tokens, positions, table)
            x_bound = _run(eng, tokens, positions, shuffled)
            assert not torch.isnan(x_bound).any(), what
            assert_close(x_bound, x_own, torch.float32, context=f"{what}: bound cache vs the engine's own")
        # the K/V of every decoded position sits where the block table says, in the caller's tensors
        for b in range(BATCH):
            for pos in range(int((STEPS - 1 - OFFSETS[b]).clamp(min=0)) + 1):
                blk, off = int(shuffled[b, pos // BLOCK_SIZE]), pos % BLOCK_SIZE
                mine_blk = int(table[b, pos // BLOCK_SIZE])
                for layer in range(c.num_layers):
                    where = f"{layout_name} cache: sequence {b} position {pos} layer {layer}"
                    assert_close(ks[layer][blk, off], own.k_cache[layer, mine_blk, off], BF16, context=f"{where} K")
                    assert_close(vs[layer][blk, off], own.v_cache[layer, mine_blk, off], BF16, context=f"{where} V")
        untouched = sorted(set(range(num_blocks)) - set(perm.tolist()))
        assert all(torch.isnan(ks[0][n].float()).all() for n in untouched), f"{layout_name}: wrote outside the table"


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name", ("tiny-llama", "llama-3.2-1b"))
def test_bare_launch_uses_the_engines_own_contiguous_block_table(name):
    """launch() without set_inputs (benchmarks, CUDA-graph capture) runs on the engine's default block
    table: contiguous blocks per sequence, so the new token's KV append lands in its own slot and no
    split of the attention reads it. Fresh random cache history, kv_splits > 1, logits against the
    float32 reference decoder on the same cache."""
    from megakernel.model.kv_cache import PagedKVCache
    from megakernel.model.reference import ReferenceDecoder
    from megakernel.runtime.engine import MegakernelEngine

    batch, pos = 2, 32
    config = dataclasses.replace(get_preset(name), num_layers=2)      # the real shape, two layers
    weights = random_weights(config, seed=41, dtype=BF16, device=GPU, rng_device=GPU)
    eng = MegakernelEngine(weights, batch, 64, block_size=BLOCK_SIZE, kv_splits=4, device=GPU)
    table = contiguous_block_table(batch, eng.layout.max_seq_len, BLOCK_SIZE, GPU)
    assert torch.equal(eng.bufs.block_table, table), f"{name}: default block table {eng.bufs.block_table.tolist()}"
    for run in range(3):
        gen = torch.Generator(device=GPU).manual_seed(100 + run)
        eng.k_cache.normal_(generator=gen)
        eng.v_cache.normal_(generator=gen)
        cache = PagedKVCache(k=eng.k_cache.clone(), v=eng.v_cache.clone(), block_size=BLOCK_SIZE)
        tokens = torch.randint(0, weights.config.vocab_size, (batch,), generator=gen, device=GPU)
        positions = torch.full((batch,), pos, device=GPU)
        eng.bufs.poison()
        eng.reset_sync()
        eng.bufs.tokens.copy_(tokens)
        eng.bufs.positions.copy_(positions)
        eng.launch()
        eng.check()
        ref = ReferenceDecoder(weights).step(tokens, positions, cache, table.long())
        assert_close(eng.logits, ref, torch.bfloat16, context=f"{name} run {run}: bare launch at position {pos}")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant", ("fold_embed", "attn_reduce"))
@pytest.mark.parametrize("name", ("tiny-llama", "llama-3.2-1b", "qwen3-0.6b"))
def test_layout_variants_give_the_logits_of_the_shipped_engine(name, variant):
    """Against the shipped engine (fold_embed, the attention merge folded into O_PROJ): fold_embed off
    changes only where layer 0's QKV reads its input (x[0] that EMBED wrote instead of the embedding table:
    the same float32 values), so the logits and tokens are bit-identical; fuse_attn_reduce off adds the
    ATTN_REDUCE stage, which merges the splits with the same formula in its own instructions (within bf16
    tolerance). Fresh random inputs, the logits poisoned before every launch."""
    from megakernel.runtime.engine import MegakernelEngine

    config = dataclasses.replace(get_preset(name), num_layers=min(get_preset(name).num_layers, 4))
    weights = random_weights(config, seed=43, dtype=BF16, device=GPU, rng_device=GPU)
    batch = 2
    ref = MegakernelEngine(weights, batch, MAX_SEQ_LEN, block_size=BLOCK_SIZE, device=GPU)
    kw = {"fold_embed": False} if variant == "fold_embed" else {"fuse_attn_reduce": False}
    other = MegakernelEngine(weights, batch, MAX_SEQ_LEN, block_size=BLOCK_SIZE, device=GPU, **kw)
    assert ref.layout.embed_folded and ref.layout.fused_reduce, name
    assert (other.layout.embed_folded, other.layout.fused_reduce) == \
        ((False, True) if variant == "fold_embed" else (True, False)), variant
    table = contiguous_block_table(batch, MAX_SEQ_LEN, BLOCK_SIZE, GPU)
    gen = torch.Generator().manual_seed(43)
    for t in range(6):
        tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen).int()
        positions = torch.tensor([t, t + 3], dtype=torch.int32)
        out = []
        for eng in (ref, other):
            eng.bufs.logits.fill_(float("nan"))
            out.append((eng.step(tokens, positions, table).clone(), eng.logits.clone()))
        what = f"{name} (4 layers) {variant} step {t} positions {positions.tolist()}"
        assert not torch.isnan(out[1][1]).any(), f"{what}: logits not written"
        if variant == "fold_embed":
            assert torch.equal(out[0][1], out[1][1]), f"{what}: logits differ from the shipped engine's"
            assert torch.equal(out[0][0], out[1][0]), what
        else:
            assert_close(out[1][1], out[0][1], torch.bfloat16, context=what)


@pytest.mark.parametrize("batch", [0, KERNEL_MAX_BATCH + 1])
def test_the_megakernel_refuses_batches_outside_its_range_before_any_gpu_work(batch):
    """The engine and the device code refuse a batch outside 1..KERNEL_MAX_BATCH (= MAX_BATCH, the largest
    bucket) with a ValueError that names the range, before touching a GPU."""
    from megakernel.instructions.layout import require_kernel_batch
    from megakernel.runtime.engine import MegakernelEngine

    assert KERNEL_MAX_BATCH == MAX_BATCH
    config = get_preset("tiny-llama")
    refused = f"batch={batch} is outside the megakernel's range 1..{KERNEL_MAX_BATCH}"
    with pytest.raises(ValueError, match=refused):
        MegakernelEngine(random_weights(config, seed=0), batch, 64)
    with pytest.raises(ValueError, match=refused):
        require_kernel_batch(batch)


def test_error_word_names_the_instruction_and_the_sequence_it_failed_on():
    """The kernel's error word -> the message check() raises: the instruction, and for a bad position or an aliased
    slot the sequence the kernel stored beside it (an ATTN_PARTIAL past batch 8 takes several sequences, so its
    first one (a0) would name the wrong one), for a timeout the counter."""
    from megakernel.instructions.opcodes import Opcode
    from megakernel.runtime.engine import ERR_ALIAS, ERR_POSITION, ERR_TIMEOUT, ErrorWord

    layout = StepLayout(config=get_preset("tiny-llama"), batch=16, kv_splits=1, block_size=16, max_blocks_per_seq=4,
                        num_sms=2)
    program = build_program(layout)
    ins = next(i for i in program.instructions if i.opcode == Opcode.ATTN_PARTIAL and i.seqs > 1)
    seq = ins.a0 + ins.seqs - 1
    what = f"instruction #{ins.index} ATTN_PARTIAL (layer {ins.layer})"
    assert ErrorWord(ERR_POSITION, ins.index, seq, 70).describe(program) == \
        f"{what}: sequence {seq}'s position 70 is past the KV cache"
    alias = ErrorWord(ERR_ALIAS, ins.index, seq, 9).describe(program)
    assert alias.startswith(f"{what}: the KV slot of sequence {seq}'s new token (position 9)"), alias
    timeout = ErrorWord(ERR_TIMEOUT, ins.index, 12, 3).describe(program)
    assert timeout.startswith(f"{what} timed out waiting on counter 12 (last value 3)"), timeout
    polled = ErrorWord(ERR_TIMEOUT, ins.index, -1, 7).describe(program)
    assert polled.startswith(f"{what} timed out polling its flagged input for epoch 7"), polled


def test_batch_1_buffers_hold_x_h_act_and_qkv_as_value_views_of_flagged_pairs():
    """At batch 1 on one GPU (instructions.flagged) x, h, act and qkv are the value halves of float32 {value, epoch}
    pairs: the kernel's argument (data_ptr) is the pairs' base, the views index [layer, sequence, column] as at
    any batch, their epochs start at 0 (no step's), and a write through either half leaves the other as it was.
    At batch 2, and on a rank of two GPUs, nothing is flagged."""
    from megakernel.instructions.flagged import FLAGGED_BUFFERS, epoch_words, flagged_hops
    from megakernel.instructions.tensor_parallel.layout import ShardLayout, allocate_tp_buffers

    layout = _layout("tiny-llama", batch=1, max_seq_len=32)
    program = build_program(layout)
    bufs = allocate_buffers(layout, program.lm_tiles, program.num_counters)
    assert flagged_hops(layout) and len(bufs.epochs()) == len(FLAGGED_BUFFERS)
    c = layout.config
    shapes = {"x": (c.num_layers + 1, 1, c.hidden_size), "h": (c.num_layers, 1, c.hidden_size),
              "act": (c.num_layers, 1, c.intermediate_size), "qkv": (c.num_layers, 1, c.qkv_rows)}
    gen = torch.Generator().manual_seed(66)
    for name in FLAGGED_BUFFERS:
        values = getattr(bufs, name)
        epochs = epoch_words(values)
        assert values.shape == shapes[name] and values.stride(-1) == 2, (name, values.shape, values.stride())
        assert torch.isnan(values).all() and torch.equal(epochs, torch.zeros_like(epochs)), name
        assert epochs.data_ptr() == values.data_ptr() + 4, name     # {value, epoch}: the epoch 4 bytes on
        new = torch.randn(values.shape, generator=gen)
        values.copy_(new)
        epochs.fill_(7)
        assert torch.equal(values, new), f"{name}: an epoch write changed the values"
        pairs = torch.as_strided(values, (values.numel(), 2), (2, 1), values.storage_offset())
        assert torch.equal(pairs[:, 0], new.flatten()) and (pairs[:, 1].view(torch.int32) == 7).all(), name
    with pytest.raises(ValueError, match="value view of a flagged buffer"):
        epoch_words(bufs.attn_out)
    wide = _layout("tiny-llama", batch=2, max_seq_len=32)
    program2 = build_program(wide)
    assert not flagged_hops(wide) and allocate_buffers(wide, program2.lm_tiles, program2.num_counters).epochs() == []
    rank = ShardLayout.of(layout, 2, 1)
    assert not flagged_hops(rank) and allocate_tp_buffers(rank, 1, program.num_counters).epochs() == []


@pytest.mark.parametrize("batch", [1, 2])
def test_counter_waits_are_the_queue_entries_whose_counter_the_kernel_spins_on(batch):
    """MegakernelEngine.counter_waits (what the timeout tests and tools/vllm_error_path.py raise): every entry with a
    wait id within its queue's length, the zero padding past it excluded (its wait id reads 0), and at batch 1 the
    stages that poll a flagged input (instructions.flagged.POLLING, but layer 0's QKV of a folded embedding)
    excluded: there the attention's output hop (O_PROJ) and ARGMAX keep their waits."""
    from megakernel.instructions.flagged import POLLING
    from megakernel.instructions.opcodes import Opcode
    from megakernel.instructions.record import W_A3, W_OPCODE, W_WAIT_ID, serialize
    from megakernel.runtime.engine import MegakernelEngine
    from megakernel.schedule import assign

    layout = _layout("tiny-llama", batch=batch, max_seq_len=32)
    eng = object.__new__(MegakernelEngine)
    eng.layout = layout
    eng.program = build_program(layout)
    eng.queue_table, eng.queue_lengths = serialize(assign(eng.program, "balanced"))
    table, lengths = eng.queue_table, eng.queue_lengths.tolist()
    assert any(n < table.shape[1] for n in lengths), "no queue is padded: the padding case is not tested"
    real = {(sm, i) for sm, n in enumerate(lengths) for i in range(n) if int(table[sm, i, W_WAIT_ID]) >= 0}
    got = eng.counter_waits()
    assert len(got) == len(set(got)) and set(got) <= real, "an entry past its queue's length or without a wait"

    def polls(sm, i):
        op, a3 = int(table[sm, i, W_OPCODE]), int(table[sm, i, W_A3])
        return op in POLLING and not (op == Opcode.QKV and a3 == 1)
    expected = {e for e in real if not polls(*e)} if batch == 1 else real
    assert set(got) == expected, f"batch {batch}: {sorted(expected - set(got))[:4]} missing, " \
                                 f"{sorted(set(got) - expected)[:4]} extra"
    ops = {Opcode(int(table[sm, i, W_OPCODE])) for sm, i in got}
    assert Opcode.O_PROJ in ops and (Opcode.GATE_UP in ops) == (Opcode.ATTN_PARTIAL in ops) == (batch > 1), ops
