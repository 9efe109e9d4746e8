"""The decode kernel compiles for sm_90a without a GPU, and the SASS is what a bandwidth-bound kernel needs:
weight tiles streamed with 128-bit read-only loads that skip L1, and no local-memory spills on the real presets.

The root conftest.py sets the target (CUTE_DSL_ARCH=sm_90a) and a private artifact folder before cutlass
is first imported.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

from megakernel.instructions.layout import StepLayout, default_kv_splits
from megakernel.instructions.record import serialize
from megakernel.kernel.compile import (KernelKey, compile_decode_kernel, nvdisasm_path, resource_usage, sass,
                                       spill_instructions)
from megakernel.kernel.decode import DecodeKernel, KernelOptions
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
def compiled(name: str, batch: int, slab_staging: bool = False) -> dict:
    """PTX, SASS and resource usage of the kernel for a preset at a batch size (compiled once per module)."""
    config = get_preset(name)
    layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, NUM_SMS),
                        block_size=BLOCK_SIZE, max_blocks_per_seq=MAX_SEQ_LEN // BLOCK_SIZE, num_sms=NUM_SMS,
                        slab_staging=slab_staging)
    program = build_program(layout)
    table, _ = serialize(assign(program, "balanced"))
    # the engine's own cache geometry: one contiguous block range per sequence, default strides
    known = {"layout": layout, "lm_tiles": program.lm_tiles, "num_counters": program.num_counters,
             "max_queue_len": table.shape[1], "num_blocks": batch * layout.max_blocks_per_seq, "kv_strides": None,
             "options": KernelOptions()}
    key = KernelKey(**{f.name: known[f.name] for f in dataclasses.fields(KernelKey)})
    kernel = compile_decode_kernel(key, keep_artifacts=True)
    device_code = DecodeKernel(key.layout, key.lm_tiles, key.num_counters, key.max_queue_len, key.kv_strides,
                               key.options)
    cubin = kernel.__cubin__
    sass_text = sass(cubin)
    return {"ptx": kernel.__ptx__, "cubin": cubin, "sass": sass_text, "usage": resource_usage(cubin),
            "spills": spill_instructions(sass_text), "slabs": device_code.slabs,
            "slab_cols": device_code.slab_cols}


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


@pytest.mark.parametrize("name,batch", CASES)
def test_matvec_weight_loads_are_128_bit_read_only(name, batch):
    """Weights go through ld.global.nc.L1::no_allocate.v4 (PTX) = LDG.E.NA...128.CONSTANT (SASS): 16 bytes a
    lane, the read-only path, no L1 allocation. Every no-allocate load in the SASS is such a load (none was
    split into narrower ones or lost its read-only path)."""
    art = compiled(name, batch)
    what = _what(name, batch, art)
    ptx_loads = re.findall(r"ld\.global\.nc\.L1::no_allocate\S*", art["ptx"])
    assert len(ptx_loads) >= 2, f"{what}: {len(ptx_loads)} no-allocate weight loads in the PTX"
    assert all(".v4.b32" in op for op in ptx_loads), f"{what}: PTX weight loads {sorted(set(ptx_loads))}"
    sass_ops = [op.split(".") for op in re.findall(r"\bLDG(?:\.[A-Z0-9_]+)+", art["sass"])]
    weight_ops = [parts for parts in sass_ops if "NA" in parts]
    kinds = sorted({".".join(parts) for parts in sass_ops})
    assert len(weight_ops) >= 2, f"{what}: {len(weight_ops)} no-allocate loads in the SASS; LDG kinds {kinds}"
    narrow = sorted({".".join(p) for p in weight_ops if "128" not in p or "CONSTANT" not in p})
    assert not narrow, f"{what}: weight loads not 128-bit read-only: {narrow}"


@pytest.mark.parametrize("name,batch", REAL_CASES)
def test_no_local_memory_spills_on_real_presets(name, batch):
    art = compiled(name, batch)
    what = _what(name, batch, art)
    assert art["spills"] == 0, f"{what}: local-memory loads/stores in the SASS"
    assert art["usage"].get("frame_bytes", 0) == 0, f"{what}: a stack frame"


# The batches between, as the engine lays them out (slab_staging, its default). Register pressure
# changes with the batch (accumulators, passes per unit, preload, slabs), so every batch is compiled.
MID_CASES = [(name, batch) for name in REAL_PRESETS for batch in range(2, 8)]


@pytest.mark.parametrize("name,batch", MID_CASES)
def test_no_local_memory_spills_at_every_batch_of_the_engines_layout(name, batch):
    art = compiled(name, batch, slab_staging=True)
    what = _what(name, batch, art) + " slab_staging"
    assert art["spills"] == 0, f"{what}: local-memory loads/stores in the SASS"
    assert art["usage"].get("frame_bytes", 0) == 0, f"{what}: a stack frame"


# Batches whose widest input row (batch x K float32) exceeds the staging buffer: with slab_staging the
# matvecs stage and stream K in column slabs (16 warps), instead of reading the input from L1 (8 warps).
SLAB_CASES = [("llama-3.2-1b", 8), ("llama-3.1-8b", 4), ("llama-3.1-8b", 8)]


@pytest.mark.parametrize("name,batch", SLAB_CASES)
def test_slab_staging_compiles_without_spills(name, batch):
    art = compiled(name, batch, slab_staging=True)
    what = _what(name, batch, art) + f" slab_staging slab_cols={art['slab_cols']}"
    config = get_preset(name)
    k_max = max(config.hidden_size, config.q_size, config.intermediate_size)
    assert art["slabs"] and art["slab_cols"] < k_max, f"{what}: the kernel does not stage in slabs"
    assert art["slab_cols"] % 256 == 0 and batch * art["slab_cols"] * 4 <= 128 * 1024, what
    ptx_loads = re.findall(r"ld\.global\.nc\.L1::no_allocate\S*", art["ptx"])
    assert ptx_loads and all(".v4.b32" in op for op in ptx_loads), f"{what}: PTX weight loads {sorted(set(ptx_loads))}"
    assert art["spills"] == 0 and art["usage"].get("frame_bytes", 0) == 0, \
        f"{what}: local-memory loads/stores in the SASS"
