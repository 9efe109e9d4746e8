"""What a rank of a tensor-parallel step sees: its ShardLayout (a StepLayout over its shard of the model, plus
its rank), its buffers (the dense StepBuffers plus the receive buffers its peers store partial sums into) and
a StageContext that also reaches every rank's buffers (on the GPU: the peers' buffer addresses, mapped for
peer-to-peer stores)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ...model.config import ModelConfig
from ...model.tensor_parallel import shard_config
from ..context import StageContext
from ..layout import COL_PASS, ROW_GROUP, SPLIT_BATCH, StepBuffers, StepLayout, allocate_buffers


@dataclass(frozen=True)
class ShardLayout(StepLayout):
    """One rank's step: a StepLayout whose config is the rank's shard (model.tensor_parallel.shard_config:
    the whole hidden size, 1/world_size of the heads, the FFN and the vocabulary), so the dense stages run on
    it unchanged, plus the whole model's config, the rank and the world size, which the exchange stages read
    (a rank's slot in every peer's receive buffers, its first vocabulary row)."""

    full_config: ModelConfig | None = None
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, layout: StepLayout, world_size: int, rank: int = 0) -> "ShardLayout":
        """Rank `rank`'s layout of the step `layout` (of the whole model) split over world_size ranks;
        ValueError naming the field where the model does not split (model.tensor_parallel.check_world_size)."""
        base = {f.name: getattr(layout, f.name) for f in fields(StepLayout)}
        base["config"] = shard_config(layout.config, world_size)
        return cls(**base, full_config=layout.config, rank=rank, world_size=world_size)

    @property
    def full(self) -> StepLayout:
        """The same step on one GPU: the layout of the whole model."""
        base = {f.name: getattr(self, f.name) for f in fields(StepLayout)}
        return StepLayout(**{**base, "config": self.full_config})

    @property
    def vocab_offset(self) -> int:
        """The vocabulary id of this rank's first LM head row."""
        return self.rank * self.config.vocab_size

    def validate(self) -> None:
        """ValueError for a step the ranks cannot run: what StepLayout.validate refuses for the whole model, a
        batch past SPLIT_BATCH, a rank out of range, or a shard whose rows are no whole number of ROW_GROUP-row
        groups. (The device code also needs the shard's matvec inputs q_size/W and F/W in whole column passes,
        which require_kernel_shard checks; the CPU schedule does not depend on it.)"""
        self.full.validate()
        if self.batch > SPLIT_BATCH:
            raise ValueError(f"batch={self.batch}: tensor parallel runs batches up to {SPLIT_BATCH} (past it the "
                             f"attention sums QKV's K-range partials, which the tensor-parallel program does not "
                             f"split into)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside 0..{self.world_size - 1}")
        c, full = self.config, self.full_config
        for name, rows, whole in (("intermediate_size", c.intermediate_size, full.intermediate_size),
                                  ("vocab_size", c.vocab_size, full.vocab_size)):
            if rows % ROW_GROUP:
                raise ValueError(f"{name}={whole} / world_size={self.world_size} = {rows} rows per rank must be "
                                 f"a multiple of {ROW_GROUP} (a tile's row group)")


def require_kernel_shard(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the field unless the megakernel's device code runs a rank of `config` split world_size
    ways: the shard itself (model.tensor_parallel.check_world_size), and a rank's O and down projections reading
    whole passes of COL_PASS columns (q_size / W and intermediate_size / W)."""
    shard = shard_config(config, world_size)
    for name, cols in (("q_size", shard.q_size), ("intermediate_size", shard.intermediate_size)):
        if cols % COL_PASS:
            raise ValueError(f"{name} / world_size = {cols}: a rank's O and down projections read whole passes of "
                             f"{COL_PASS} columns")


@dataclass
class TPStepBuffers(StepBuffers):
    """A rank's buffers: the dense StepBuffers over its shard (qkv, attention, act and logits of its own heads,
    FFN slice and vocabulary; x and h whole, replicated), lm_max / lm_idx with one slot per LM head tile of
    every rank, and the receive buffers: slot s of recv_o[l] (recv_down[l]) holds rank s's partial sum of
    layer l's O projection (down projection), stored there by rank s."""

    recv_o: torch.Tensor       # f32 [L, W, B, H]
    recv_down: torch.Tensor    # f32 [L, W, B, H]


def allocate_tp_buffers(layout: ShardLayout, lm_tiles: int, num_counters: int, device="cpu") -> TPStepBuffers:
    """A rank's buffers, float ones poisoned; `lm_tiles` is the LM head tiles of one rank (lm_max and lm_idx
    get world_size times as many slots)."""
    base = allocate_buffers(layout, layout.world_size * lm_tiles, num_counters, device)
    c = layout.config
    shape = (c.num_layers, layout.world_size, layout.batch, c.hidden_size)
    bufs = TPStepBuffers(**{f.name: getattr(base, f.name) for f in fields(StepBuffers)},
                         recv_o=torch.empty(shape, dtype=torch.float32, device=device),
                         recv_down=torch.empty(shape, dtype=torch.float32, device=device))
    bufs.poison()
    return bufs


@dataclass
class TPStageContext(StageContext):
    """A rank's StageContext (its ShardLayout, packed shard weights, TPStepBuffers and the KV cache of its own
    kv heads) plus `peers`: every rank's TPStepBuffers in rank order, its own included, where the exchange
    stages store."""

    peers: list = field(default_factory=list)
