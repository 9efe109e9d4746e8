"""Paged KV cache: fixed-size blocks of token slots, addressed per sequence through a block table.

Token position p of sequence b lives in block ``block_table[b, p // block_size]`` at offset
``p % block_size``. A contiguous cache is the special case of ``contiguous_block_table``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class PagedKVCache:
    k: torch.Tensor  # [L, num_blocks, block_size, Hkv, D]
    v: torch.Tensor  # [L, num_blocks, block_size, Hkv, D]
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        fill: float = math.nan,
    ) -> "PagedKVCache":
        """A cache for every layer of `config`, filled with `fill` (NaN by default, so a read of a
        slot that was never written poisons the result)."""
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k = torch.full(shape, fill, dtype=dtype, device=device)
        v = torch.full(shape, fill, dtype=dtype, device=device)
        return cls(k=k, v=v, block_size=block_size)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block index, offset) of each sequence's token at `positions` (Long [B])."""
        positions = positions.to(device=block_table.device, dtype=torch.long)
        rows = torch.arange(block_table.shape[0], device=block_table.device)
        blocks = block_table[rows, positions // self.block_size].long()
        return blocks, positions % self.block_size

    def write(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, Hkv, D] of one token per sequence at `positions` (Long [B])."""
        blocks, offsets = self.slots(block_table, positions)
        blocks, offsets = blocks.to(self.k.device), offsets.to(self.k.device)
        self.k[layer, blocks, offsets] = k.to(self.k.dtype)
        self.v[layer, blocks, offsets] = v.to(self.v.dtype)


def contiguous_block_table(batch: int, max_seq_len: int, block_size: int,
                           device: str | torch.device = "cpu") -> torch.Tensor:
    """int32 [batch, ceil(max_seq_len / block_size)]: sequence b owns blocks b*n .. b*n + n - 1."""
    n = -(-max_seq_len // block_size)
    return torch.arange(batch * n, dtype=torch.int32, device=device).view(batch, n)
