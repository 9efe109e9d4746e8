"""The weight ring's protocol (megakernel.kernel.ring_model): the device code's rule for which consumer warp reads
which part of which ring slot (reader_warp, which megakernel.kernel.matvec calls) keeps every mbarrier wait on its
own phase and never deadlocks, over the real presets' per-CTA slot sequences at batch 1-8 with the kernel's own
ring depth, parts, warps and in-flight cap, under random timings; and the model catches the rule that deadlocked
on the GPU (slot number k read by warp k % warps: profiles/RESULTS.md, 2026-12-03)."""

from __future__ import annotations

import functools
import random

import pytest

from megakernel.instructions.layout import SPLIT_BATCH, StepLayout, default_kv_splits
from megakernel.instructions.matvec_stages import MATVEC_OPCODES
from megakernel.kernel.compile import device_code
from megakernel.kernel.interpreter import KernelOptions
from megakernel.kernel.ring_model import (RingProtocolError, reader_warp, ring_readers, simulate_ring,
                                          simulate_wide_ring)
from megakernel.kernel.stream import HOP_IN_FLIGHT, ITEM_ROWS, STREAM_BOUND_BYTES, WIDE_WARPS, max_in_flight
from megakernel.model.presets import get_preset
from megakernel.schedule import assign, build_program

NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def kernel_case(preset: str, batch: int, sm: int = 0, layers: int = 2):
    """(the real kernel, its geometry's K of each matvec instruction of one CTA's queue in order) for the first
    `layers` layers' instructions and the LM head's: K the instruction's own (a K range's width where the stage
    is split over K, as only past SPLIT_BATCH)."""
    config = get_preset(preset)
    layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, NUM_SMS, 4096),
                        block_size=16, max_blocks_per_seq=16, num_sms=NUM_SMS)
    program = build_program(layout)
    queues = assign(program, "balanced")
    kernel = device_code(layout, program)
    matvecs = []
    for ins in queues[sm]:
        if ins.opcode not in MATVEC_OPCODES or (ins.layer >= layers and ins.opcode.name != "LM_HEAD"):
            continue
        matvecs.append((ins, kernel.tile_k(ins)))
    return kernel, tuple(matvecs)


def ring_case(preset: str, batch: int):
    """(chunks, ring slots, parts, reader warps, consumer warps, in-flight cap) of one CTA of the real kernel: the
    slot counts of its queue's matvec chunks in order, from the kernel's own geometry."""
    kernel, matvecs = kernel_case(preset, batch)
    chunks = []
    for ins, k in matvecs:
        chunks += kernel.plan.geometry(k).chunk_slots(ins.a1)
    return tuple(chunks), kernel.ring_slots, kernel.plan.parts, kernel.readers, kernel.warps, kernel.in_flight


@pytest.mark.parametrize("preset,batch", [("llama-3.2-1b", 1), ("llama-3.2-1b", 4), ("llama-3.2-1b", 8),
                                          ("qwen3-0.6b", 1), ("qwen3-0.6b", 3), ("llama-3.1-8b", 1),
                                          ("llama-3.1-8b", 8), ("llama-2-7b", 2)])
def test_the_kernels_reader_rule_keeps_every_wait_on_its_phase(preset, batch):
    chunks, ring_slots, parts, readers, warps, cap = ring_case(preset, batch)
    assert sum(chunks) > 2 * ring_slots, "the case must reuse every ring slot"
    # the reader warps: the most consumer warps that divide the ring's parts (a ring of 12 slots of two parts,
    # qwen3-0.6b 1's, is read by 12 of the 15), never fewer than half the parts (reader_warp's one subtraction)
    assert readers == ring_readers(ring_slots, parts, warps) and (ring_slots * parts) % readers == 0
    assert ring_slots * parts <= 2 * readers <= 2 * warps
    for seed in range(4):
        # (the producer keeps HOP_IN_FLIGHT slots on their way while the consumers cross a hop)
        run = simulate_ring(list(chunks), ring_slots, parts, readers, cap, seed=seed, hop_in_flight=HOP_IN_FLIGHT)
        assert run.reads == run.slots * parts == sum(chunks) * parts
        # the cap waits for slot k - cap alone, and copies may land out of order (as bulk copies do)
        assert cap <= run.max_in_flight <= ring_slots, run
        assert run.waited > 0, "random timings that never made a reader wait test nothing"
        assert run.hop_issued > 0, "a run that never issued a slot during a hop does not test the hold"


@pytest.mark.parametrize("ring_slots", range(4, 13))
@pytest.mark.parametrize("parts", [1, 2])
def test_ring_readers_spread_every_run_of_consecutive_parts(ring_slots, parts):
    """Any run of n consecutive ring parts (a tile's slots, round the ring from any start) gives no reader more than
    ceil(n / readers); the rule of all 15 warps does not at 12 slots of 2 parts (qwen3-0.6b 1's six-slot tiles)."""
    readers = ring_readers(ring_slots, parts, 15)
    total = ring_slots * parts
    for start in range(total):
        for n in range(1, total + 1):
            load = [0] * readers
            for v in range(start, start + n):
                load[reader_warp(v % total, 0, 1, readers)] += 1
            assert max(load) == -(-n // readers), (ring_slots, parts, readers, start, n, load)
    if (ring_slots, parts) == (12, 2):
        assert readers == 12
        load = [0] * 15
        for v in range(14, 26):                     # a six-slot tile from ring slot 7
            load[reader_warp(v % total, 0, 1, 15)] += 1
        assert max(load) == 2


def wide_ring_case(preset: str, batch: int):
    """(chunks as (slabs, row groups), ring slots, warps, in-flight cap) of one CTA of the real kernel past
    SPLIT_BATCH: its queue's matvec chunks in order."""
    kernel, matvecs = kernel_case(preset, batch)
    assert kernel.wide and kernel.warps == WIDE_WARPS
    chunks = []
    for ins, k in matvecs:
        g = kernel.plan.geometry(k)
        assert g.rows_per_slot == ITEM_ROWS, "the wide consumers take a row group (ITEM_ROWS rows) a slot"
        for c0 in range(0, ins.a1, g.chunk_rows):
            chunks.append((g.n_slab, -(-min(g.chunk_rows, ins.a1 - c0) // ITEM_ROWS)))
    return tuple(chunks), kernel.ring_slots, kernel.warps, kernel.in_flight


@pytest.mark.parametrize("preset,batch", [("llama-3.2-1b", 16), ("llama-3.2-1b", 64), ("qwen3-0.6b", 32),
                                          ("llama-3.1-8b", 32)])
def test_the_wide_consumers_sets_keep_every_wait_on_its_phase_through_the_hold(preset, batch):
    """Past batch 8 every consumer warp waits for every slot and a warpgroup keeps a set's four slots until the
    set's last has landed; with the producer holding to HOP_IN_FLIGHT slots through every hop (stream.py, as up to
    batch 8) no wait passes on the wrong phase, every slot is released by all warps, nothing deadlocks."""
    chunks, ring_slots, warps, cap = wide_ring_case(preset, batch)
    slots = sum(slabs * groups for slabs, groups in chunks)
    sets = sum(slabs * -(-groups // 4) for slabs, groups in chunks)
    assert slots > 2 * ring_slots, "the case must reuse every ring slot"
    for seed in range(3):
        run = simulate_wide_ring(list(chunks), ring_slots, warps, cap, seed=seed, hop_in_flight=HOP_IN_FLIGHT)
        assert run.slots == slots and run.reads == sets * 4, run
        assert cap <= run.max_in_flight <= ring_slots, run
        assert run.waited > 0 and run.hop_issued > 0, run


def test_the_wide_model_sees_a_ring_too_shallow_for_a_set():
    """A warpgroup keeps a set's slots until its fourth has landed: a ring of three slots deadlocks (the model
    must see it), one of four does not, under any cap."""
    with pytest.raises(RingProtocolError, match="deadlock"):
        simulate_wide_ring([(2, 8)], 3, WIDE_WARPS, 2, seed=0, hop_in_flight=1)
    for cap in (1, 2, 4):
        run = simulate_wide_ring([(2, 8), (1, 5)], 4, WIDE_WARPS, cap, seed=cap, hop_in_flight=1)
        assert run.reads == (2 * 2 + 2) * 4


@pytest.mark.parametrize("preset,batch,cap", [("qwen3-0.6b", 1, 2), ("llama-3.2-1b", 1, 2), ("llama-3.2-1b", 4, 2),
                                              ("llama-3.1-8b", 1, 3), ("llama-2-7b", 2, 3), ("llama-3.1-8b", 4, 3),
                                              ("llama-3.1-8b", 8, 3), ("llama-3.2-1b", 8, 2),
                                              ("llama-3.1-8b", 16, 2)])
def test_in_flight_cap_is_three_only_where_the_stream_bounds_the_step(preset, batch, cap):
    """The kernel's cap (stream.max_in_flight) as the sweeps chose it: two weight slots on their way per SM,
    three where a layer's weights pass STREAM_BOUND_BYTES per SM up to SPLIT_BATCH."""
    assert ring_case(preset, batch)[5] == cap
    assert max_in_flight(batch, STREAM_BOUND_BYTES) == (3 if batch <= SPLIT_BATCH else 2)
    assert max_in_flight(batch, STREAM_BOUND_BYTES - 1) == 2


def test_max_in_flight_option_overrides_the_rule_up_to_the_ring():
    """KernelOptions.max_in_flight (an A/B knob) replaces the rule, never past the ring's depth."""
    config = get_preset("qwen3-0.6b")
    layout = StepLayout(config=config, batch=1, kv_splits=4, block_size=16, max_blocks_per_seq=16,
                        num_sms=NUM_SMS)
    program = build_program(layout)
    caps = [device_code(layout, program, KernelOptions(max_in_flight=n)) for n in (0, 1, 6, 10_000)]
    assert [k.in_flight for k in caps[:3]] == [2, 1, 6]
    assert caps[3].in_flight == caps[3].ring_slots < 10_000


@pytest.mark.parametrize("preset,batch", [("llama-3.2-1b", 2), ("qwen3-0.6b", 4)])
def test_the_model_catches_the_rule_that_failed_on_the_gpu(preset, batch):
    """Slot number k to warp k % warps (one part per slot at batch 2-8): a warp waits for use u of a ring slot
    whose barrier still shows use u - 2's phase, of the same parity. (Where the ring's depth is a multiple of the
    warps the two rules coincide; the kernel's own readers, ring_readers', divide the ring.)"""
    chunks, ring_slots, parts, _, warps, cap = ring_case(preset, batch)    # every consumer warp, as that rule had it
    assert parts == 1 and ring_slots % warps != 0
    with pytest.raises(RingProtocolError, match="passed its wait|deadlock"):
        for seed in range(8):
            simulate_ring(list(chunks), ring_slots, parts, warps, cap, seed=seed,
                          reader=lambda k, p: k % warps)


def test_reader_warp_is_the_rule_of_the_parity_argument():
    """Fixed per (ring slot, part), spread over the warps, every warp used once the ring has enough parts."""
    for ring_slots, parts, warps in [(10, 2, 15), (8, 1, 8), (12, 1, 8), (11, 2, 15)]:
        owners = {(r, p): reader_warp(r, p, parts, warps) for r in range(ring_slots) for p in range(parts)}
        assert all(0 <= w < warps for w in owners.values())
        assert len(set(owners.values())) == min(warps, ring_slots * parts)


@pytest.mark.parametrize("hop_cap", [1, 2])
def test_a_smaller_cap_while_the_consumers_cross_a_hop_keeps_the_protocol(hop_cap):
    """The hold (stream.HOP_IN_FLIGHT slots on their way while the consumers cross a hop) only ever waits for a
    slot to land, never on the consumers, so it cannot close a cycle: random rings, parts, warps and caps, every
    chunk a hop, no violation, and slots issued during the hops; a hold of no slot at all (the producer waiting
    for a slot it has not issued) is the deadlock the model must see."""
    rng = random.Random(11)
    during = 0
    for _ in range(40):
        ring_slots, parts = rng.randint(4, 12), rng.choice([1, 2])
        warps = rng.choice([8, 15])
        chunks = [rng.randint(1, 8) for _ in range(rng.randint(4, 12))]
        cap = rng.randint(hop_cap, 3)
        run = simulate_ring(chunks, ring_slots, parts, warps, cap, seed=rng.randrange(1 << 30), hop_in_flight=hop_cap)
        assert run.reads == sum(chunks) * parts and run.max_in_flight <= ring_slots
        during += run.hop_issued
    assert during > 0
    with pytest.raises(RingProtocolError, match="deadlock"):
        simulate_ring([4, 4, 4], 6, 2, 15, 2, seed=1, hop_in_flight=0)
