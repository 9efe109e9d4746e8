"""The operands of the matvec past SPLIT_BATCH (megakernel.kernel.matvec_wide), checked on the CPU against the
m16n8k16 MMA's fragment definitions of the PTX ISA: the staged input as the A operand (the batch as M, in
m-tiles of 16 sequences: stream.wide_x_word), the fragment-packed weights as the B operand (8 weight rows as N),
and the C fragment read back as (sequence, row) the way epilogue_wide stores it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megakernel.instructions.layout import StepLayout, default_kv_splits, fragment_pack
from megakernel.kernel.compile import device_code
from megakernel.kernel.interpreter import SMEM_LIMIT, DecodeKernel
from megakernel.kernel.stream import (M_TILE, MIN_SLOTS, m_tiles, slot_geometry, wide_x_lane_word, wide_x_word,
                                      x_col_bytes)
from megakernel.model.presets import get_preset
from megakernel.schedule import build_program


def mma_16816(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """D = A B + C of one m16n8k16 MMA from per-lane registers as the PTX ISA defines them: a [32, 4, 2] (lane,
    register, the register's two bf16 halves, low first), b [32, 2, 2], c [32, 4]; lane = 4 g + t."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane, 0, e], a[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane, 2, e], a[lane, 3, e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b[lane, 0, e], b[lane, 1, e]
    D = A @ B
    d = c.clone()
    for lane in range(32):
        g, t = divmod(lane, 4)
        d[lane] += torch.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]])
    return d


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(9, 64), passes=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_staged_input_and_packed_weights_are_the_mma_operands(batch, passes, seed):
    """Stage every sequence's input through wide_x_word, read it back per lane as matvec_wide's loads do
    (wide_x_lane_word), multiply a 16-row group of fragment-packed weights as the B operand (each lane's 16 bytes
    of a 32-column block: its B registers of two k-steps), and read the sums back from the C fragments: equal to
    x @ W^T, for every sequence and row."""
    gen = torch.Generator().manual_seed(seed)
    k = passes * 256
    n_mt = m_tiles(batch)
    x = torch.randn(batch, k, generator=gen).to(torch.bfloat16).double()
    w = torch.randn(16, k, generator=gen).to(torch.bfloat16)
    # staging: one word (a bf16 pair) per (sequence, even column); every word of the buffer written at most once
    words = k * x_col_bytes(batch) // 4
    smem = torch.full((words, 2), float("nan"), dtype=torch.float64)
    seen = set()
    for b in range(batch):
        for c in range(0, k, 2):
            wd = wide_x_word(b, c, n_mt)
            assert 0 <= wd < words and wd not in seen
            seen.add(wd)
            smem[wd] = x[b, c:c + 2]
    smem[torch.isnan(smem)] = 0.0        # the padded sequences of the last m-tile (read, never stored)
    packed = fragment_pack(w).double()
    acc = {(blk, mt): torch.zeros(32, 4, dtype=torch.float64) for blk in range(2) for mt in range(n_mt)}
    for ks in range(k // 16):
        cb, kb = divmod(ks, 2)
        for mt in range(n_mt):
            a = torch.stack([smem[wide_x_lane_word(ks, mt, lane, n_mt):][:4] for lane in range(32)])
            for blk in range(2):
                block = packed[blk * 8:blk * 8 + 8].reshape(-1)[cb * 256:(cb + 1) * 256].reshape(32, 4, 2)
                acc[blk, mt] = mma_16816(a, block[:, 2 * kb:2 * kb + 2], acc[blk, mt])
    y = torch.full((n_mt * M_TILE, 16), float("nan"), dtype=torch.float64)
    for (blk, mt), c in acc.items():
        for lane in range(32):
            g, t = divmod(lane, 4)
            for hf in range(2):
                for e in range(2):
                    y[mt * M_TILE + hf * 8 + g, blk * 8 + 2 * t + e] = c[lane, hf * 2 + e]
    torch.testing.assert_close(y[:batch], x @ w.double().T, rtol=1e-12, atol=1e-9)


@given(batch=st.integers(9, 64))
def test_staged_input_loads_and_stores_spread_over_the_banks(batch):
    """The 32 loads of a block are 32 different 16-byte words (conflict-free); a warp's staging stores (32
    consecutive 4-column quads of one sequence, first word of each) fall in at least 16 banks (at most 2-way)."""
    n_mt = m_tiles(batch)
    for ks in range(16):
        for mt in range(n_mt):
            starts = {wide_x_lane_word(ks, mt, lane, n_mt) for lane in range(32)}
            assert len(starts) == 32 and all(s % 4 == 0 for s in starts)
            assert max(starts) - min(starts) == 31 * 4
    for b in range(batch):
        for q0 in range(0, 128, 32):
            banks = [wide_x_word(b, 4 * q, n_mt) % 32 for q in range(q0, q0 + 32)]
            assert max(banks.count(bk) for bk in set(banks)) <= 2, (b, q0, banks)


def test_wide_geometry_stages_bf16_m_tiles():
    """Past SPLIT_BATCH the staged input is bf16 over whole m-tiles: at batch 64 a 512-column window is 64 KiB,
    half of what float32 hi/lo words took."""
    assert x_col_bytes(64) == 128 and x_col_bytes(17) == 64 and x_col_bytes(8) == 32
    g = slot_geometry(2048, 64)
    assert g.x_slabs * g.slab_cols * x_col_bytes(64) == 64 * 1024 and not g.x_whole
    assert slot_geometry(512, 64).x_whole and slot_geometry(2048, 16).x_whole


def _h200_kernel(name: str, batch: int) -> DecodeKernel:
    """The device code of a preset at a batch on the H200's 132 SMs (a 4,096-token cache), built on the CPU."""
    config = get_preset(name)
    layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, 132, 4096),
                        block_size=16, max_blocks_per_seq=16, num_sms=132)
    return device_code(layout, build_program(layout))


@pytest.mark.parametrize("name,batch", [("llama-3.2-1b", 9), ("llama-3.2-1b", 64), ("qwen3-0.6b", 41),
                                        ("qwen3-0.6b", 64), ("llama-3.1-8b", 64), ("llama-2-7b", 33),
                                        ("tiny-llama", 17)])
def test_real_shapes_stage_inside_their_buffer_and_keep_a_ring(name, batch):
    """Past SPLIT_BATCH, on the real widths (and their K ranges where a stage splits): the kernel's staged-input
    buffer holds every word any window of any matrix stages (wide_x_word over all sequences and the window's
    columns), and the shared memory left keeps at least MIN_SLOTS ring slots."""
    dk = _h200_kernel(name, batch)
    n_mt = m_tiles(batch)
    for k, g in dk.plan.by_k.items():
        # the highest words: the window's last k-step, the sequences of the last m-tile
        last = max(wide_x_word(b, c, n_mt) for b in range(max(0, batch - M_TILE), batch)
                   for c in range(g.x_cols - 16, g.x_cols, 2))
        assert last < dk.plan.x_floats, f"{name} batch {batch} K={k}: word {last} of {dk.plan.x_floats}"
    assert MIN_SLOTS <= dk.ring_slots and dk.smem_bytes() <= SMEM_LIMIT, f"{name} batch {batch}: {dk.ring_slots} slots"


@pytest.mark.parametrize("name,batch,groups", [("llama-3.2-1b", 16, 2), ("llama-3.2-1b", 32, 2),
                                               ("llama-3.2-1b", 33, 1), ("llama-3.2-1b", 64, 1), ("qwen3-0.6b", 64, 1),
                                               ("llama-3.1-8b", 64, 2), ("llama-2-7b", 48, 2), ("tiny-llama", 20, 2)])
def test_row_groups_per_warp_follow_the_batch_and_the_tiles(name, batch, groups):
    """Past SPLIT_BATCH each consumer warp owns two row groups of a chunk (chunks of 256 rows) up to batch 32, and at
    33-64 only where a layer stage's tiles have more than 128 rows per SM (llama-3.1-8b's GATE_UP, llama-2-7b's DOWN;
    llama-3.2-1b's largest have 125): the kernel's slot geometry, which the producer and the consumers both walk,
    has that chunk at every width."""
    dk = _h200_kernel(name, batch)
    assert dk.wide_groups == groups, f"{name} batch {batch}: {dk.wide_groups} row groups per warp"
    assert {g.chunk_rows for g in dk.plan.by_k.values()} == {128 * groups}, f"{name} batch {batch}"
    # the MMA loop's B registers: half as many blocks at once where a warp holds 64 accumulators
    assert dk.wide_load_kp() == (2 if groups == 2 and m_tiles(batch) > 2 else 4), f"{name} batch {batch}"
