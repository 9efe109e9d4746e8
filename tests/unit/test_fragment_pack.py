"""The fragment order of the streamed weights (megakernel.instructions.layout.fragment_pack), on the CPU.

The consumer warps read each 512-byte block of 8 rows x 32 columns as 16 bytes per lane: word kb * 2 + h of
lane l is the pair of columns 16 kb + 8 h + 2 (l % 4) (+1) of row l // 4. The batch 1-8 consumers
(megakernel.kernel.matvec.consume_item) hand those 4 words as they lie to one m16n8k16 MMA per 8-row block and
group of 4 sequences (the MMA's rows g and g + 8 both weight row g, two N columns a sequence); the wgmma past
batch 8 takes a 16-row group's A fragment from two 8-row blocks. Rebuilding each MMA's operands the way the PTX
ISA defines the m16n8k16 fragments, and multiplying, must give W @ x either way; and the packing must be a
row-block-local permutation (a tile's rows are the same bytes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megakernel.instructions.layout import fragment_pack, fragment_unpack


def mma_a(regs: torch.Tensor) -> torch.Tensor:
    """The 16 x 16 A matrix of an m16n8k16 MMA from its registers as the lanes hold them, regs [lane, R0..R3,
    half of the word] (PTX: R0 row g cols 2t, 2t + 1; R1 row g + 8, the same cols; R2 row g cols 2t + 8, + 9; R3
    row g + 8, the same cols; g, t = lane // 4, lane % 4)."""
    a = torch.full((16, 16), float("nan"), dtype=regs.dtype)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            a[g, 2 * t + e] = regs[lane, 0, e]
            a[g + 8, 2 * t + e] = regs[lane, 1, e]
            a[g, 2 * t + 8 + e] = regs[lane, 2, e]
            a[g + 8, 2 * t + 8 + e] = regs[lane, 3, e]
    return a


def a_operand(packed_rows: torch.Tensor, kp: int, kb: int) -> torch.Tensor:
    """The 16 x 16 A matrix of the MMA for 32-column block kp, half kb, of 16 packed rows, assembled from
    what each lane loads: lane l's 16 bytes at 16 l of each row block's 512-byte block kp, words
    (R0, R2) from the first row block and (R1, R3) from the second."""
    assert packed_rows.shape[1] % 32 == 0
    blocks = [packed_rows[8 * i:8 * i + 8].reshape(-1)[kp * 256:(kp + 1) * 256].reshape(32, 4, 2)
              for i in range(2)]                    # [lane, word, half of the word]
    return mma_a(torch.stack([blocks[0][:, kb * 2], blocks[1][:, kb * 2], blocks[0][:, kb * 2 + 1],
                              blocks[1][:, kb * 2 + 1]], dim=1))


@given(groups=st.integers(1, 4), kps=st.integers(1, 6), layers=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_packed_blocks_are_the_mma_a_operands(groups, kps, layers, seed):
    g = torch.Generator().manual_seed(seed)
    rows, k = 16 * groups, 32 * kps
    w = torch.randn(layers, rows, k, generator=g).to(torch.bfloat16)
    p = fragment_pack(w)
    assert p.shape == w.shape and p.is_contiguous() and p.dtype == w.dtype
    assert torch.equal(fragment_unpack(p), w)
    x = torch.randn(k, 3, generator=g, dtype=torch.float64)
    for layer in range(layers):
        y = torch.zeros(rows, 3, dtype=torch.float64)
        for rg in range(groups):
            for kp in range(kps):
                for kb in range(2):
                    a = a_operand(p[layer, 16 * rg:16 * rg + 16], kp, kb).double()
                    assert not a.isnan().any()
                    c0 = 32 * kp + 16 * kb
                    y[16 * rg:16 * rg + 16] += a @ x[c0:c0 + 16]
        torch.testing.assert_close(y, w[layer].double() @ x, rtol=1e-12, atol=1e-12)


def pair_a_operand(block_rows: torch.Tensor, kp: int) -> torch.Tensor:
    """consume_item's A (16 x 16) for 32-column block kp of one 8-row block: lane l's 16 bytes as they lie are its
    registers R0..R3."""
    return mma_a(block_rows.reshape(-1)[kp * 256:(kp + 1) * 256].reshape(32, 4, 2))


def staged_words(x: torch.Tensor) -> torch.Tensor:
    """[B, K] -> [B, K / 16, 8, 2]: the staged input in the order InputStaging.store_x_quad documents (per 16-column
    k-step, word 2t the columns 2t, 2t + 1 and word 2t + 1 the columns 2t + 8, 2t + 9)."""
    b, k = x.shape
    v = x.reshape(b, k // 16, 2, 4, 2)                   # [seq, k-step, 8-column half h, t, e]
    return v.permute(0, 1, 3, 2, 4).reshape(b, k // 16, 8, 2)


def pair_b_operand(staged: torch.Tensor, kp: int, group: int) -> torch.Tensor:
    """consume_item's B (16 x 8) of group `group` for 32-column block kp: lane (n, t) loads word 2t + n % 2 of
    k-steps 2 kp and 2 kp + 1 of sequence 4 group + n // 2 (its group's first where that is past the batch)
    (PTX: B register 0 rows 2t, 2t + 1 of column n, register 1 rows 2t + 8, + 9)."""
    batch = staged.shape[0]
    b = torch.full((16, 8), float("nan"), dtype=torch.float64)
    for lane in range(32):
        n, t = divmod(lane, 4)
        seq = 4 * group + n // 2
        if seq >= batch:
            seq = 4 * group
        for e in range(2):
            b[2 * t + e, n] = staged[seq, 2 * kp, 2 * t + n % 2, e]
            b[2 * t + 8 + e, n] = staged[seq, 2 * kp + 1, 2 * t + n % 2, e]
    return b


@given(blocks=st.integers(1, 3), kps=st.integers(1, 4), batch=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_each_row_block_is_one_mma_per_four_sequences(blocks, kps, batch, seed):
    """Row g of sequence 4 G + j is C[g][2j] + C[g + 8][2j + 1] of group G's MMAs: W @ x, and the C columns that
    lanes past the batch fill are never read."""
    g = torch.Generator().manual_seed(seed)
    rows, k = 8 * blocks, 32 * kps
    w = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    x = torch.randn(batch, k, generator=g).to(torch.bfloat16)
    p, staged = fragment_pack(w), staged_words(x.double())
    y = torch.full((rows, batch), float("nan"), dtype=torch.float64)
    for blk in range(blocks):
        for group in range((batch + 3) // 4):
            c = torch.zeros(16, 8, dtype=torch.float64)
            for kp in range(kps):
                c += pair_a_operand(p[8 * blk:8 * blk + 8].double(), kp) @ pair_b_operand(staged, kp, group)
            for j in range(min(4, batch - 4 * group)):
                y[8 * blk:8 * blk + 8, 4 * group + j] = c[:8, 2 * j] + c[8:, 2 * j + 1]
    torch.testing.assert_close(y, w.double() @ x.double().T, rtol=1e-12, atol=1e-12)


@given(blocks=st.integers(1, 6), kps=st.integers(1, 4), lo=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_a_tile_of_whole_row_blocks_is_the_same_bytes(blocks, kps, lo, seed):
    """Rows r0 .. r0 + n (multiples of 8) of the packed matrix unpack to the same rows of the original: the
    tiles the producer copies and the rows the VM reads are row-block ranges."""
    w = torch.randn(8 * blocks, 32 * kps, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    p = fragment_pack(w)
    lo = min(lo, blocks - 1)
    assert torch.equal(fragment_unpack(p[8 * lo:]), w[8 * lo:])
    assert torch.equal(torch.sort(p[8 * lo:8 * lo + 8].reshape(-1).float())[0],
                       torch.sort(w[8 * lo:8 * lo + 8].reshape(-1).float())[0])


@pytest.mark.parametrize("shape", [(12, 32), (16, 48), (8, 16)])
def test_shapes_off_the_block_grid_are_refused(shape):
    with pytest.raises(ValueError, match="fragment_pack needs rows a multiple of 8 and columns of 32"):
        fragment_pack(torch.zeros(shape))
