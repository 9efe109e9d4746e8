"""The decode step of Kimi Linear (KDA linear attention + NoPE MLA, MoE with shared experts): its layout,
packed weights, buffers, instruction DAG, and a CPU decoder that runs the serialized per-SM queues
through the instruction VM.

The same generic machinery as the dense and DeepSeek models (Instruction records, `serialize`,
`assign` / `simulate`, the race check, `InstructionVM`). The KDA stages live in
megakernel/instructions/kimi_linear/; the MLA layers, the MoE and the dense MLP run the DeepSeek and
dense stage modules unchanged (see "Reusing the DeepSeek stages" below).

Stages of layer l (each instruction waits on one counter and signals one; a consumer waits for the
whole producing stage, and release/acquire chains make that transitive):

  KDA layer:
    KDA_PROJ tiles        wait x[l]'s producer      signal KDA_PROJ      (whole batch)
    KDA_STATE             wait KDA_PROJ              signal KDA_STATE     (sequence, head group)
    KDA_OUT_NORM tiles    wait KDA_STATE             signal O_PROJ        -> h[l]
  MLA layer (NoPE; DeepSeek's stages):
    MLA_QKV_A tiles       wait x[l]'s producer      signal QKV_A
    MLA_Q_B tiles         wait QKV_A                 signal Q_B           (q LoRA only)
    MLA_ABSORB tiles      wait Q_B (or QKV_A)        signal ABSORB
    MLA_PARTIAL           wait ABSORB                signal PARTIAL       (sequence, head group, split)
    MLA_REDUCE tiles      wait PARTIAL               signal REDUCE
    MLA_O_PROJ tiles      wait REDUCE                signal O_PROJ        -> h[l]
  dense MLP:  GATE_UP (wait O_PROJ) -> DOWN -> x[l+1]
  MoE MLP:    ROUTER, SHARED_GATE_UP (wait O_PROJ); ROUTER_TOPK; SHARED_DOWN, EXPERT_GATE_UP, EXPERT_DOWN
              (signal MOE_OUT); MOE_COMBINE (wait MOE_OUT) -> x[l+1]
  then LM_HEAD tiles and ARGMAX, as every step.

The KDA state is per sequence slot: `kda_state` [L_kda, slots, nh, dk, dv] and `kda_conv`
[L_kda, slots, 3D, K-1] (float32; the tensors of a KDAStateCache, so the reference decoder's cache
layout), slot of sequence b = kda_slots[b]. Each (slot, head) state and its conv channels are read
and written by exactly one KDA_STATE per step, so they need no ordering within the step; a sequence at
position 0 starts from an empty state without reading the slot.

Reusing the DeepSeek stages: their references index per-kind stacks (weights, scratch buffers, the
latent cache) by the layer, their MoE ones by `moe_index` = layer - first_k_dense_replace. Kimi Linear
interleaves layer kinds, so every per-kind stack here is a `LayerRows`: the compact [L_kind, ...]
tensor addressed by the global layer. The layout's config is a `KimiLinearStageConfig`: the model's
KimiLinearConfig plus the few DeepSeek names those stages read (q_a_rows, qkv_a_rows, and
first_k_dense_replace = 0, so that moe_index is the global layer LayerRows maps). RoPE is turned off
through an operand, the tables: MLA_PARTIAL rotates the query's and the new key's rope part by
rope_cos / rope_sin, which are packed as 1 and 0 (the identity, exactly: x * 1 - y * 0 = x), so the
cached key and the query are unrotated, as transformers' Kimi Linear (NoPE) has them. The MoE routing
(sigmoid scores, bias for the choice only, group-limited top-k, renormalisation, routed_scaling_factor)
is DeepSeek-V3's, which is what the Kimi Linear reference (deepseek.reference.route) computes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..instructions.kimi_linear.common import kda_offsets, kda_proj_rows
from ..instructions.layout import MAX_BATCH, ROW_GROUP, interleave_gate_up
from ..instructions.opcodes import Opcode
from ..instructions.record import serialize
from ..model.kimi_linear.config import KimiLinearConfig
from ..model.kimi_linear.reference import KimiLinearCache
from ..model.kimi_linear.weights import KimiLinearWeights
from .assign import assign, simulate
from .dag import FIXED_COST_BYTES
from .deepseek import DeepseekStepProgram, ProgramBuilder, default_head_group, default_kv_splits, interleave_experts
from .deepseek_checks import check_program, find_races
from .vm import InstructionVM, run_vm_step

__all__ = ["KimiLinearStageConfig", "LayerRows", "KimiLinearStepLayout", "KimiLinearPackedWeights", "pack_weights",
           "KimiLinearStepBuffers", "allocate_buffers", "KimiLinearStageContext", "KimiLinearStepProgram",
           "build_program", "check_program", "find_races", "KimiLinearVMDecoder", "default_kda_head_group"]


# ---- the config the stages see --------------------------------------------------------------------

class KimiLinearStageConfig:
    """A KimiLinearConfig (every attribute is the model's) plus the DeepSeek names the reused stages read:
    `q_a_rows` (rows of the query part of the fused MLA projection: q_lora_rank, or q_size without q LoRA),
    `qkv_a_rows` (q_a_rows + kv_lora_rank + qk_rope_head_dim) and first_k_dense_replace = 0 (moe_index is
    then the global layer, which the MoE LayerRows map to their rows)."""

    first_k_dense_replace = 0

    def __init__(self, model: KimiLinearConfig):
        object.__setattr__(self, "model", model)

    def __getattr__(self, name: str):
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __setattr__(self, name, value):
        raise AttributeError("KimiLinearStageConfig is read-only")

    def __eq__(self, other) -> bool:
        return isinstance(other, KimiLinearStageConfig) and other.model == self.model

    def __hash__(self) -> int:
        return hash(self.model)

    def __repr__(self) -> str:
        return f"KimiLinearStageConfig({self.model.name})"

    @property
    def q_a_rows(self) -> int:
        return self.model.q_lora_rank if self.model.q_lora_rank is not None else self.model.q_size

    @property
    def qkv_a_rows(self) -> int:
        return self.q_a_rows + self.model.kv_a_rows


class LayerRows:
    """A per-kind stack `data` [len(layers), ...] addressed by global layer: rows[l, ...] is
    data[layers.index(l), ...] (reading and writing); a layer of another kind raises IndexError."""

    def __init__(self, data: torch.Tensor, layers: tuple[int, ...]):
        if data.shape[0] != len(layers):
            raise ValueError(f"stack of {data.shape[0]} rows for {len(layers)} layers")
        self.data = data
        self.layers = tuple(layers)
        self._row = {layer: i for i, layer in enumerate(self.layers)}

    def row(self, layer: int) -> int:
        try:
            return self._row[int(layer)]
        except KeyError:
            raise IndexError(f"layer {layer} has no row here (layers {self.layers})") from None

    def _key(self, key):
        if isinstance(key, tuple):
            return (self.row(key[0]),) + key[1:]
        return self.row(key)

    def __getitem__(self, key) -> torch.Tensor:
        return self.data[self._key(key)]

    def __setitem__(self, key, value) -> None:
        self.data[self._key(key)] = value

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def to(self, device) -> "LayerRows":
        return LayerRows(self.data.to(device), self.layers)


# ---- layout ---------------------------------------------------------------------------------------

def default_kda_head_group(config, batch: int, num_sms: int) -> int:
    """The largest divisor g of linear_num_heads that still gives every SM a (sequence, head group)
    (batch * nh / g >= num_sms); 1 when even single heads are fewer than the SMs."""
    nh = config.linear_num_heads
    fits = [g for g in range(1, nh + 1) if nh % g == 0 and batch * (nh // g) >= num_sms]
    return max(fits) if fits else 1


@dataclass(frozen=True)
class KimiLinearStepLayout:
    """Everything static about a Kimi Linear decode step: model shape (`config`, a KimiLinearStageConfig),
    batch bucket, MLA head grouping and KV splits, latent cache geometry, KDA head grouping and the
    number of KDA state slots."""

    config: KimiLinearStageConfig
    batch: int
    kv_splits: int
    block_size: int
    max_blocks_per_seq: int
    num_sms: int
    head_group: int
    kda_head_group: int
    num_state_slots: int

    @classmethod
    def for_model(cls, config: KimiLinearConfig, batch: int, max_seq_len: int, block_size: int = 16,
                  num_sms: int = 132, kv_splits: int | None = None, head_group: int | None = None,
                  kda_head_group: int | None = None, num_state_slots: int | None = None) -> "KimiLinearStepLayout":
        """The layout of a model at a batch size and cache length, defaults filled in; ValueError for an
        unsupported one."""
        if block_size < 1 or max_seq_len < 1:
            raise ValueError(f"block_size={block_size} and max_seq_len={max_seq_len} must be >= 1")
        sc = config if isinstance(config, KimiLinearStageConfig) else KimiLinearStageConfig(config)
        g = head_group or default_head_group(sc)
        layout = cls(config=sc, batch=batch, kv_splits=kv_splits or default_kv_splits(sc, batch, num_sms, g),
                     block_size=block_size, max_blocks_per_seq=-(-max_seq_len // block_size), num_sms=num_sms,
                     head_group=g, kda_head_group=kda_head_group or default_kda_head_group(sc, batch, num_sms),
                     num_state_slots=batch if num_state_slots is None else num_state_slots)
        layout.validate()
        return layout

    @property
    def max_seq_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def num_head_groups(self) -> int:
        return self.config.num_heads // self.head_group

    @property
    def num_kda_head_groups(self) -> int:
        return self.config.linear_num_heads // self.kda_head_group

    def validate(self) -> None:
        """Raise ValueError for a shape the schedule cannot express, before anything runs."""
        c = self.config
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"batch={self.batch} is outside the supported range 1..{MAX_BATCH}")
        if self.head_group < 1 or c.num_heads % self.head_group:
            raise ValueError(f"head_group={self.head_group} must divide num_heads={c.num_heads}")
        if self.kda_head_group < 1 or c.linear_num_heads % self.kda_head_group:
            raise ValueError(f"kda_head_group={self.kda_head_group} must divide "
                             f"linear_num_heads={c.linear_num_heads}")
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits={self.kv_splits} must be >= 1")
        if self.num_sms < 1:
            raise ValueError(f"num_sms={self.num_sms} must be >= 1")
        if self.num_state_slots < self.batch:
            raise ValueError(f"num_state_slots={self.num_state_slots} must be >= batch={self.batch}")
        if self.block_size < 1 or self.max_blocks_per_seq < 1:
            raise ValueError(f"block_size={self.block_size} and max_blocks_per_seq={self.max_blocks_per_seq} "
                             "must be >= 1")
        rows = [("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)]
        if c.num_mla_layers:
            rows += [("qkv_a rows", c.qkv_a_rows), ("kv_lora_rank", c.kv_lora_rank), ("v_head_dim", c.v_head_dim)]
            if c.q_lora_rank is not None:
                rows.append(("num_heads*qk_head_dim", c.q_size))
            if c.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (the MLA stages split the "
                                 "rope part in halves)")
        if c.num_moe_layers < c.num_layers:
            rows.append(("intermediate_size", c.intermediate_size))
        if c.num_moe_layers:
            rows.append(("moe_intermediate_size", c.moe_intermediate_size))
        for name, n in rows:
            if n % ROW_GROUP:
                raise ValueError(f"{name}={n} must be a multiple of {ROW_GROUP} rows")


def _layers(config) -> dict[str, tuple[int, ...]]:
    L = config.num_layers
    return {"kda": config.kda_layers, "mla": config.mla_layers,
            "dense": tuple(i for i in range(L) if not config.is_moe_layer(i)),
            "moe": tuple(i for i in range(L) if config.is_moe_layer(i))}


# ---- packed weights -------------------------------------------------------------------------------

@dataclass
class KimiLinearPackedWeights:
    """Weights stacked per matrix kind, in the row order the tiles stream; per-kind stacks are LayerRows
    (KDA, MLA, dense-MLP, MoE layers each), addressed by the global layer. The MLA, MoE and dense names
    are the DeepSeek / dense stages' (see DeepseekPackedWeights)."""

    embed: torch.Tensor             # [V, H]
    lm_head: torch.Tensor           # [V, H]
    final_norm: torch.Tensor        # [H]
    attn_norm: torch.Tensor         # [L, H]
    mlp_norm: torch.Tensor          # [L, H]
    # KDA layers
    kda_in: LayerRows               # [L_kda, R, H]: [q | k | v | f_a | g_a | beta | 0 pad] (kimi_linear.common)
    kda_conv_taps: LayerRows        # [L_kda, 3D, K]
    kda_f_b: LayerRows              # [L_kda, D, dk]
    kda_dt_bias: LayerRows          # [L_kda, D] float32
    kda_a_log: LayerRows            # [L_kda, nh] float32
    kda_g_b: LayerRows              # [L_kda, D, dk]
    kda_o_norm: LayerRows           # [L_kda, dk]
    kda_o_proj: LayerRows           # [L_kda, H, D]
    # MLA layers
    qkv_a: LayerRows                # [L_mla, q_a_rows + c + r, H]
    q_a_norm: LayerRows | None      # [L_mla, q_lora_rank]
    q_b: LayerRows | None           # [L_mla, n * (nope + r), q_lora_rank]
    kv_a_norm: LayerRows            # [L_mla, c]
    w_uk_t: LayerRows               # [L_mla, n * c, nope]
    w_uv: LayerRows                 # [L_mla, n * v, c]
    o_proj: LayerRows               # [L_mla, H, n * v]
    # MLPs
    gate_up: LayerRows              # [L_dense, 2F, H] interleaved by ROW_GROUP
    down: LayerRows                 # [L_dense, H, F]
    router: LayerRows               # [L_moe, E, H] float32
    router_bias: LayerRows          # [L_moe, E] float32
    experts_gate_up: LayerRows      # [L_moe, E, 2Fe, H] interleaved by ROW_GROUP
    experts_down: LayerRows         # [L_moe, E, H, Fe]
    shared_gate_up: LayerRows | None  # [L_moe, 2Fs, H] interleaved by ROW_GROUP
    shared_down: LayerRows | None     # [L_moe, H, Fs]
    rope_cos: torch.Tensor          # [max_seq_len, r/2] float32, all 1 (NoPE: the identity rotation)
    rope_sin: torch.Tensor          # [max_seq_len, r/2] float32, all 0

    def to(self, device) -> "KimiLinearPackedWeights":
        return KimiLinearPackedWeights(**{f.name: None if getattr(self, f.name) is None
                                          else getattr(self, f.name).to(device) for f in fields(self)})


def pack_weights(weights: KimiLinearWeights, max_seq_len: int) -> KimiLinearPackedWeights:
    c = weights.config
    kinds = _layers(c)
    dt, dev, H = weights.dtype, weights.device, c.hidden_size
    layers = weights.layers
    lora = c.q_lora_rank is not None
    n, lat, nope, v = c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
    D, dk, nh = c.kda_dim, c.linear_head_dim, c.linear_num_heads
    F, Fe, Fs, E = c.intermediate_size, c.moe_intermediate_size, c.shared_intermediate_size, c.n_routed_experts

    def rows(kind: str, get, empty_shape: tuple, dtype=dt) -> LayerRows:
        ts = [get(layers[i]) for i in kinds[kind]]
        data = torch.stack(ts).contiguous() if ts else torch.empty(0, *empty_shape, dtype=dtype, device=dev)
        return LayerRows(data.to(dtype), kinds[kind])

    def fused_kda(lw) -> torch.Tensor:
        k = lw.kda
        out = torch.zeros(kda_proj_rows(c), H, dtype=dt, device=dev)
        off = kda_offsets(c)
        out[:3 * D] = k.qkv
        out[off["f_a"]:off["f_a"] + dk] = k.f_a
        out[off["g_a"]:off["g_a"] + dk] = k.g_a
        out[off["beta"]:off["beta"] + nh] = k.b_proj
        return out

    def qkv_a(lw) -> torch.Tensor:
        m = lw.mla
        return torch.cat([m.q_a if lora else m.q_proj, m.kv_a])

    f32 = torch.float32
    half = c.qk_rope_head_dim // 2
    return KimiLinearPackedWeights(
        embed=weights.embed,
        lm_head=weights.lm_head,
        final_norm=weights.final_norm,
        attn_norm=torch.stack([lw.attn_norm for lw in layers]).contiguous(),
        mlp_norm=torch.stack([lw.mlp_norm for lw in layers]).contiguous(),
        kda_in=rows("kda", fused_kda, (kda_proj_rows(c), H)),
        kda_conv_taps=rows("kda", lambda lw: lw.kda.conv, (3 * D, c.linear_conv_kernel_dim)),
        kda_f_b=rows("kda", lambda lw: lw.kda.f_b, (D, dk)),
        kda_dt_bias=rows("kda", lambda lw: lw.kda.dt_bias.float(), (D,), f32),
        kda_a_log=rows("kda", lambda lw: lw.kda.A_log.float(), (nh,), f32),
        kda_g_b=rows("kda", lambda lw: lw.kda.g_b, (D, dk)),
        kda_o_norm=rows("kda", lambda lw: lw.kda.o_norm, (dk,)),
        kda_o_proj=rows("kda", lambda lw: lw.kda.o_proj, (H, D)),
        qkv_a=rows("mla", qkv_a, (KimiLinearStageConfig(c).qkv_a_rows, H)),
        q_a_norm=rows("mla", lambda lw: lw.mla.q_a_norm, (c.q_lora_rank,)) if lora else None,
        q_b=rows("mla", lambda lw: lw.mla.q_b, (c.q_size, c.q_lora_rank)) if lora else None,
        kv_a_norm=rows("mla", lambda lw: lw.mla.kv_a_norm, (lat,)),
        w_uk_t=rows("mla", lambda lw: lw.mla.w_uk.transpose(1, 2).reshape(n * lat, nope), (n * lat, nope)),
        w_uv=rows("mla", lambda lw: lw.mla.w_uv.reshape(n * v, lat), (n * v, lat)),
        o_proj=rows("mla", lambda lw: lw.mla.o_proj, (H, c.o_proj_cols)),
        gate_up=rows("dense", lambda lw: interleave_gate_up(lw.gate_up, F), (2 * F, H)),
        down=rows("dense", lambda lw: lw.down, (H, F)),
        router=rows("moe", lambda lw: lw.router.float(), (E, H), f32),
        router_bias=rows("moe", lambda lw: lw.router_bias.float(), (E,), f32),
        experts_gate_up=rows("moe", lambda lw: interleave_experts(lw.experts_gate_up, Fe), (E, 2 * Fe, H)),
        experts_down=rows("moe", lambda lw: lw.experts_down, (E, H, Fe)),
        shared_gate_up=(rows("moe", lambda lw: interleave_gate_up(lw.shared_gate_up, Fs), (2 * Fs, H))
                        if c.n_shared_experts else None),
        shared_down=rows("moe", lambda lw: lw.shared_down, (H, Fs)) if c.n_shared_experts else None,
        rope_cos=torch.ones(max_seq_len, half, dtype=f32, device=dev),
        rope_sin=torch.zeros(max_seq_len, half, dtype=f32, device=dev),
    )


# ---- buffers and stage context --------------------------------------------------------------------

# buffers that persist across steps: never poisoned
PERSISTENT = ("kda_state", "kda_conv")


@dataclass
class KimiLinearStepBuffers:
    """State of Kimi Linear decode steps. Inputs: tokens, positions, block_table, kda_slots. Outputs:
    out_tokens, logits. Persistent: kda_state, kda_conv (the KDA state cache). Everything else is
    scratch the stages hand to each other, one buffer per stage and layer (per-kind LayerRows)."""

    tokens: torch.Tensor         # int32 [B]
    positions: torch.Tensor      # int32 [B]
    block_table: torch.Tensor    # int32 [B, max_blocks_per_seq]
    kda_slots: torch.Tensor      # int32 [B]: each sequence's KDA state slot
    x: torch.Tensor              # f32 [L+1, B, H]
    h: torch.Tensor              # f32 [L, B, H]
    kda_proj: LayerRows          # f32 [L_kda, B, R]
    kda_o: LayerRows             # f32 [L_kda, B, D]: S^T q per head
    kda_gate: LayerRows          # f32 [L_kda, B, D]: sigmoid(g_b g_a x)
    kda_state: LayerRows         # f32 [L_kda, slots, nh, dk, dv] (persistent)
    kda_conv: LayerRows          # f32 [L_kda, slots, 3D, K-1] (persistent, oldest input first)
    qkv_a: LayerRows             # f32 [L_mla, B, qkv_a_rows]
    q: LayerRows | None          # f32 [L_mla, B, q_size] (q LoRA only)
    q_lat: LayerRows             # f32 [L_mla, B, n, c]
    mla_part_o: LayerRows        # f32 [L_mla, B, n, S, c]
    mla_part_lse: LayerRows      # f32 [L_mla, B, n, S]
    attn_out: LayerRows          # f32 [L_mla, B, n * v]
    act: LayerRows               # f32 [L_dense, B, F]
    router_scores: LayerRows     # f32 [L_moe, B, E]
    topk_ids: LayerRows          # int32 [L_moe, B, K]
    topk_w: LayerRows            # f32 [L_moe, B, K]
    shared_act: LayerRows | None
    shared_out: LayerRows | None
    expert_act: LayerRows        # f32 [L_moe, B, K, Fe]
    expert_out: LayerRows        # f32 [L_moe, B, K, H]
    logits: torch.Tensor         # f32 [B, V]
    lm_max: torch.Tensor         # f32 [B, T]
    lm_idx: torch.Tensor         # int32 [B, T]
    out_tokens: torch.Tensor     # int32 [B]
    counters: torch.Tensor       # int32 [num_counters]
    sync: torch.Tensor           # int32 [4]
    error: torch.Tensor          # int32 [4]

    def poison(self) -> None:
        """NaN every float scratch buffer and -1 the expert ids (the KDA state is left alone)."""
        for f in fields(self):
            t = getattr(self, f.name)
            if f.name in PERSISTENT or t is None:
                continue
            data = t.data if isinstance(t, LayerRows) else t
            if data.is_floating_point():
                data.fill_(float("nan"))
        self.topk_ids.data.fill_(-1)
        self.out_tokens.fill_(-1)


def allocate_buffers(layout: KimiLinearStepLayout, lm_tiles: int, num_counters: int,
                     cache: KimiLinearCache) -> KimiLinearStepBuffers:
    """Scratch buffers of a layout; kda_state / kda_conv are views of `cache.kda`."""
    c, B, S = layout.config, layout.batch, layout.kv_splits
    kinds = _layers(c)
    dev = cache.kda.recurrent.device
    f32 = dict(dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    L, H = c.num_layers, c.hidden_size
    n, lat, K, D = c.num_heads, c.kv_lora_rank, c.num_experts_per_tok, c.kda_dim

    def rows(kind: str, *shape, dtype=f32) -> LayerRows:
        return LayerRows(torch.empty(len(kinds[kind]), *shape, **dtype), kinds[kind])

    shared = c.n_shared_experts > 0
    bufs = KimiLinearStepBuffers(
        tokens=torch.zeros(B, **i32),
        positions=torch.zeros(B, **i32),
        block_table=torch.zeros(B, layout.max_blocks_per_seq, **i32),
        kda_slots=torch.arange(B, **i32),
        x=torch.empty(L + 1, B, H, **f32),
        h=torch.empty(L, B, H, **f32),
        kda_proj=rows("kda", B, kda_proj_rows(c)),
        kda_o=rows("kda", B, D),
        kda_gate=rows("kda", B, D),
        kda_state=LayerRows(cache.kda.recurrent, kinds["kda"]),
        kda_conv=LayerRows(cache.kda.conv, kinds["kda"]),
        qkv_a=rows("mla", B, c.qkv_a_rows),
        q=rows("mla", B, c.q_size) if c.q_lora_rank is not None else None,
        q_lat=rows("mla", B, n, lat),
        mla_part_o=rows("mla", B, n, S, lat),
        mla_part_lse=rows("mla", B, n, S),
        attn_out=rows("mla", B, c.o_proj_cols),
        act=rows("dense", B, c.intermediate_size),
        router_scores=rows("moe", B, c.n_routed_experts),
        topk_ids=rows("moe", B, K, dtype=i32),
        topk_w=rows("moe", B, K),
        shared_act=rows("moe", B, c.shared_intermediate_size) if shared else None,
        shared_out=rows("moe", B, H) if shared else None,
        expert_act=rows("moe", B, K, c.moe_intermediate_size),
        expert_out=rows("moe", B, K, H),
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
class KimiLinearStageContext:
    """What a stage's torch reference sees (the DeepSeek and dense stages read the same names)."""

    layout: KimiLinearStepLayout
    weights: KimiLinearPackedWeights
    bufs: KimiLinearStepBuffers
    latent: LayerRows   # [L_mla, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]


# ---- the DAG --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KimiLinearStepProgram(DeepseekStepProgram):
    """A StepProgram with counter names (deepseek_checks.check_program and find_races apply)."""


def build_program(layout: KimiLinearStepLayout, tile_rows_override: dict | None = None) -> KimiLinearStepProgram:
    """The step's instructions in a global topological order (deepseek.ProgramBuilder: `tile_rows_override`):
    per layer a KDA block (KDA_PROJ, KDA_STATE per sequence and head group, KDA_OUT_NORM) or the MLA block,
    then the dense FFN or the MoE block."""
    b = ProgramBuilder(layout, tile_rows_override)
    c = layout.config
    B, H, D, dk = layout.batch, c.hidden_size, c.kda_dim, c.linear_head_dim
    g_kda = layout.kda_head_group
    state_bytes = 2 * g_kda * dk * dk * b.F32 + 2 * g_kda * dk * dk * b.ELEM \
        + 2 * 3 * g_kda * dk * c.linear_conv_kernel_dim * b.F32
    prev = b.embed()
    for l in range(c.num_layers):
        if c.is_kda_layer(l):
            c_proj, c_state, c_o = b.cid(l, "KDA_PROJ"), b.cid(l, "KDA_STATE"), b.cid(l, "O_PROJ")
            n_proj = b.matvec_stage(Opcode.KDA_PROJ, l, kda_proj_rows(c), H, prev, c_proj)
            for s in range(B):
                for g in range(layout.num_kda_head_groups):
                    b.add(opcode=Opcode.KDA_STATE, layer=l, a0=s, a1=g, wait_id=c_proj, wait_count=n_proj,
                          signal_id=c_state, cost=state_bytes + FIXED_COST_BYTES)
            n_state = B * layout.num_kda_head_groups
            o_ready = (c_o, b.matvec_stage(Opcode.KDA_OUT_NORM, l, H, D, (c_state, n_state), c_o,
                                           extra_cost=2 * B * D * b.F32))
        else:
            o_ready = b.mla(l, prev, "O_PROJ")
        prev = b.ffn(l, o_ready)
    return b.finish(prev, KimiLinearStepProgram)


# ---- the CPU decoder ------------------------------------------------------------------------------

class KimiLinearVMDecoder:
    """A whole Kimi Linear decode step on the CPU through the instruction VM: the program of the layout,
    assigned to SMs, proven deadlock-free (simulate), serialized, then executed from the serialized
    queues with each stage's torch reference.

    `self.cache` is a KimiLinearCache (the reference decoder's layout): latent rows NaN-filled, and the
    KDA state NaN-filled too: a slot is only ever read by a sequence past position 0, after its own
    position-0 step wrote it (a sequence at position 0 starts from an empty state, as the reference's
    reset)."""

    def __init__(self, weights: KimiLinearWeights, batch: int, max_seq_len: int, block_size: int = 16,
                 num_sms: int = 132, policy: str = "balanced", kv_splits: int | None = None,
                 head_group: int | None = None, kda_head_group: int | None = None, num_blocks: int | None = None,
                 num_state_slots: int | None = None, cache_dtype: torch.dtype = torch.float32,
                 tile_rows_override: dict | None = None):
        config = weights.config
        self.layout = KimiLinearStepLayout.for_model(config, batch, max_seq_len, block_size, num_sms, kv_splits,
                                                     head_group, kda_head_group, num_state_slots)
        self.program = build_program(self.layout, tile_rows_override)
        self.queues = assign(self.program, policy)
        simulate(self.queues, self.program.num_counters)
        self.table, self.lengths = serialize(self.queues)
        packed = pack_weights(weights, self.layout.max_seq_len)
        nb = num_blocks or batch * self.layout.max_blocks_per_seq
        self.cache = KimiLinearCache.allocate(config, self.layout.num_state_slots, nb, block_size,
                                              dtype=cache_dtype, device=weights.device)
        self.cache.kda.recurrent.fill_(float("nan"))
        self.cache.kda.conv.fill_(float("nan"))
        bufs = allocate_buffers(self.layout, self.program.lm_tiles, self.program.num_counters, self.cache)
        self.ctx = KimiLinearStageContext(self.layout, packed, bufs,
                                          LayerRows(self.cache.latent.latent, config.mla_layers))
        self.vm = InstructionVM(self.ctx, self.table, self.lengths, self.program.num_counters)

    @property
    def bufs(self) -> KimiLinearStepBuffers:
        return self.ctx.bufs

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             slots: torch.Tensor | None = None, order: str = "round-robin") -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next tokens int32 [B], logits float32 [B, V]). `slots` [B]: each sequence's KDA state slot
        (default 0..B-1), distinct, in [0, num_state_slots)."""
        B = self.layout.batch
        slots = torch.arange(B) if slots is None else torch.as_tensor(slots)
        if slots.shape != (B,):
            raise ValueError(f"slots must have shape ({B},); got {tuple(slots.shape)}")
        s = slots.cpu().tolist()
        if min(s) < 0 or max(s) >= self.layout.num_state_slots or len(set(s)) != B:
            raise ValueError(f"slots must be distinct and in [0, {self.layout.num_state_slots}); got {s}")
        self.bufs.kda_slots.copy_(slots.to(torch.int32))
        return run_vm_step(self.vm, self.layout, self.bufs, tokens, positions, block_table,
                           self.cache.latent.num_blocks, order)
