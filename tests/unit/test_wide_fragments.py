"""The operands of the matvec past SPLIT_BATCH (megakernel.kernel.matvec_wide), checked on the CPU against the
wgmma m64nNk16 definitions of the PTX ISA: the fragment-packed weights as the A operand in registers (each warp's
16-row group of a slot as an m16n8k16 A fragment: 64 weight rows as M), the staged input as the B operand read
through the shared-memory descriptor (K-major core matrices without swizzle: layout.wide_x_byte, the batch as N),
the pre-staged inputs the producing stages write (layout.wide_input) as what one bulk copy per window lands, and
the accumulators read back as (sequence, row) the way epilogue_wide stores them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megakernel.instructions.layout import (StepLayout, default_kv_splits, fragment_pack, input_ssq, wide_input,
                                           wide_input_index)
from megakernel.kernel.compile import device_code
from megakernel.kernel.interpreter import SMEM_LIMIT, DecodeKernel
from megakernel.kernel.stream import (M_TILE, MIN_SLOTS, WGMMA_LBO, WGMMA_SBO, m_tiles, slot_geometry, wide_ks_bytes,
                                      wide_x_byte, x_col_bytes)
from megakernel.model.presets import get_preset
from megakernel.schedule import build_program


def descriptor_read(smem: dict, start: int, n: int) -> torch.Tensor:
    """B (16 x n) of one wgmma as the PTX ISA defines a K-major operand without swizzle: element (k, j) at start +
    (k // 8) * LBO + (j // 8) * SBO + (j % 8) * 16 + (k % 8) * 2 (core matrices of 8 rows x 16 bytes); a byte
    never stored reads as NaN."""
    b = torch.full((16, n), float("nan"), dtype=torch.float64)
    for k in range(16):
        for j in range(n):
            b[k, j] = smem.get(start + (k // 8) * WGMMA_LBO + (j // 8) * WGMMA_SBO + (j % 8) * 16 + (k % 8) * 2,
                               float("nan"))
    return b


def wgmma_rs(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """D += A B of one wgmma m64nNk16 from per-lane registers as the PTX ISA defines them: a [4, 32, 4, 2] (warp,
    lane, register, the register's two bf16 halves, low first: warp w's rows 16 w + g and + 8, columns 2t, 2t + 1
    and + 8), b [16, N], d [4, 32, N / 2] (warp w, lane: rows 16 w + g and + 8, columns 8 i + 2t and + 1)."""
    n = b.shape[1]
    A = torch.zeros(64, 16, dtype=torch.float64)
    for w in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for e in range(2):
                A[16 * w + g, 2 * t + e], A[16 * w + g + 8, 2 * t + e] = a[w, lane, 0, e], a[w, lane, 1, e]
                A[16 * w + g, 2 * t + 8 + e], A[16 * w + g + 8, 2 * t + 8 + e] = a[w, lane, 2, e], a[w, lane, 3, e]
    D = A @ b
    out = d.clone()
    for w in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for i in range(n // 8):
                out[w, lane, 4 * i:4 * i + 4] += torch.stack([D[16 * w + g, 8 * i + 2 * t], D[16 * w + g, 8 * i + 2 * t + 1],
                                                             D[16 * w + g + 8, 8 * i + 2 * t],
                                                             D[16 * w + g + 8, 8 * i + 2 * t + 1]])
    return out


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(9, 64), passes=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_staged_input_and_packed_weights_are_the_wgmma_operands(batch, passes, seed):
    """Stage every sequence's input through wide_x_byte (as store_x_quad does: 8 bytes a quad), read it back as
    the wgmma's B through the descriptor of each k-step (wgmma_set's start addresses, WGMMA_LBO and WGMMA_SBO), take
    each of four warps' A registers from its 16-row group of fragment-packed weights as wgmma_set loads them (a
    lane's 16 bytes of a 32-column block of each 8-row block: a0, a2 from the first, a1, a3 from the second), and
    read the sums back from the accumulators as epilogue_wide does: equal to x @ W^T for every sequence and row."""
    gen = torch.Generator().manual_seed(seed)
    k = passes * 256
    n = m_tiles(batch) * M_TILE
    x = torch.randn(batch, k, generator=gen).to(torch.bfloat16).double()
    w = torch.randn(64, k, generator=gen).to(torch.bfloat16)
    smem = {}
    for b in range(batch):
        for c in range(0, k, 4):
            at = wide_x_byte(b, c, batch)
            assert at % 8 == 0 and all(wide_x_byte(b, c + e, batch) == at + 2 * e for e in range(4))
            for e in range(4):
                assert at + 2 * e not in smem
                smem[at + 2 * e] = x[b, c + e].item()
    packed = fragment_pack(w).double()            # row group i: rows 16 i .. 16 i + 15, a slot of k columns
    d = torch.zeros(4, 32, n // 2, dtype=torch.float64)
    for ks in range(k // 16):
        bmat = descriptor_read(smem, ks * wide_ks_bytes(batch), n)
        bmat[:, batch:] = 0.0                     # the padded sequences: read, never stored, never stored back
        assert not torch.isnan(bmat).any()
        u, kb = divmod(ks, 2)
        a = torch.zeros(4, 32, 4, 2, dtype=torch.float64)
        for i in range(4):
            group = packed[16 * i:16 * i + 16].reshape(2, -1)      # the slot's two 8-row blocks, k * 8 values each
            for lane in range(32):
                top = group[0, u * 256 + lane * 8:][:8].reshape(4, 2)
                bottom = group[1, u * 256 + lane * 8:][:8].reshape(4, 2)
                a[i, lane] = torch.stack([top[2 * kb], bottom[2 * kb], top[2 * kb + 1], bottom[2 * kb + 1]])
        d = wgmma_rs(a, bmat, d)
    y = torch.full((n, 64), float("nan"), dtype=torch.float64)
    for i in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for ci in range(n // 8):
                for e in range(2):
                    y[ci * 8 + 2 * t + e, 16 * i + g] = d[i, lane, ci * 4 + e]
                    y[ci * 8 + 2 * t + e, 16 * i + g + 8] = d[i, lane, ci * 4 + 2 + e]
    torch.testing.assert_close(y[:batch], x @ w.double().T, rtol=1e-12, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(9, 64), units=st.integers(1, 3), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_a_pre_staged_window_copied_in_one_piece_is_the_wgmma_operand(batch, units, seed, data):
    """A producing stage's pre-staged copy (wide_input: what the wide epilogue and MV_REDUCE store element by
    element at wide_x_byte, EMBED 16 bytes per 8 columns), one window of it copied as one contiguous piece (the
    consumer's bulk copy: from the window's first k-step block, a whole number of blocks, 16-byte aligned), read
    through each k-step's descriptor as input_window's wgmmas read it: the input times the norm weight rounded to
    bf16, for every sequence; the same bytes the consumers' own staging stores at wide_x_byte(b, c - col)."""
    gen = torch.Generator().manual_seed(seed)
    k = units * 256
    n = m_tiles(batch) * M_TILE
    ksb = wide_ks_bytes(batch)
    x = torch.randn(batch, k, generator=gen) * 3
    gamma = torch.randn(k, generator=gen).to(torch.bfloat16)
    flat = wide_input(x, gamma, batch).flatten()
    want = (x * gamma.float()).to(torch.bfloat16).double()
    # the producers' stores: one element at wide_x_byte (the epilogues), 16 contiguous bytes per 8 columns (EMBED)
    idx = wide_input_index(batch, k)
    for b in range(batch):
        for c in range(0, k, 8):
            at = wide_x_byte(b, c, batch)
            assert at % 16 == 0 and [wide_x_byte(b, c + e, batch) for e in range(8)] == list(range(at, at + 16, 2))
    assert torch.equal(flat[idx.flatten()].double(), want.flatten())
    col = 16 * data.draw(st.integers(0, k // 16 - 1))
    ncols = 16 * data.draw(st.integers(1, (k - col) // 16))
    start, nbytes = col // 16 * ksb, ncols // 16 * ksb
    assert start % 16 == 0 and nbytes % 16 == 0
    smem = {2 * e - start: flat[e].item() for e in range(start // 2, (start + nbytes) // 2)}
    for ks in range(ncols // 16):
        bmat = descriptor_read(smem, ks * ksb, n)
        assert torch.equal(bmat[:, :batch], want[:, col + 16 * ks:col + 16 * ks + 16].T), (col, ks)
        assert not bmat[:, batch:].any()          # the padded sequences: zeros
    for b in range(batch):
        for c in range(col, col + ncols, 4):
            assert smem[wide_x_byte(b, c - col, batch)] == want[b, c].item()


def test_sums_of_squares_go_per_8_columns():
    """input_ssq: one sum per core-matrix row (8 columns of one sequence), in float64, rounded once."""
    x = torch.randn(3, 32, dtype=torch.float32)
    s = input_ssq(x)
    assert s.shape == (3, 4)
    assert torch.equal(s, (x.double() ** 2).reshape(3, 4, 8).sum(-1).float())


@given(batch=st.integers(9, 64))
def test_staged_input_stores_spread_over_the_banks(batch):
    """A warp's staging stores (32 consecutive 4-column quads of one sequence, 8 bytes each) use every 8-byte bank
    pair of a 128-byte row at most twice: two wavefronts, the fewest for 256 bytes; core matrices start 16-byte
    aligned (the descriptor's unit)."""
    assert wide_ks_bytes(batch) % 16 == 0 and WGMMA_LBO % 16 == 0 and WGMMA_SBO % 16 == 0
    for b in range(batch):
        for q0 in range(0, 128, 32):
            pairs = [wide_x_byte(b, 4 * q, batch) % 128 // 8 for q in range(q0, q0 + 32)]
            assert max(pairs.count(p) for p in set(pairs)) <= 2, (b, q0, pairs)


def test_wide_geometry_stages_bf16_m_tiles():
    """Past SPLIT_BATCH the staged input is bf16 over whole m-tiles (up to it bf16 per sequence): at batch 64 a
    512-column window is 64 KiB."""
    assert x_col_bytes(64) == 128 and x_col_bytes(17) == 64 and x_col_bytes(8) == 16
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
    buffer holds every word any window of any matrix stages (wide_x_byte over all sequences and the window's
    columns), and the shared memory left keeps at least MIN_SLOTS ring slots."""
    dk = _h200_kernel(name, batch)
    for k, g in dk.plan.by_k.items():
        # the highest words: the window's last k-step, the sequences of the last m-tile
        last = max(wide_x_byte(b, c, batch) + 8 for b in range(max(0, batch - M_TILE), batch)
                   for c in range(g.x_cols - 16, g.x_cols, 4)) // 4
        assert last <= dk.plan.x_floats, f"{name} batch {batch} K={k}: word {last} of {dk.plan.x_floats}"
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


@pytest.mark.parametrize("name,batch", [("llama-3.2-1b", 9), ("llama-3.2-1b", 64), ("qwen3-0.6b", 41),
                                        ("llama-3.1-8b", 64), ("tiny-llama", 17)])
def test_rms_scale_threads_cover_every_sequence_in_whole_loads(name, batch):
    """rstd_from_ssq: ssq_threads() threads per sequence (a power of two within a warp, so the butterfly stays
    among them), all sequences' threads among the consumers, each share of the H / 8 sums a whole number of
    4-float loads."""
    dk = _h200_kernel(name, batch)
    P, NG = dk.ssq_threads(), dk.H // 8
    assert P & (P - 1) == 0 and P <= 32 and P * batch <= dk.cthreads and NG % (4 * P) == 0
    assert sorted(dk.ssq_offsets()) == [1 << i for i in range(P.bit_length() - 1)]
