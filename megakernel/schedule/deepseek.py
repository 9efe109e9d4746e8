"""The decode step of DeepSeek-V3 / Kimi-K2 (MLA + MoE): its layout, packed weights, buffers, instruction
DAG, and a CPU decoder that runs the serialized per-SM queues through the instruction VM.

The same generic machinery as the dense model: Instruction records, `serialize`, `assign` /
`simulate`, `find_races`, `InstructionVM` (it dispatches on the opcode through STAGE_MODULES). What is
DeepSeek-specific lives in megakernel/instructions/deepseek/ (one module per stage) and here.

Stages of layer l (each instruction waits on one counter and signals one; a consumer waits for the
whole producing stage, and release/acquire chains make that transitive):

    MLA_QKV_A tiles       wait x[l]'s producer      signal QKV_A
    MLA_Q_B tiles         wait QKV_A                 signal Q_B           (q LoRA only)
    MLA_ABSORB tiles      wait Q_B (or QKV_A)        signal ABSORB        (per head, whole batch)
    MLA_PARTIAL           wait ABSORB                signal PARTIAL       (sequence, head group, split)
    MLA_REDUCE tiles      wait PARTIAL               signal REDUCE        (per head, whole batch; W_UV)
    MLA_O_PROJ tiles      wait REDUCE                signal O_PROJ
  dense layer:
    GATE_UP tiles         wait O_PROJ                signal GATE_UP
    DOWN tiles            wait GATE_UP               signal DOWN          -> x[l+1]
  MoE layer (two branches joined by one counter, MOE_OUT):
    ROUTER tiles          wait O_PROJ                signal ROUTER
    SHARED_GATE_UP tiles  wait O_PROJ                signal SHARED_GATE_UP
    ROUTER_TOPK (one)     wait ROUTER                signal TOPK
    SHARED_DOWN tiles     wait SHARED_GATE_UP        signal MOE_OUT
    EXPERT_GATE_UP        wait TOPK                  signal EXPERT_GATE_UP (sequence, slot, row tile)
    EXPERT_DOWN           wait EXPERT_GATE_UP        signal MOE_OUT        (sequence, slot, row tile)
    MOE_COMBINE tiles     wait MOE_OUT               signal COMBINE       -> x[l+1]

The routed-expert instructions exist for every (sequence, slot) whatever the routing: they read the
expert id from the buffer ROUTER_TOPK writes, so the program (and the serialized queues) depend only
on the layout, never on the tokens.

Departures from a literal reading of the design sketch, and why:
* the W_UK absorption is its own stage (MLA_ABSORB, tiles of the per-head W_UK^T, every sequence at
  once) instead of being recomputed inside each (sequence, head group, split) partial: W_UK is then
  streamed once per step rather than batch * splits times (Kimi-K2: 8 MB per layer per copy);
  likewise MLA_REDUCE serves the whole batch per W_UV tile;
* the router is ROUTER tiles (scores) + one ROUTER_TOPK: Kimi-K2's float32 router is 11 MB per
  layer, too much for one SM to stream on the critical path.

Known cost of a routing-independent schedule: two sequences that pick the same expert stream its
weights twice (one instruction per (sequence, slot)); at batch 1 nothing is duplicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..instructions import STAGE_MODULES
from ..instructions.layout import MAX_BATCH, ROW_GROUP, interleave_gate_up
from ..instructions.opcodes import Opcode
from ..instructions.record import Instruction, serialize
from ..model.deepseek.config import DeepseekConfig
from ..model.deepseek.reference import LatentKVCache, rope_inv_freq
from ..model.deepseek.weights import ROUTER_DTYPE, DeepseekWeights
from .assign import assign, simulate
from .dag import FIXED_COST_BYTES, StepProgram, tile_rows
from .vm import InstructionVM, run_vm_step

# Query heads an MLA_PARTIAL scores side by side: they share every latent row it loads.
MAX_HEAD_GROUP = 16
MAX_KV_SPLITS = 32


# ---- layout ---------------------------------------------------------------------------------------

def default_head_group(config: DeepseekConfig) -> int:
    """The largest divisor of num_heads up to MAX_HEAD_GROUP."""
    return max(g for g in range(1, min(config.num_heads, MAX_HEAD_GROUP) + 1) if config.num_heads % g == 0)


def default_kv_splits(config: DeepseekConfig, batch: int, num_sms: int, head_group: int) -> int:
    """Enough (sequence, head group, split) items to give every SM about one."""
    items = max(1, batch * (config.num_heads // max(1, head_group)))
    return max(1, min(MAX_KV_SPLITS, math.ceil(num_sms / items)))


@dataclass(frozen=True)
class DeepseekStepLayout:
    """Everything static about a DeepSeek decode step: model shape, batch bucket, head grouping,
    KV splits, latent cache geometry."""

    config: DeepseekConfig
    batch: int
    kv_splits: int
    block_size: int
    max_blocks_per_seq: int
    num_sms: int
    head_group: int

    @classmethod
    def for_model(cls, config: DeepseekConfig, batch: int, max_seq_len: int, block_size: int = 16,
                  num_sms: int = 132, kv_splits: int | None = None,
                  head_group: int | None = None) -> "DeepseekStepLayout":
        """The layout of a model at a batch size and cache length, defaults filled in; ValueError for
        an unsupported one."""
        if block_size < 1 or max_seq_len < 1:
            raise ValueError(f"block_size={block_size} and max_seq_len={max_seq_len} must be >= 1")
        g = head_group or default_head_group(config)
        layout = cls(config=config, batch=batch,
                     kv_splits=kv_splits or default_kv_splits(config, batch, num_sms, g),
                     block_size=block_size, max_blocks_per_seq=-(-max_seq_len // block_size), num_sms=num_sms,
                     head_group=g)
        layout.validate()
        return layout

    @property
    def max_seq_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def num_head_groups(self) -> int:
        return self.config.num_heads // self.head_group

    @property
    def num_dense_layers(self) -> int:
        return self.config.num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.config.num_moe_layers

    def validate(self) -> None:
        """Raise ValueError for a shape the schedule cannot express, before anything runs."""
        c = self.config
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"batch={self.batch} is outside the supported range 1..{MAX_BATCH}")
        if self.head_group < 1 or c.num_heads % self.head_group:
            raise ValueError(f"head_group={self.head_group} must divide num_heads={c.num_heads}")
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits={self.kv_splits} must be >= 1")
        if self.num_sms < 1:
            raise ValueError(f"num_sms={self.num_sms} must be >= 1")
        if self.block_size < 1 or self.max_blocks_per_seq < 1:
            raise ValueError(f"block_size={self.block_size} and max_blocks_per_seq={self.max_blocks_per_seq} "
                             "must be >= 1")
        rows = [("hidden_size", c.hidden_size), ("qkv_a rows", c.qkv_a_rows), ("kv_lora_rank", c.kv_lora_rank),
                ("v_head_dim", c.v_head_dim), ("vocab_size", c.vocab_size)]
        if c.q_lora_rank is not None:
            rows.append(("num_heads*qk_head_dim", c.q_size))
        if c.num_dense_layers:
            rows.append(("intermediate_size", c.intermediate_size))
        if c.num_moe_layers:
            rows.append(("moe_intermediate_size", c.moe_intermediate_size))
        for name, n in rows:
            if n % ROW_GROUP:
                raise ValueError(f"{name}={n} must be a multiple of {ROW_GROUP} rows")


# ---- packed weights -------------------------------------------------------------------------------

def interleave_experts(gate_up: torch.Tensor, f: int) -> torch.Tensor:
    """[E, 2F, H] (gate rows then up rows per expert) -> groups of ROW_GROUP gate/up rows alternating."""
    e, _, h = gate_up.shape
    gate = gate_up[:, :f].reshape(e, f // ROW_GROUP, ROW_GROUP, h)
    up = gate_up[:, f:].reshape(e, f // ROW_GROUP, ROW_GROUP, h)
    return torch.stack([gate, up], dim=2).reshape(e, 2 * f, h)


@dataclass
class DeepseekPackedWeights:
    """Weights stacked per matrix kind, in the row order the tiles stream. Dense-layer tensors are
    indexed by the layer (dense layers come first), MoE tensors by the MoE index l - first_k_dense_replace.
    `embed`, `lm_head`, `final_norm`, `mlp_norm`, `gate_up`, `down` carry the names the dense stages
    (EMBED, GATE_UP, DOWN, LM_HEAD) read."""

    embed: torch.Tensor             # [V, H]
    lm_head: torch.Tensor           # [V, H]
    final_norm: torch.Tensor        # [H]
    attn_norm: torch.Tensor         # [L, H]
    mlp_norm: torch.Tensor          # [L, H]
    qkv_a: torch.Tensor             # [L, q_a_rows + c + r, H]
    q_a_norm: torch.Tensor | None   # [L, q_lora_rank]
    q_b: torch.Tensor | None        # [L, n * (nope + r), q_lora_rank]
    kv_a_norm: torch.Tensor         # [L, c]
    w_uk_t: torch.Tensor            # [L, n * c, nope]: W_UK[h]^T stacked per head
    w_uv: torch.Tensor              # [L, n * v, c]
    o_proj: torch.Tensor            # [L, H, n * v]
    gate_up: torch.Tensor           # [L_dense, 2F, H] interleaved by ROW_GROUP
    down: torch.Tensor              # [L_dense, H, F]
    router: torch.Tensor            # [L_moe, E, H] float32
    router_bias: torch.Tensor       # [L_moe, E] float32
    experts_gate_up: torch.Tensor   # [L_moe, E, 2Fe, H] interleaved by ROW_GROUP
    experts_down: torch.Tensor      # [L_moe, E, H, Fe]
    shared_gate_up: torch.Tensor | None  # [L_moe, 2Fs, H] interleaved by ROW_GROUP
    shared_down: torch.Tensor | None     # [L_moe, H, Fs]
    rope_cos: torch.Tensor          # [max_seq_len, r/2] float32, times YaRN's attention factor
    rope_sin: torch.Tensor          # [max_seq_len, r/2] float32

    def to(self, device) -> "DeepseekPackedWeights":
        return DeepseekPackedWeights(**{f.name: None if getattr(self, f.name) is None
                                        else getattr(self, f.name).to(device) for f in fields(self)})


def pack_weights(weights: DeepseekWeights, max_seq_len: int) -> DeepseekPackedWeights:
    c = weights.config
    dense = [lw for i, lw in enumerate(weights.layers) if not c.is_moe_layer(i)]
    moe = [lw for i, lw in enumerate(weights.layers) if c.is_moe_layer(i)]
    dt, dev, H = weights.dtype, weights.device, c.hidden_size
    n, nope, lat, v = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim

    def stack(ts: list, empty_shape: tuple, dtype=dt) -> torch.Tensor:
        if not ts:
            return torch.empty(0, *empty_shape, dtype=dtype, device=dev)
        return torch.stack(ts).contiguous()

    F, Fe, Fs = c.intermediate_size, c.moe_intermediate_size, c.shared_intermediate_size
    E = c.n_routed_experts
    lora = c.q_lora_rank is not None
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * rope_inv_freq(c).float()[None, :]
    af = c.rope_attention_factor
    layers = weights.layers
    return DeepseekPackedWeights(
        embed=weights.embed,
        lm_head=weights.lm_head,
        final_norm=weights.final_norm,
        attn_norm=stack([lw.attn_norm for lw in layers], (H,)),
        mlp_norm=stack([lw.mlp_norm for lw in layers], (H,)),
        qkv_a=stack([lw.qkv_a for lw in layers], (c.qkv_a_rows, H)),
        q_a_norm=stack([lw.q_a_norm for lw in layers], (c.q_lora_rank,)) if lora else None,
        q_b=stack([lw.q_b for lw in layers], (c.q_size, c.q_lora_rank)) if lora else None,
        kv_a_norm=stack([lw.kv_a_norm for lw in layers], (lat,)),
        w_uk_t=stack([lw.w_uk.transpose(1, 2).reshape(n * lat, nope) for lw in layers], (n * lat, nope)),
        w_uv=stack([lw.w_uv.reshape(n * v, lat) for lw in layers], (n * v, lat)),
        o_proj=stack([lw.o_proj for lw in layers], (H, c.o_proj_cols)),
        gate_up=stack([interleave_gate_up(lw.gate_up, F) for lw in dense], (2 * F, H)),
        down=stack([lw.down for lw in dense], (H, F)),
        router=stack([lw.router for lw in moe], (E, H), ROUTER_DTYPE),
        router_bias=stack([lw.router_bias for lw in moe], (E,), ROUTER_DTYPE),
        experts_gate_up=stack([interleave_experts(lw.experts_gate_up, Fe) for lw in moe], (E, 2 * Fe, H)),
        experts_down=stack([lw.experts_down for lw in moe], (E, H, Fe)),
        shared_gate_up=(stack([interleave_gate_up(lw.shared_gate_up, Fs) for lw in moe], (2 * Fs, H))
                        if c.n_shared_experts else None),
        shared_down=stack([lw.shared_down for lw in moe], (H, Fs)) if c.n_shared_experts else None,
        rope_cos=(torch.cos(angles) * af).contiguous(),
        rope_sin=(torch.sin(angles) * af).contiguous(),
    )


# ---- buffers and stage context --------------------------------------------------------------------

@dataclass
class DeepseekStepBuffers:
    """State of DeepSeek decode steps. Inputs: tokens, positions, block_table. Outputs: out_tokens,
    logits. Everything else is scratch the stages hand to each other, one buffer per stage and layer
    (dense-layer `act` by layer, MoE buffers by MoE index)."""

    tokens: torch.Tensor         # int32 [B]
    positions: torch.Tensor      # int32 [B]: position of the token being decoded
    block_table: torch.Tensor    # int32 [B, max_blocks_per_seq]
    x: torch.Tensor              # f32 [L+1, B, H]: residual entering layer l
    h: torch.Tensor              # f32 [L, B, H]: residual after attention
    qkv_a: torch.Tensor          # f32 [L, B, qkv_a_rows]
    q: torch.Tensor | None       # f32 [L, B, n * (nope + r)] (q LoRA only)
    q_lat: torch.Tensor          # f32 [L, B, n, c]
    mla_part_o: torch.Tensor     # f32 [L, B, n, S, c]
    mla_part_lse: torch.Tensor   # f32 [L, B, n, S]
    attn_out: torch.Tensor       # f32 [L, B, n * v]
    act: torch.Tensor            # f32 [L_dense, B, F]
    router_scores: torch.Tensor  # f32 [L_moe, B, E]
    topk_ids: torch.Tensor       # int32 [L_moe, B, K]
    topk_w: torch.Tensor         # f32 [L_moe, B, K]
    shared_act: torch.Tensor | None  # f32 [L_moe, B, Fs]
    shared_out: torch.Tensor | None  # f32 [L_moe, B, H]
    expert_act: torch.Tensor     # f32 [L_moe, B, K, Fe]
    expert_out: torch.Tensor     # f32 [L_moe, B, K, H]
    logits: torch.Tensor         # f32 [B, V]
    lm_max: torch.Tensor         # f32 [B, T]
    lm_idx: torch.Tensor         # int32 [B, T]
    out_tokens: torch.Tensor     # int32 [B]
    counters: torch.Tensor       # int32 [num_counters]
    sync: torch.Tensor           # int32 [4]
    error: torch.Tensor          # int32 [4]

    def poison(self) -> None:
        """NaN every float scratch buffer and -1 the expert ids, so a value a stage forgot to write
        (or read too early) fails the checks instead of passing silently."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))
        self.topk_ids.fill_(-1)
        self.out_tokens.fill_(-1)


def allocate_buffers(layout: DeepseekStepLayout, lm_tiles: int, num_counters: int,
                     device="cpu") -> DeepseekStepBuffers:
    c, B, S = layout.config, layout.batch, layout.kv_splits
    f32 = dict(dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    L, Ld, Lm, H = c.num_layers, c.num_dense_layers, c.num_moe_layers, c.hidden_size
    n, lat, K = c.num_heads, c.kv_lora_rank, c.num_experts_per_tok
    shared = c.n_shared_experts > 0
    bufs = DeepseekStepBuffers(
        tokens=torch.zeros(B, **i32),
        positions=torch.zeros(B, **i32),
        block_table=torch.zeros(B, layout.max_blocks_per_seq, **i32),
        x=torch.empty(L + 1, B, H, **f32),
        h=torch.empty(L, B, H, **f32),
        qkv_a=torch.empty(L, B, c.qkv_a_rows, **f32),
        q=torch.empty(L, B, c.q_size, **f32) if c.q_lora_rank is not None else None,
        q_lat=torch.empty(L, B, n, lat, **f32),
        mla_part_o=torch.empty(L, B, n, S, lat, **f32),
        mla_part_lse=torch.empty(L, B, n, S, **f32),
        attn_out=torch.empty(L, B, c.o_proj_cols, **f32),
        act=torch.empty(Ld, B, c.intermediate_size, **f32),
        router_scores=torch.empty(Lm, B, c.n_routed_experts, **f32),
        topk_ids=torch.empty(Lm, B, K, **i32),
        topk_w=torch.empty(Lm, B, K, **f32),
        shared_act=torch.empty(Lm, B, c.shared_intermediate_size, **f32) if shared else None,
        shared_out=torch.empty(Lm, B, H, **f32) if shared else None,
        expert_act=torch.empty(Lm, B, K, c.moe_intermediate_size, **f32),
        expert_out=torch.empty(Lm, B, K, H, **f32),
        logits=torch.empty(B, c.vocab_size, **f32),
        lm_max=torch.empty(B, lm_tiles, **f32),
        lm_idx=torch.zeros(B, lm_tiles, **i32),
        out_tokens=torch.zeros(B, **i32),
        counters=torch.zeros(num_counters, **i32),
        sync=torch.zeros(4, **i32),
        error=torch.zeros(4, **i32),
    )
    bufs.poison()
    return bufs


@dataclass
class DeepseekStageContext:
    """What a DeepSeek stage's torch reference sees (the dense stages it reuses read the same names)."""

    layout: DeepseekStepLayout
    weights: DeepseekPackedWeights
    bufs: DeepseekStepBuffers
    latent: torch.Tensor   # [L, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]


# ---- the DAG --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeepseekStepProgram(StepProgram):
    """A StepProgram (so assign / simulate / find_races / dependency_closure apply) plus counter names."""

    counter_names: tuple[str, ...] = ()


def _tiles(rows: int, per_tile: int, base: int = 0) -> list[tuple[int, int]]:
    return [(base + lo, min(per_tile, rows - lo)) for lo in range(0, rows, per_tile)]


def _per_item_rows(rows: int, items: int, num_sms: int, group: int = ROW_GROUP) -> int:
    """Rows per tile when `items` independent copies of a `rows`-row matrix run side by side (heads,
    (sequence, slot) pairs): enough tiles per copy that all of them cover about num_sms."""
    per_item = max(1, math.ceil(num_sms / items))
    return min(rows, group * math.ceil(rows // group / per_item))


PAIRED = (Opcode.GATE_UP, Opcode.SHARED_GATE_UP, Opcode.EXPERT_GATE_UP)   # tiles of whole gate/up pairs


class ProgramBuilder:
    """A step's instructions as they are added, in a global topological order, with the blocks the DeepSeek
    and Kimi Linear families share: EMBED, an MLA attention block, a dense FFN or MoE block, the LM head and
    ARGMAX. `tile_rows_override` maps an opcode to its rows per tile (a multiple of ROW_GROUP; of
    2 * ROW_GROUP for the gate/up stages, whose tiles hold whole gate/up pairs; per-head and per-slot stages
    clip it to one head or one expert). The layout's config needs the MLA and MoE fields of DeepseekConfig."""

    ELEM, F32 = 2, 4                 # bf16 weights; float32 router and activations

    def __init__(self, layout, tile_rows_override: dict | None = None):
        layout.validate()
        for op, rows in (tile_rows_override or {}).items():
            group = 2 * ROW_GROUP if op in PAIRED else ROW_GROUP
            if rows < group or rows % group:
                raise ValueError(f"tile_rows_override[{Opcode(op).name}]={rows} must be a positive multiple of {group}")
        self.layout, self.c, self.override = layout, layout.config, tile_rows_override or {}
        self.out: list[Instruction] = []
        self.names: list[str] = []

    def counter(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1

    def cid(self, layer: int, stage: str) -> int:
        return self.counter(f"layer {layer} {stage}")

    def add(self, **kw) -> None:
        self.out.append(Instruction(index=len(self.out), **kw))

    def rows_per_tile(self, op: Opcode, rows: int, group: int = ROW_GROUP) -> int:
        return self.override.get(op) or tile_rows(rows, self.layout.num_sms, group)

    def matvec_stage(self, op: Opcode, layer: int, rows: int, k: int, wait: tuple[int, int], signal: int,
                     group: int = ROW_GROUP, bytes_per_elem: int = ELEM, extra_cost: int = 0) -> int:
        tiles = _tiles(rows, self.rows_per_tile(op, rows, group))
        for t, (lo, cnt) in enumerate(tiles):
            self.add(opcode=op, layer=layer, a0=lo, a1=cnt, a2=t, wait_id=wait[0], wait_count=wait[1],
                     signal_id=signal, cost=cnt * k * bytes_per_elem + extra_cost + FIXED_COST_BYTES)
        return len(tiles)

    def per_head_stage(self, op: Opcode, layer: int, width: int, k: int, wait: tuple[int, int], signal: int,
                       extra_cost: int) -> int:
        n = self.c.num_heads
        per = self.override.get(op) or _per_item_rows(width, n, self.layout.num_sms)
        tiles = [t for h in range(n) for t in _tiles(width, min(per, width), base=h * width)]
        for t, (lo, cnt) in enumerate(tiles):
            self.add(opcode=op, layer=layer, a0=lo, a1=cnt, a2=t, wait_id=wait[0], wait_count=wait[1],
                     signal_id=signal, cost=cnt * k * self.ELEM + extra_cost + FIXED_COST_BYTES)
        return len(tiles)

    def per_slot_stage(self, op: Opcode, layer: int, rows: int, k: int, wait: tuple[int, int], signal: int,
                       group: int) -> int:
        B, K = self.layout.batch, self.c.num_experts_per_tok
        per = self.override.get(op) or _per_item_rows(rows, B * K, self.layout.num_sms, group)
        count = 0
        for b in range(B):
            for slot in range(K):
                for lo, cnt in _tiles(rows, per):
                    self.add(opcode=op, layer=layer, a0=b, a1=slot, a2=lo, a3=cnt, wait_id=wait[0],
                             wait_count=wait[1], signal_id=signal, cost=cnt * k * self.ELEM + FIXED_COST_BYTES)
                    count += 1
        return count

    def embed(self) -> tuple[int, int]:
        """EMBED; -> the (counter, count) the first layer waits for."""
        c_embed = self.counter("embed")
        self.add(opcode=Opcode.EMBED, a0=0, a1=self.layout.batch, signal_id=c_embed,
                 cost=self.layout.batch * self.c.hidden_size * self.ELEM + FIXED_COST_BYTES)
        return c_embed, 1

    def mla(self, l: int, prev: tuple[int, int], o_name: str) -> tuple[int, int]:
        """Layer l's MLA attention (the QKV down-projection, Q up-projection, absorb, split partials, reduce,
        O projection) after `prev`; -> its O projection's (counter, count), the counter named o_name."""
        c, layout = self.c, self.layout
        B, S, H = layout.batch, layout.kv_splits, c.hidden_size
        lat, nope, v = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        c_qkv = self.cid(l, "MLA_QKV_A")
        q_ready = (c_qkv, self.matvec_stage(Opcode.MLA_QKV_A, l, c.qkv_a_rows, H, prev, c_qkv))
        if c.q_lora_rank is not None:
            c_qb = self.cid(l, "MLA_Q_B")
            q_ready = (c_qb, self.matvec_stage(Opcode.MLA_Q_B, l, c.q_size, c.q_lora_rank, q_ready, c_qb))
        c_abs = self.cid(l, "MLA_ABSORB")
        n_abs = self.per_head_stage(Opcode.MLA_ABSORB, l, lat, nope, q_ready, c_abs, 0)
        c_part = self.cid(l, "MLA_PARTIAL")
        latent_bytes_per_split = c.latent_dim * self.ELEM * max(1, -(-layout.max_seq_len // S))
        for b in range(B):
            for g in range(layout.num_head_groups):
                for s in range(S):
                    self.add(opcode=Opcode.MLA_PARTIAL, layer=l, a0=b, a1=g, a2=s, a3=S, wait_id=c_abs,
                             wait_count=n_abs, signal_id=c_part, cost=latent_bytes_per_split + FIXED_COST_BYTES)
        n_part = B * layout.num_head_groups * S
        c_red = self.cid(l, "MLA_REDUCE")
        n_red = self.per_head_stage(Opcode.MLA_REDUCE, l, v, lat, (c_part, n_part), c_red, B * S * lat * self.F32)
        c_o = self.cid(l, o_name)
        return c_o, self.matvec_stage(Opcode.MLA_O_PROJ, l, H, c.o_proj_cols, (c_red, n_red), c_o)

    def ffn(self, l: int, o_ready: tuple[int, int]) -> tuple[int, int]:
        """Layer l's dense FFN (GATE_UP, DOWN) or MoE (router, top-k, shared and routed experts, combine)
        after its attention output `o_ready`; -> the (counter, count) the next layer waits for."""
        c, B, H = self.c, self.layout.batch, self.c.hidden_size
        if not c.is_moe_layer(l):
            F = c.intermediate_size
            c_gu, c_dn = self.cid(l, "GATE_UP"), self.cid(l, "DOWN")
            n_gu = self.matvec_stage(Opcode.GATE_UP, l, 2 * F, H, o_ready, c_gu, group=2 * ROW_GROUP)
            return c_dn, self.matvec_stage(Opcode.DOWN, l, H, F, (c_gu, n_gu), c_dn)
        E, K = c.n_routed_experts, c.num_experts_per_tok
        Fe, Fs = c.moe_intermediate_size, c.shared_intermediate_size
        c_router, c_topk, c_egu, c_out, c_comb = (self.cid(l, "ROUTER"), self.cid(l, "ROUTER_TOPK"),
                                                  self.cid(l, "EXPERT_GATE_UP"), self.cid(l, "MOE_OUT"),
                                                  self.cid(l, "MOE_COMBINE"))
        n_router = self.matvec_stage(Opcode.ROUTER, l, E, H, o_ready, c_router, bytes_per_elem=self.F32)
        if c.n_shared_experts:
            c_sgu = self.cid(l, "SHARED_GATE_UP")
            n_sgu = self.matvec_stage(Opcode.SHARED_GATE_UP, l, 2 * Fs, H, o_ready, c_sgu, group=2 * ROW_GROUP)
        self.add(opcode=Opcode.ROUTER_TOPK, layer=l, wait_id=c_router, wait_count=n_router, signal_id=c_topk,
                 cost=B * E * self.F32 + FIXED_COST_BYTES)
        n_out = 0
        if c.n_shared_experts:
            n_out += self.matvec_stage(Opcode.SHARED_DOWN, l, H, Fs, (c_sgu, n_sgu), c_out)
        n_egu = self.per_slot_stage(Opcode.EXPERT_GATE_UP, l, 2 * Fe, H, (c_topk, 1), c_egu, 2 * ROW_GROUP)
        n_out += self.per_slot_stage(Opcode.EXPERT_DOWN, l, H, Fe, (c_egu, n_egu), c_out, ROW_GROUP)
        n_comb = 0
        for t, (lo, cnt) in enumerate(_tiles(H, self.rows_per_tile(Opcode.MOE_COMBINE, H))):
            self.add(opcode=Opcode.MOE_COMBINE, layer=l, a0=lo, a1=cnt, a2=t, wait_id=c_out, wait_count=n_out,
                     signal_id=c_comb, cost=B * (K + 2) * cnt * self.F32 + FIXED_COST_BYTES)
            n_comb += 1
        return c_comb, n_comb

    def finish(self, prev: tuple[int, int], program_cls):
        """LM_HEAD and ARGMAX after `prev`; -> the program (a program_cls)."""
        c_lm, c_arg = self.counter("LM_HEAD"), self.counter("ARGMAX")
        lm_tiles = self.matvec_stage(Opcode.LM_HEAD, 0, self.c.vocab_size, self.c.hidden_size, prev, c_lm)
        self.add(opcode=Opcode.ARGMAX, a0=lm_tiles, wait_id=c_lm, wait_count=lm_tiles, signal_id=c_arg,
                 cost=FIXED_COST_BYTES)
        return program_cls(layout=self.layout, instructions=tuple(self.out), num_counters=len(self.names),
                           lm_tiles=lm_tiles, counter_names=tuple(self.names))


def build_program(layout: DeepseekStepLayout, tile_rows_override: dict | None = None) -> DeepseekStepProgram:
    """The step's instructions in a global topological order (ProgramBuilder: `tile_rows_override`)."""
    b = ProgramBuilder(layout, tile_rows_override)
    prev = b.embed()
    for l in range(layout.config.num_layers):
        prev = b.ffn(l, b.mla(l, prev, "MLA_O_PROJ"))
    return b.finish(prev, DeepseekStepProgram)


# ---- the CPU decoder ------------------------------------------------------------------------------

class DeepseekVMDecoder:
    """A whole DeepSeek decode step on the CPU through the instruction VM: the program of the layout,
    assigned to SMs, proven deadlock-free, serialized, then executed from the serialized queues with
    each stage's torch reference. The latent cache is `self.cache` (a LatentKVCache, NaN-filled)."""

    def __init__(self, weights: DeepseekWeights, batch: int, max_seq_len: int, block_size: int = 16,
                 num_sms: int = 132, policy: str = "balanced", kv_splits: int | None = None,
                 head_group: int | None = None, num_blocks: int | None = None,
                 cache_dtype: torch.dtype | None = None, tile_rows_override: dict | None = None):
        config = weights.config
        self.layout = DeepseekStepLayout.for_model(config, batch, max_seq_len, block_size, num_sms, kv_splits,
                                                   head_group)
        self.program = build_program(self.layout, tile_rows_override)
        self.queues = assign(self.program, policy)
        simulate(self.queues, self.program.num_counters)
        self.table, self.lengths = serialize(self.queues)
        packed = pack_weights(weights, self.layout.max_seq_len)
        bufs = allocate_buffers(self.layout, self.program.lm_tiles, self.program.num_counters)
        nb = num_blocks or batch * self.layout.max_blocks_per_seq
        self.cache = LatentKVCache.allocate(config, nb, block_size, dtype=cache_dtype or weights.dtype)
        self.ctx = DeepseekStageContext(self.layout, packed, bufs, self.cache.latent)
        self.vm = InstructionVM(self.ctx, self.table, self.lengths, self.program.num_counters)

    @property
    def bufs(self) -> DeepseekStepBuffers:
        return self.ctx.bufs

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             order: str = "round-robin") -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next tokens int32 [B], logits float32 [B, V])."""
        return run_vm_step(self.vm, self.layout, self.ctx.bufs, tokens, positions, block_table,
                           self.cache.num_blocks, order)
