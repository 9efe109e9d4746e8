"""The weight stream's geometry (megakernel/kernel/stream.py), on the CPU: for any matrix width and batch, the
slots of a tile cover every weight of it exactly once in the order both sides walk (chunk, slab, row group),
every (row, slab part) is one consumer work item's exactly once (items are 16 rows, the M of one MMA, x a
slot's slab or a part of it; a tile of an odd number of 8-row blocks ends with a half item), each work item's
partial sums land in slots of their own, and the sizes fit the shared memory the kernel reserves for them.

The walk below restates the device loops of WeightStream.produce and MatvecStage.matvec from their
docstrings; the GPU stage tests run the device code itself on the same geometry.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megakernel.instructions.layout import COL_PASS, ROW_GROUP
from megakernel.kernel.stream import (ITEM_ROWS, PART_FLOATS, SLAB_COLS, SLOT_BYTES, X_PAD, X_WHOLE_BYTES,
                                      StreamPlan, slot_geometry, slot_parts, staging_budget)
from megakernel.model.presets import get_preset


def walk(g, rows: int, batch: int):
    """(slots, weights copied, items consumed, partial slots written) of one tile of `rows` rows, per
    (row, first column of the item's part of its slab)."""
    ic = g.slab_cols // g.parts
    copied: dict[tuple[int, int], int] = {}
    consumed: dict[tuple[int, int], int] = {}
    partials: dict[tuple[int, int], int] = {}
    slots = 0
    for c0 in range(0, rows, g.chunk_rows):
        crows = min(g.chunk_rows, rows - c0)
        for sl in range(g.n_slab):
            width = g.slab_width(sl)
            for g0 in range(0, crows, g.rows_per_slot):
                nr = min(g.rows_per_slot, crows - g0)
                slots += 1
                assert nr * width * 2 <= SLOT_BYTES and nr % ROW_GROUP == 0
                for rb in range(nr // 8):            # one bulk copy per 8-row block (or one for the slot)
                    for r in range(8):
                        for col in range(sl * g.slab_cols, sl * g.slab_cols + width, COL_PASS):
                            key = (c0 + g0 + 8 * rb + r, col)
                            copied[key] = copied.get(key, 0) + 1
                for part in range(g.parts):                 # each part of the slot read by one warp ...
                    for rg in range(-(-nr // ITEM_ROWS)):       # ... all of its row groups
                        two = rg * ITEM_ROWS + 8 < nr     # the item's second 8-row block is in the slot
                        for h in range(16 if two else 8):
                            row = g0 + rg * ITEM_ROWS + h                    # row within the chunk
                            slot = row * g.n_seg + sl * g.parts + part
                            assert 0 <= slot < g.chunk_rows * g.n_seg
                            partials[(c0 + row, slot)] = partials.get((c0 + row, slot), 0) + 1
                            if part * ic < width:         # (a narrower last slab: parts past it add nothing)
                                key = (c0 + row, sl * g.slab_cols + part * ic)
                                consumed[key] = consumed.get(key, 0) + 1
    return slots, copied, consumed, partials


@given(passes=st.integers(1, 64), batch=st.integers(1, 8), blocks=st.integers(1, 400),
       parts=st.sampled_from([None, 1, 2, 4]))
def test_slots_cover_every_weight_once_and_items_every_pass_once(passes, batch, blocks, parts):
    k = passes * COL_PASS
    rows = blocks * ROW_GROUP          # tiles are whole 8-row blocks (GATE_UP's whole pairs of them)
    g = slot_geometry(k, batch, parts)
    what = f"K={k} batch={batch} rows={rows}: {g}"
    assert g.slab_cols % COL_PASS == 0 and g.slab_cols * 2 * ITEM_ROWS <= SLOT_BYTES, what
    assert (g.n_slab - 1) * g.slab_cols < k <= g.n_slab * g.slab_cols, what
    assert g.rows_per_slot % ITEM_ROWS == 0 and g.rows_per_slot * g.slab_cols * 2 <= SLOT_BYTES, what
    assert g.chunk_rows % g.rows_per_slot == 0, what
    assert g.parts == (parts or slot_parts(batch)) and g.n_seg == g.n_slab * g.parts, what
    assert g.slab_cols <= SLAB_COLS and g.slab_cols % (32 * g.parts) == 0, what
    assert g.x_whole == (batch * k * 2 <= X_WHOLE_BYTES), what       # bf16 inputs
    # two bf16 columns a word; rows 32 bytes past a 128-byte line apart: the four sequences of a half-warp's 8-byte
    # B loads in different banks
    assert g.x_stride == g.x_cols // 2 + X_PAD and (g.x_stride * 4) % 128 == 32, what
    slots, copied, consumed, partials = walk(g, rows, batch)
    every = {(r, col) for r in range(rows) for col in range(0, k, COL_PASS)}
    items = {(r, col) for r in range(rows) for col in range(0, k, g.slab_cols // g.parts)}
    assert slots == g.slots(rows), what
    assert set(copied) == every and set(copied.values()) == {1}, f"{what}: a weight copied twice or never"
    assert set(consumed) == items and set(consumed.values()) == {1}, f"{what}: a segment consumed twice or never"
    assert set(partials.values()) == {1}, f"{what}: two work items write one partial slot"
    assert {slot % g.n_seg for _, slot in partials} == set(range(g.n_seg)), what
    assert {(r, slot % g.n_seg) for r, slot in partials} == {(r, s) for r in range(rows) for s in range(g.n_seg)}


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-qwen3", "llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b",
                                  "llama-2-7b"))
@pytest.mark.parametrize("batch", range(1, 9))
def test_preset_plans_fit_and_use_wide_slabs(name, batch):
    """Every width of a real model: as few slabs as a slot's width allows (an odd or prime K / 256, such as
    Llama-2-7B's 11008 = 43 x 256, too: wide slabs and a narrower last one, not 256-column slabs), and at
    most a partial buffer of the staging budget's floats unless one chunk unit needs more."""
    config = get_preset(name)
    plan = StreamPlan.for_config(config, batch)
    part_floats, x_bytes = staging_budget(config.hidden_size, batch)
    # the larger budget exactly where even the hidden-size inputs are too wide to stage whole
    assert (part_floats, x_bytes) == ((4 * PART_FLOATS, X_WHOLE_BYTES // 2)
                                      if batch * config.hidden_size * 2 > X_WHOLE_BYTES
                                      else (PART_FLOATS, X_WHOLE_BYTES))
    for k, g in plan.by_k.items():
        what = f"{name} batch={batch} K={k}: {g}"
        widest = SLOT_BYTES // (2 * ITEM_ROWS) // COL_PASS * COL_PASS
        assert g.n_slab == -(-k // widest), f"{what}: more slabs than a slot's width needs"
        assert g.slab_cols >= min(k, widest), f"{what}: narrow slabs"
        assert g.chunk_rows * g.n_seg * batch <= max(part_floats, g.rows_per_slot * g.n_seg * batch), what
        assert g.x_whole == (batch * k * 2 <= x_bytes) and batch * g.x_cols * 2 <= x_bytes, what
    assert plan.part_floats == max(g.chunk_rows * g.n_seg * batch for g in plan.by_k.values())
    assert plan.x_floats == batch * max(g.x_stride for g in plan.by_k.values())


def test_ring_depth_is_what_fits_between_the_bounds():
    assert StreamPlan.ring_slots(200 * 1024) == 12
    assert StreamPlan.ring_slots(5 * (SLOT_BYTES + 16)) == 5
    with pytest.raises(ValueError, match="weight ring"):
        StreamPlan.ring_slots(3 * (SLOT_BYTES + 16))
