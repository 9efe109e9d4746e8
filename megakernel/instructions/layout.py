"""The shapes of one decode step: weights packed the way the tiles read them, and the activation
buffers every stage writes (each stage its own buffer per layer, so no stage overwrites what
another CTA may still be reading: write-after-read is then no hazard at all)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..model.config import ModelConfig
from ..model.ops import rope_inv_freq
from ..model.weights import ModelWeights
from .flagged import FLAGGED_BUFFERS, epoch_words, flagged_hops

# Rows a CTA's 8 consumer warps process side by side: every matvec tile is a multiple of it.
ROW_GROUP = 8
# The unit of a matrix's K columns (16 k-steps of the m16n8k16 tensor-core MMA) and of a slot's column slabs.
COL_PASS = 256
# The weight matrices the kernel streams are stored in blocks of FRAG_ROWS rows x FRAG_COLS columns, each
# 512 bytes in the order of the MMA's A-operand registers (fragment_pack).
FRAG_ROWS, FRAG_COLS = 8, 32
# Batch buckets of a step layout (the schedule, the VM, the batch-aware buffers) and of the megakernel. Past
# SPLIT_BATCH the matvec stages may split over K (split_k.py) and the kernel's consumers own row groups across a
# tile's K (megakernel.kernel.stream.slot_geometry): at batch 1-8 every consumer warp's partial sums per (row, slab,
# sequence) live in shared memory, which does not scale past it (profiles/RESULTS.md, 2026-12-03).
MAX_BATCH = 64
KERNEL_MAX_BATCH = MAX_BATCH
SPLIT_BATCH = 8
# The kernel's consumer warps up to SPLIT_BATCH (megakernel.kernel.interpreter: with the producer warp, 16).
NARROW_WARPS = 15
# The attention's tensor-core pass (megakernel.kernel.softmax_pass.stream_tokens_mma): 8-token tiles a warp's step, by
# head_dim: 4 KiB of K and V a step, its loads in flight together (at head_dim 64, 2 tiles against 1: llama-3.2-1b 4 at
# 8192 tokens 1.452 against 1.477 ms, batch 1 1.109 against 1.100; profiles/RESULTS.md, 2026-12-06 thirty-third
# session). A split of up to 8 x MMA_TILES x NARROW_WARPS positions is one step a warp.
MMA_TILES = {64: 2, 128: 1}
# The compute capability the kernel is compiled for (sm_90a): Hopper. An sm_90a cubin runs on no other GPU.
KERNEL_CAPABILITY = (9, 0)
# The DAG's rule for folding the attention split merge into O_PROJ's input staging (no ATTN_REDUCE
# stage) and the embedding into layer 0's QKV: the widest matvec input (batch x K x float32) within this,
# or staged in slabs (slab_staging). (The kernel itself stages any input, whole or in column slabs:
# megakernel.kernel.stream.X_WHOLE_BYTES; the rule keeps the programs every GPU test has run.)
X_STAGE_BYTES = 160 * 1024
# With slab_staging, a wider input is staged this many bytes (all sequences) at a time.
SLAB_STAGE_BYTES = 128 * 1024
# Shared memory of one sm_90 CTA, and what staging leaves for the instruction queue and small buffers.
SMEM_LIMIT = 227 * 1024
SMEM_RESERVE = 24 * 1024

# Past SPLIT_BATCH a matvec stage's input is the wgmma's B operand: bf16 in 8 x 8 core matrices, in shared memory
# (megakernel.kernel.matvec_wide) and in the pre-staged copies the producing stages write (StepBuffers.x_wide ..).
M_TILE = 16                 # sequences of one m-tile past SPLIT_BATCH: the wgmma's N is the batch padded to m-tiles


def m_tiles(batch: int) -> int:
    """MMA m-tiles of M_TILE sequences past SPLIT_BATCH."""
    return -(-batch // M_TILE)


WIDE_KS_PAD = 16            # bytes after each k-step's block of the staged input past SPLIT_BATCH: a warp's staging
                            # stores (32 consecutive quads of one sequence, 8 k-steps) then fall in 16 different
                            # 8-byte bank pairs, two stores each (two wavefronts, the fewest for 256 bytes)


def wide_ks_bytes(batch: int) -> int:
    """Bytes from one 16-column k-step's block of the staged input past SPLIT_BATCH to the next: the wgmma B
    operand of every sequence (the m-tiles padded to M_TILE) plus WIDE_KS_PAD."""
    return m_tiles(batch) * M_TILE * 32 + WIDE_KS_PAD


WGMMA_LBO = 128             # bytes between the two core matrices of a k-step along K (columns 0-7, 8-15)
WGMMA_SBO = 256             # bytes between core matrices along N (sequences 0-7, 8-15, ...)


def wide_x_byte(b, c, batch):
    """Past SPLIT_BATCH the staged input is the wgmma B operand (K x N, K-major, no swizzle; N the sequences of the
    padded m-tiles): k-step ks = c // 16 is a block at ks * wide_ks_bytes, in it core matrix (sequences 8j .. 8j + 7,
    columns 8h .. 8h + 7 of the k-step) at j * WGMMA_SBO + h * WGMMA_LBO: 8 rows of 16 bytes, sequence b % 8's 8
    columns in row b % 8. The byte of sequence b's column c (bf16). Plain arithmetic, for device code and host
    tests alike."""
    return ((c // 16) * wide_ks_bytes(batch) + (b // 8) * WGMMA_SBO + ((c % 16) // 8) * WGMMA_LBO + (b % 8) * 16
            + (c % 8) * 2)


@dataclass(frozen=True)
class StepLayout:
    """Everything static about a decode step: model shape, batch bucket, KV splits, cache geometry."""

    config: ModelConfig
    batch: int
    kv_splits: int
    block_size: int
    max_blocks_per_seq: int
    num_sms: int
    fuse_attn_reduce: bool | None = None   # None: wherever the matvec input is staged (stages_input)
    slab_staging: bool = False             # stage inputs wider than X_STAGE_BYTES in column slabs
    fold_embed: bool = False               # layer 0's QKV stages embed[token] itself (embed_folded)
    scratch_block: int = -1                # a cache block no sequence reads (vLLM's null block 0, where its padded
                                           # rows append): appends there are exempt from the aliasing rule; -1 none

    @property
    def max_seq_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def input_bytes(self) -> int:
        """The widest matvec input of the batch in float32: batch x max(hidden, q, intermediate) x 4. Above
        X_STAGE_BYTES a staged input is staged in slabs (slab_staging)."""
        c = self.config
        return self.batch * max(c.hidden_size, c.q_size, c.intermediate_size) * 4

    @property
    def stages_input(self) -> bool:
        """Whether every matvec's input row (all sequences, float32) fits X_STAGE_BYTES (or SLAB_STAGE_BYTES
        with slab_staging), beside an attention scratch (a G x D output per warp of 16) and 32 KiB of
        partials, with SMEM_RESERVE to spare: the DAG's rule above (fused_reduce, embed_folded)."""
        c = self.config
        k_max = max(c.hidden_size, c.q_size, c.intermediate_size)
        x_bytes = self.input_bytes
        scratch = 16 * c.gqa_group * c.head_dim * 4 + min(128 * (k_max // 512) * self.batch, 8192) * 4
        if self.slab_staging and x_bytes > X_STAGE_BYTES:   # staged (and streamed) a slab at a time
            x_bytes = SLAB_STAGE_BYTES
        return x_bytes <= X_STAGE_BYTES and x_bytes + scratch + SMEM_RESERVE <= SMEM_LIMIT

    @property
    def embed_folded(self) -> bool:
        """Layer 0's QKV tiles stage their input row from the embedding table themselves (operand a3 = 1)
        and wait on nothing; EMBED still writes x[0] (layer 0's residual) and signals the QKV stage's
        counter, which ATTN_PARTIAL of layer 0 then waits on for one more. One dependency hop and the
        EMBED instruction leave the step's critical path. Where fold_embed and the whole input is staged
        at once (not in slabs), up to SPLIT_BATCH (past it every matvec input is pre-staged by the stage that
        produces it, EMBED for x[0])."""
        return (bool(self.fold_embed) and self.stages_input and self.input_bytes <= X_STAGE_BYTES
                and self.batch <= SPLIT_BATCH)

    @property
    def fused_reduce(self) -> bool:
        """O_PROJ waits on ATTN_PARTIAL (operand a3 = splits) instead of an ATTN_REDUCE stage: up to SPLIT_BATCH it
        merges the splits while staging its input; past it (where no consumer stages its input) only with one split,
        whose ATTN_PARTIAL writes O_PROJ's pre-staged input itself (with more, ATTN_REDUCE merges and writes it)."""
        if self.fuse_attn_reduce is not None:
            return self.fuse_attn_reduce
        return self.kv_splits == 1 if self.batch > SPLIT_BATCH else self.stages_input

    def validate(self) -> None:
        """Raise ValueError for a shape the kernel cannot run, before anything is launched."""
        c = self.config
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"batch={self.batch} is outside the supported range 1..{MAX_BATCH}")
        for name, k in (("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size),
                        ("num_heads*head_dim", c.q_size)):
            if k % COL_PASS:
                raise ValueError(f"{name}={k} must be a multiple of {COL_PASS} (the unit of the kernel's column slabs)")
        for name, rows in (("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size),
                           ("qkv rows", c.qkv_rows), ("intermediate_size", c.intermediate_size)):
            if rows % ROW_GROUP:
                raise ValueError(f"{name}={rows} must be a multiple of {ROW_GROUP} rows")
        if c.head_dim not in (64, 128):
            raise ValueError(f"head_dim={c.head_dim} is not supported (64 or 128)")
        if c.gqa_group > ROW_GROUP:
            raise ValueError(f"num_heads/num_kv_heads={c.gqa_group} exceeds {ROW_GROUP} query heads per kv head")
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits={self.kv_splits} must be >= 1")
        if self.num_sms < 1:
            raise ValueError(f"num_sms={self.num_sms} must be >= 1")
        if self.fuse_attn_reduce and self.batch > SPLIT_BATCH and self.kv_splits > 1:
            raise ValueError(f"fuse_attn_reduce past batch {SPLIT_BATCH} needs kv_splits=1 (got {self.kv_splits}): "
                             f"there O_PROJ reads its input pre-staged, which ATTN_REDUCE writes for several splits")
        if self.fuse_attn_reduce and self.batch <= SPLIT_BATCH and not self.stages_input:
            raise ValueError(f"fuse_attn_reduce needs the matvec input staged in shared memory: batch "
                             f"{self.batch} x K {max(c.hidden_size, c.q_size, c.intermediate_size)} x 4 bytes "
                             f"does not fit (at most {X_STAGE_BYTES}, with the CTA's other buffers within "
                             f"{SMEM_LIMIT})")
        if self.block_size < 1 or self.max_blocks_per_seq < 1:
            raise ValueError(f"block_size={self.block_size} and max_blocks_per_seq={self.max_blocks_per_seq} must be >= 1")
        if self.scratch_block < -1:
            raise ValueError(f"scratch_block={self.scratch_block} must be a block id (>= 0) or -1 (none)")


def tile_rows(rows: int, num_sms: int, group: int = ROW_GROUP) -> int:
    """Rows per tile: a multiple of `group`, so that the stage spreads over about num_sms tiles."""
    groups = rows // group
    return group * max(1, math.ceil(groups / num_sms))


def require_kernel_batch(batch: int) -> None:
    """ValueError for a batch the device code does not run (StepLayout takes buckets up to MAX_BATCH, for the
    schedule and the VM; the megakernel up to KERNEL_MAX_BATCH)."""
    if not 1 <= batch <= KERNEL_MAX_BATCH:
        raise ValueError(f"batch={batch} is outside the megakernel's range 1..{KERNEL_MAX_BATCH}")


def default_kv_splits(config: ModelConfig, batch: int, num_sms: int, max_seq_len: int = 4096) -> int:
    """KV splits per (sequence, kv head): as many items as fit the SMs one each (more would give some SMs
    two splits in a row, the attention stage's time twice), at least 4 (H200, llama-3.2-1b 1, a 512-position
    cache: 4 splits 1.29 ms a step, 2 splits 1.32, 17 splits 1.47), and enough that a split of the whole cache is
    one tensor-core step a consumer warp (8 x MMA_TILES x NARROW_WARPS positions: 120 at head_dim 128, 240 at 64):
    a warp's second step is a second round trip in series, each extra split one more partial to merge. H100,
    qwen3-0.6b 1, a 736-position cache, ms a step: 4 splits 0.703 at positions 512-571 against 0.658 and 0.657
    with 6 and 8 (7 by this rule); 0.606 against 0.581 with 7 at positions 32-91 (7 keep a split on the per-warp
    pass to 105 positions); 0.630 against 0.643 with 7 at 200-259, where 4 splits are one step a warp already and
    the 3 more partials cost. llama-3.2-1b 1 at 512 positions: 4 splits 0.894, 8 splits 0.902 (profiles/RESULTS.md,
    2026-12-07 forty-third session). Past SPLIT_BATCH (long splits streamed on the CUDA cores) the SMs cap the
    count first wherever there are 4 or more KV heads."""
    if batch < 1:
        raise ValueError(f"batch={batch} is outside the supported range 1..{MAX_BATCH}")
    items = batch * config.num_kv_heads
    by_sms = max(1, num_sms // items)
    step = 8 * MMA_TILES.get(config.head_dim, 1) * NARROW_WARPS
    by_len = max(4, math.ceil(max_seq_len / step))
    return max(1, min(32, by_sms, by_len))


def validate_step_inputs(layout: StepLayout, tokens, positions, block_table=None, num_blocks: int | None = None) -> None:
    """ValueError, before anything runs, for step inputs the kernel must not see: wrong shapes, token
    ids outside the vocabulary, positions outside [0, max_seq_len), block ids outside the cache, a
    block table whose new-token slots alias cached ones (check_block_aliasing)."""
    tokens, positions = torch.as_tensor(tokens), torch.as_tensor(positions)
    for name, t in (("tokens", tokens), ("positions", positions)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be integer ids; got dtype {t.dtype}")
    if tokens.shape != (layout.batch,) or positions.shape != (layout.batch,):
        raise ValueError(f"tokens and positions must have shape ({layout.batch},); got "
                         f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
    t_cpu, p_cpu = tokens.cpu(), positions.cpu()
    vocab = layout.config.vocab_size
    if int(t_cpu.min()) < 0 or int(t_cpu.max()) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}); got {t_cpu.tolist()}")
    if int(p_cpu.min()) < 0 or int(p_cpu.max()) >= layout.max_seq_len:
        raise ValueError(f"position {int(p_cpu.max()) if int(p_cpu.max()) >= layout.max_seq_len else int(p_cpu.min())} "
                         f"is past the KV cache: positions must be in [0, {layout.max_seq_len}); got {p_cpu.tolist()}")
    if block_table is not None:
        bt = torch.as_tensor(block_table)
        if bt.shape != (layout.batch, layout.max_blocks_per_seq):
            raise ValueError(f"block_table must have shape ({layout.batch}, {layout.max_blocks_per_seq}); "
                             f"got {tuple(bt.shape)}")
        bt_cpu = bt.cpu()
        if num_blocks is not None and (int(bt_cpu.min()) < 0 or int(bt_cpu.max()) >= num_blocks):
            raise ValueError(f"block_table entries must be in [0, {num_blocks})")
        # (the DeepSeek and Kimi Linear layouts, which share this check, have no scratch block)
        check_block_aliasing(bt_cpu, p_cpu, layout.block_size, getattr(layout, "scratch_block", -1))


def aliased_appends(block_table: torch.Tensor, positions: torch.Tensor, block_size: int,
                    scratch_block: int = -1) -> dict[int, str]:
    """The sequences whose KV append this step (the slot of position pos[b] in b's table) lands on a slot that an
    attention of the same step reads (a position < pos[o] of any sequence o, through o's table) or that another
    sequence appends to: {b: why}. Blocks shared read-only between sequences (prefix sharing) are fine; appends
    into `scratch_block` (a block no sequence reads, e.g. vLLM's null block) are exempt. The kernel applies the
    same rule itself (attention's scan_aliasing): those sequences' K/V are not written and the step fails."""
    bt, pos = block_table.cpu().long(), positions.cpu().long()
    B = bt.shape[0]

    def slot(b: int, t: torch.Tensor) -> torch.Tensor:
        return bt[b, t // block_size] * block_size + t % block_size

    writes = [int(slot(b, pos[b:b + 1])[0]) for b in range(B)]
    out: dict[int, str] = {}
    for b in range(B):
        blk, off = divmod(writes[b], block_size)
        if blk == scratch_block:
            continue
        for o in range(B):
            if o != b and writes[o] == writes[b]:
                out.setdefault(b, f"sequences {o} and {b} both append their token to KV slot {off} of block {blk}: "
                                  f"check the block_table")
            if writes[b] in slot(o, torch.arange(int(pos[o]))).tolist():
                out.setdefault(b, f"the KV slot sequence {b} appends to at position {int(pos[b])} (block {blk}) is "
                                  f"one sequence {o} reads in the same step: the block_table maps two positions to "
                                  f"one slot")
    return out


def check_block_aliasing(block_table: torch.Tensor, positions: torch.Tensor, block_size: int,
                         scratch_block: int = -1) -> None:
    """ValueError naming the first sequence of aliased_appends (a KV append onto a slot the step reads or another
    sequence appends to)."""
    bad = aliased_appends(block_table, positions, block_size, scratch_block)
    if bad:
        raise ValueError(bad[min(bad)])


@dataclass
class PackedWeights:
    """Weights stacked per matrix kind across layers, in the row order the tiles stream; the five
    streamed matrices (qkv, o_proj, gate_up, down, lm_head) in fragment order (fragment_pack: read rows of
    them with fragment_unpack), the embedding table row-major (one row is gathered per token).

    ``gate_up`` interleaves groups of ROW_GROUP gate rows with the matching ROW_GROUP up rows, so a
    tile of 2*n*ROW_GROUP consecutive rows holds n complete (gate, up) pairs.
    """

    embed: torch.Tensor        # [V, H]
    qkv: torch.Tensor          # [L, qkv_rows, H]
    o_proj: torch.Tensor       # [L, H, q_size]
    gate_up: torch.Tensor      # [L, 2F, H] interleaved by ROW_GROUP
    down: torch.Tensor         # [L, H, F]
    lm_head: torch.Tensor      # [V, H]
    attn_norm: torch.Tensor    # [L, H]
    mlp_norm: torch.Tensor     # [L, H]
    final_norm: torch.Tensor   # [H]
    q_norm: torch.Tensor       # [L, D] (ones when the model has no QK-norm; unused then)
    k_norm: torch.Tensor       # [L, D]
    rope_cos: torch.Tensor     # [max_seq_len, D/2] float32
    rope_sin: torch.Tensor     # [max_seq_len, D/2] float32

    def to(self, device) -> "PackedWeights":
        return PackedWeights(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def packed_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every PackedWeights field but the RoPE tables (whose rows are positions), for a model."""
    c = config
    L, H, F, V, D = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    return {"embed": (V, H), "qkv": (L, c.qkv_rows, H), "o_proj": (L, H, c.q_size), "gate_up": (L, 2 * F, H),
            "down": (L, H, F), "lm_head": (V, H), "attn_norm": (L, H), "mlp_norm": (L, H), "final_norm": (H,),
            "q_norm": (L, D), "k_norm": (L, D)}


def validate_packed_weights(packed, layout: StepLayout, device=None, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError, naming the field, unless `packed` is weights the kernel can read for this layout: a
    PackedWeights (from pack_weights) whose matrices and norms have the model's shapes, in `dtype`,
    contiguous, 16-byte aligned, on `device` (when given), and whose float32 RoPE tables have a row for
    every position the step may decode (layout.max_seq_len, the cache rounded up to whole blocks)."""
    if not isinstance(packed, PackedWeights):
        raise ValueError(f"packed_weights must be a PackedWeights (from pack_weights(weights, max_seq_len)); "
                         f"got {type(packed).__name__}")
    c = layout.config
    device = None if device is None else torch.device(device)
    expected = packed_weight_shapes(c)
    whole = getattr(layout, "full_config", None)
    if whole is not None:
        # a tensor-parallel rank (a ShardLayout) embeds any token id: its embedding is the whole model's
        expected["embed"] = (whole.vocab_size, c.hidden_size)
    half = c.head_dim // 2
    for f in fields(PackedWeights):
        t = getattr(packed, f.name)
        name = f"packed_weights.{f.name}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is a {type(t).__name__}, not a tensor")
        if f.name in ("rope_cos", "rope_sin"):
            if t.dim() != 2 or t.shape[1] != half:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (positions, {half}) for head_dim "
                                 f"{c.head_dim} of {c.name}")
            if t.shape[0] < layout.max_seq_len:
                raise ValueError(f"{name} has {t.shape[0]} positions; this engine decodes positions up to "
                                 f"{layout.max_seq_len - 1} (max_seq_len rounded up to whole blocks of "
                                 f"{layout.block_size}): pack with pack_weights(weights, {layout.max_seq_len}) "
                                 f"or more")
            want_dtype = torch.float32
        else:
            if tuple(t.shape) != expected[f.name]:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; {c.name} needs {expected[f.name]}")
            want_dtype = dtype
        if t.dtype != want_dtype:
            raise ValueError(f"{name} is {t.dtype}; the kernel reads {want_dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}; the engine runs on {device}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (strides {tuple(t.stride())}, "
                             f"address {t.data_ptr():#x})")


def fragment_pack(w: torch.Tensor) -> torch.Tensor:
    """[..., R, K] row-major -> the same shape and bytes, each block of 8 rows x 32 columns (512 bytes)
    reordered so that lane l of a warp finds its 16 bytes of the block at offset 16 * l: row l // 4, columns
    2t, 2t+1, 2t+8, 2t+9 (t = l % 4) of each 16-column half, which are the A-operand registers of an
    m16n8k16 MMA for those 8 rows (the other 8 rows of the MMA are the next row block). A row block (8 rows x
    K) stays where it was, so a tile of rows r0 .. r0 + n (multiples of 8) is the same bytes in both orders;
    inside it the 512-byte blocks follow each other by column. R must be a multiple of 8, K of 32."""
    *lead, r, k = w.shape
    if r % FRAG_ROWS or k % FRAG_COLS:
        raise ValueError(f"fragment_pack needs rows a multiple of {FRAG_ROWS} and columns of {FRAG_COLS}; "
                         f"got {tuple(w.shape)}")
    n = len(lead)
    # [row block, row, column block, 16-col half kb, 8-col half h, t, e] -> [rb, cb, row, t, kb, h, e]
    v = w.reshape(*lead, r // 8, 8, k // 32, 2, 2, 4, 2)
    return v.permute(*range(n), n, n + 2, n + 1, n + 5, n + 3, n + 4, n + 6).reshape(*lead, r, k).contiguous()


def fragment_unpack(p: torch.Tensor) -> torch.Tensor:
    """The inverse of fragment_pack: rows r0 .. r0 + n (multiples of 8) of a packed matrix -> row-major."""
    *lead, r, k = p.shape
    n = len(lead)
    v = p.reshape(*lead, r // 8, k // 32, 8, 4, 2, 2, 2)            # [rb, cb, row, t, kb, h, e]
    return v.permute(*range(n), n, n + 2, n + 1, n + 4, n + 5, n + 3, n + 6).reshape(*lead, r, k)


def streamed_rows(weights, rows: torch.Tensor) -> torch.Tensor:
    """Row-major rows (a multiple of 8) of one of the streamed matrices of `weights`: PackedWeights holds
    them in fragment order (the dense kernel's layout); the DeepSeek and Kimi Linear packs, which have no
    device code yet, hold them row-major."""
    return fragment_unpack(rows) if isinstance(weights, PackedWeights) else rows


def interleave_gate_up(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """[2F, H] (gate rows then up rows) -> [2F, H] with groups of ROW_GROUP gate/up rows alternating."""
    f, h = intermediate_size, gate_up.shape[-1]
    gate = gate_up[:f].reshape(f // ROW_GROUP, ROW_GROUP, h)
    up = gate_up[f:].reshape(f // ROW_GROUP, ROW_GROUP, h)
    return torch.stack([gate, up], dim=1).reshape(2 * f, h)


def pack_weights(weights: ModelWeights, max_seq_len: int) -> PackedWeights:
    c = weights.config
    layers = weights.layers
    dtype = weights.embed.dtype
    if c.qk_norm:
        q_norm = torch.stack([lw.q_norm for lw in layers])
        k_norm = torch.stack([lw.k_norm for lw in layers])
    else:
        q_norm = torch.ones(c.num_layers, c.head_dim, dtype=dtype, device=weights.embed.device)
        k_norm = q_norm.clone()
    # float32 angles, then cos/sin: the same table rope_cos_sin gives the reference decoder
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * rope_inv_freq(c).float()[None, :]
    return PackedWeights(
        embed=weights.embed,
        qkv=fragment_pack(torch.stack([lw.qkv for lw in layers])),
        o_proj=fragment_pack(torch.stack([lw.o_proj for lw in layers])),
        gate_up=fragment_pack(torch.stack([interleave_gate_up(lw.gate_up, c.intermediate_size) for lw in layers])),
        down=fragment_pack(torch.stack([lw.down for lw in layers])),
        lm_head=fragment_pack(weights.lm_head),
        attn_norm=torch.stack([lw.attn_norm for lw in layers]).contiguous(),
        mlp_norm=torch.stack([lw.mlp_norm for lw in layers]).contiguous(),
        final_norm=weights.final_norm,
        q_norm=q_norm.contiguous(),
        k_norm=k_norm.contiguous(),
        rope_cos=torch.cos(angles).contiguous(),
        rope_sin=torch.sin(angles).contiguous(),
    )


@dataclass
class StepBuffers:
    """Device (or CPU, for the VM) state of decode steps. Inputs: tokens, positions, block_table.
    Outputs: out_tokens, logits; x[L] of a program without the LM head (lm_tiles = 0), whose logits,
    lm_max and lm_idx are then empty ([B, 0]). Everything else is scratch the stages hand to each other; x, h,
    act and qkv at batch 1 on one GPU as the value views of flagged pairs (allocate_buffers, epoch_words)."""

    tokens: torch.Tensor       # int32 [B]
    positions: torch.Tensor    # int32 [B]: position of the token being decoded (seq_len - 1)
    block_table: torch.Tensor  # int32 [B, max_blocks_per_seq]
    x: torch.Tensor            # f32 [L+1, B, H]: residual stream entering layer l (x[L] leaves the last)
    h: torch.Tensor            # f32 [L, B, H]: residual after attention
    qkv: torch.Tensor          # f32 [L, B, qkv_rows]
    attn_part_o: torch.Tensor  # f32 [L, B, Hq, S, D]
    attn_part_lse: torch.Tensor  # f32 [L, B, Hq, S]
    attn_out: torch.Tensor     # f32 [L, B, q_size]
    act: torch.Tensor          # f32 [L, B, F]
    # K-range partials of the stages split over K (split_k.py; [L, 0, B, rows] where a stage is not split)
    part_qkv: torch.Tensor     # f32 [L, E, B, qkv_rows]
    part_o: torch.Tensor       # f32 [L, E, B, H]
    part_down: torch.Tensor    # f32 [L, E, B, H]
    # Past SPLIT_BATCH (empty up to it): the matvec inputs as the stages that produce them write them a second
    # time, for the consumers to bring in with bulk copies (docs/batch_path.md): bf16 in the wgmma B layout
    # (wide_input), times the norm weight of the stage that reads them (x[l]: attn_norm[l], x[L]: final_norm,
    # h[l]: mlp_norm[l], act: none), and the sums of squares of x and h per 8 rows (input_ssq), from which the
    # consumers take the RMS scale
    x_wide: torch.Tensor       # bf16 [L+1, H/16, wide_ks_bytes/2]
    h_wide: torch.Tensor       # bf16 [L, H/16, wide_ks_bytes/2]
    attn_wide: torch.Tensor    # bf16 [L, q_size/16, wide_ks_bytes/2]: the attention output (ATTN_PARTIAL of a
                               # single split, else ATTN_REDUCE), no norm
    act_wide: torch.Tensor     # bf16 [L, F/16, wide_ks_bytes/2]
    x_ssq: torch.Tensor        # f32 [L+1, B, H/8]
    h_ssq: torch.Tensor        # f32 [L, B, H/8]
    logits: torch.Tensor       # f32 [B, V] ([B, 0] without the LM head)
    lm_max: torch.Tensor       # f32 [B, T]
    lm_idx: torch.Tensor       # int32 [B, T]
    out_tokens: torch.Tensor   # int32 [B]
    counters: torch.Tensor     # int32 [num_counters]
    sync: torch.Tensor         # int32 [4]: epoch, CTAs done, spare, spare
    error: torch.Tensor        # int32 [4]: code, instruction index, counter, observed value

    def epochs(self) -> list[torch.Tensor]:
        """The int32 epoch halves of x, h, act and qkv where they are flagged (allocate_buffers at flagged_hops),
        else none: a word is this step's once its epoch is the step's (the engine's sync[0] + 1)."""
        return [epoch_words(getattr(self, n)) for n in FLAGGED_BUFFERS if getattr(self, n).stride(-1) == 2]

    def poison(self) -> None:
        """NaN every float scratch buffer, so a value a stage forgot to write fails the checks."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t.is_floating_point() and f.name not in ("logits",):
                t.fill_(float("nan"))
        self.logits.fill_(float("nan"))
        self.out_tokens.fill_(-1)


def part_buffers(layout: StepLayout, device="cpu") -> dict[str, torch.Tensor]:
    """The K-range partial buffers of StepBuffers, sized by split_k.k_splits (E ranges; 0 where not split)."""
    from .matvec_stages import PART_BUFFERS, weight_rows
    from .split_k import k_splits

    out = {}
    for op, name in PART_BUFFERS.items():
        e = k_splits(layout, op)
        rows, _ = weight_rows(op, layout)
        out[name] = torch.empty(layout.config.num_layers, e if e > 1 else 0, layout.batch, rows,
                                dtype=torch.float32, device=device)
    return out


def wide_buffers(layout: StepLayout, device="cpu") -> dict[str, torch.Tensor]:
    """The pre-staged inputs of StepBuffers (x_wide .. h_ssq): sized past SPLIT_BATCH, empty up to it."""
    c, B = layout.config, layout.batch
    L, H, F = c.num_layers, c.hidden_size, c.intermediate_size
    on = B > SPLIT_BATCH
    ks = wide_ks_bytes(B) // 2 if on else 0
    bf16 = dict(dtype=torch.bfloat16, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    return {"x_wide": torch.empty(L + 1, H // 16 if on else 0, ks, **bf16),
            "h_wide": torch.empty(L, H // 16 if on else 0, ks, **bf16),
            "attn_wide": torch.empty(L, c.q_size // 16 if on else 0, ks, **bf16),
            "act_wide": torch.empty(L, F // 16 if on else 0, ks, **bf16),
            "x_ssq": torch.empty(L + 1, B if on else 0, H // 8, **f32),
            "h_ssq": torch.empty(L, B if on else 0, H // 8, **f32)}


def wide_input_index(batch: int, k: int) -> torch.Tensor:
    """int64 [batch, k]: the bf16 element (wide_x_byte / 2) of sequence b's column c in a pre-staged input."""
    b = torch.arange(batch)[:, None]
    c = torch.arange(k)[None, :]
    return wide_x_byte(b, c, batch) // 2


def wide_input(values: torch.Tensor, gamma: torch.Tensor | None, batch: int) -> torch.Tensor:
    """A pre-staged input as its producing stage writes it: bf16 [K/16, wide_ks_bytes/2] holding round(values[b, c]
    x gamma[c]) (float32 product, rounded once) at wide_input_index; zero in the padded sequences and padding."""
    k = values.shape[-1]
    y = values.float() * (gamma.float() if gamma is not None else 1.0)
    out = torch.zeros(k // 16 * (wide_ks_bytes(batch) // 2), dtype=torch.bfloat16, device=values.device)
    out[wide_input_index(batch, k).to(values.device).flatten()] = y.to(torch.bfloat16).flatten()
    return out.view(k // 16, wide_ks_bytes(batch) // 2)


def input_ssq(values: torch.Tensor) -> torch.Tensor:
    """Sums of squares of [B, K] values per 8 consecutive columns (a core matrix row): f32 [B, K/8], summed in
    float64."""
    b, k = values.shape
    return values.double().square().view(b, k // 8, 8).sum(-1).float()


def attention_output(bufs: StepBuffers, layout: StepLayout, layer: int) -> torch.Tensor:
    """f32 [B, q_size]: the attention output of a layer that O_PROJ reads: the merge of the splits' partials where
    O_PROJ waits on ATTN_PARTIAL (StepLayout.fused_reduce), else ATTN_REDUCE's attn_out."""
    from .attention import merge_splits

    if layout.fused_reduce:
        return merge_splits(bufs.attn_part_lse[layer], bufs.attn_part_o[layer]).reshape(layout.batch, -1)
    return bufs.attn_out[layer]


def fill_wide_inputs(bufs: StepBuffers, weights: "PackedWeights", layout: StepLayout) -> None:
    """The pre-staged inputs (x_wide .. h_ssq) derived from x, h, act and the attention's partials or output as
    the producing stages write them (for stage tests, which fill those at random); nothing up to SPLIT_BATCH."""
    if layout.batch <= SPLIT_BATCH:
        return
    L, B = layout.config.num_layers, layout.batch
    for l in range(L + 1):
        gamma = weights.attn_norm[l] if l < L else weights.final_norm
        bufs.x_wide[l].copy_(wide_input(bufs.x[l], gamma, B))
        bufs.x_ssq[l].copy_(input_ssq(bufs.x[l]))
    for l in range(L):
        bufs.h_wide[l].copy_(wide_input(bufs.h[l], weights.mlp_norm[l], B))
        bufs.h_ssq[l].copy_(input_ssq(bufs.h[l]))
        bufs.act_wide[l].copy_(wide_input(bufs.act[l], None, B))
        bufs.attn_wide[l].copy_(wide_input(attention_output(bufs, layout, l), None, B))


def allocate_buffers(layout: StepLayout, lm_tiles: int, num_counters: int, device="cpu") -> StepBuffers:
    """The step's buffers, float ones poisoned. lm_tiles = 0 (a program without the LM head): no logits. Where
    flagged_hops, x, h, act and qkv are views of the value halves of {value, epoch} pairs (epoch_words: the other
    halves, zero), so every reader and writer of those buffers goes on indexing [layer, sequence, column]."""
    if lm_tiles < 0:
        raise ValueError(f"lm_tiles={lm_tiles} must be >= 0")
    c, b, s = layout.config, layout.batch, layout.kv_splits
    f32 = dict(dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    L, H = c.num_layers, c.hidden_size

    def activation(shape) -> torch.Tensor:
        # flagged: the value halves of zeroed {value, epoch} pairs (epoch 0 is no step's: steps count from 1)
        if flagged_hops(layout):
            return torch.zeros(*shape, 2, **f32)[..., 0]
        return torch.empty(shape, **f32)

    bufs = StepBuffers(
        tokens=torch.zeros(b, **i32),
        positions=torch.zeros(b, **i32),
        block_table=torch.zeros(b, layout.max_blocks_per_seq, **i32),
        x=activation((L + 1, b, H)),
        h=activation((L, b, H)),
        qkv=activation((L, b, c.qkv_rows)),
        attn_part_o=torch.empty(L, b, c.num_heads, s, c.head_dim, **f32),
        attn_part_lse=torch.empty(L, b, c.num_heads, s, **f32),
        attn_out=torch.empty(L, b, c.q_size, **f32),
        act=activation((L, b, c.intermediate_size)),
        **part_buffers(layout, device),
        **wide_buffers(layout, device),
        logits=torch.empty(b, c.vocab_size if lm_tiles else 0, **f32),
        lm_max=torch.empty(b, lm_tiles, **f32),
        lm_idx=torch.zeros(b, lm_tiles, **i32),
        out_tokens=torch.zeros(b, **i32),
        counters=torch.zeros(num_counters, **i32),
        sync=torch.zeros(4, **i32),
        error=torch.zeros(4, **i32),
    )
    bufs.poison()
    return bufs
