"""How a vLLM instance's settings, batches, KV cache and weights map onto the megakernel's: the switch and the batch
limit, the batch buckets, the reasons a batch runs on the stock path, the paged KV cache's geometry, the weights
read from vLLM's modules (with tensor_parallel_size > 1: this rank's shard, and the whole embedding gathered from
the ranks' vocabulary shards) and the step's inputs staged from vLLM's buffers. Plain torch, testable without
vLLM or a GPU (the tensor-parallel group's collectives are a TPGroup the caller builds: vllm_model from vLLM's
group, tests from threads); megakernel.integrations.vllm_model's classes use it where vLLM imports."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megakernel.instructions.layout import KERNEL_MAX_BATCH, SPLIT_BATCH, StepLayout
from megakernel.instructions.tensor_parallel.layout import ShardLayout, require_kernel_shard
from megakernel.integrations.vllm_plugin import ARCHITECTURES, ENV_SWITCH, env_override, stock_architecture
from megakernel.model.config import ModelConfig
from megakernel.model.ops import rms_norm
from megakernel.model.tensor_parallel import shard_config
from megakernel.model.weights import LayerWeights, ModelWeights
from megakernel.runtime.collective import agreed_reason, gather_checked

logger = logging.getLogger("vllm.megakernel")

CONFIG_KEY = "megakernel"             # the key of vLLM's additional_config that switches an instance
# The largest decode batch the plugin can send to the megakernel: the kernel's (the limit a user sets is at most this)
MAX_DECODE_BATCH = KERNEL_MAX_BATCH
ENV_MAX_BATCH = "MEGAKERNEL_VLLM_MAX_BATCH"   # largest decode batch sent to the megakernel (1..MAX_DECODE_BATCH)
# Default of ENV_MAX_BATCH. tools/vllm_bench.py on the H200, megakernel at every batch against stock vLLM
# (profiles/RESULTS.md): llama-3.1-8b 1.16x at batch 1, 0.86x at 8, 0.91x at 16, 0.82x at 32, 0.66x at 64
# (2026-12-04, thirteenth session; with async scheduling 1.17x at 1, 0.84x at 8); llama-3.2-1b 1.02x at 1, 0.91x
# at 2, 0.99x at 4, 0.85x at 8 (2026-11-30). Only batch 1 is faster, so larger decode batches run stock unless the
# switch says otherwise.
DEFAULT_MAX_BATCH = 1
POW2_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The largest decode batch a tensor-parallel rank runs (schedule.tensor_parallel: up to SPLIT_BATCH); larger
# decode batches of a tensor-parallel instance run stock.
TP_MAX_BATCH = SPLIT_BATCH

# Reasons a batch goes to the stock path. QUERY_LEN is the normal case for prefill and is not logged.
QUERY_LEN = "a request has more than one query token (prefill, chunked prefill or mixed batch)"


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------

def megakernel_config(hf_config: Any, name: str = "vllm") -> ModelConfig:
    """megakernel's ModelConfig from the HF config vLLM holds (a PretrainedConfig or a dict).
    A megakernel architecture name (from hf_overrides) is read as the stock one. ValueError names
    anything the megakernel does not support."""
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    archs = cfg.get("architectures") or []
    cfg["architectures"] = [stock_architecture(a) for a in archs]
    return ModelConfig.from_hf_config(cfg, name=name)


def vllm_config_reason(vllm_config: Any) -> str | None:
    """Why this vLLM configuration cannot use the megakernel at all, or None. (tensor_parallel_size > 1 is the
    model's business: tp_reason.)"""
    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) != 1:
        return (f"pipeline_parallel_size={pc.pipeline_parallel_size} (the megakernel runs every layer of the model "
                f"in one launch per rank)")
    mc = vllm_config.model_config
    if getattr(mc, "dtype", torch.bfloat16) != torch.bfloat16:
        return f"dtype={mc.dtype} (the megakernel reads bfloat16 weights)"
    quant = getattr(vllm_config, "quant_config", None) or getattr(mc, "quantization", None)
    if quant:
        return f"quantization={getattr(mc, 'quantization', quant)!s} (bfloat16 weights only)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is enabled (the megakernel has no adapter path)"
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", "bfloat16"):
        return f"kv_cache_dtype={cache_dtype} (the megakernel reads a bfloat16 KV cache)"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding (its decode steps carry more than one query token)"
    return None


def tensor_parallel_size(vllm_config: Any) -> int:
    """vLLM's tensor_parallel_size (1 where the config does not say)."""
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def tp_reason(config: ModelConfig, world_size: int) -> str | None:
    """Why the megakernel cannot split this model over world_size ranks as vLLM's tensor parallel group does, or
    None: fewer kv heads than ranks (vLLM then replicates kv heads across ranks; the kernel's ranks each own
    distinct whole kv heads), a world size the kernel does not run or the model does not divide by
    (model.tensor_parallel.check_world_size: heads, kv heads, FFN, vocabulary), or shards the device code cannot
    stream (instructions.tensor_parallel.layout.require_kernel_shard)."""
    if world_size == 1:
        return None
    if config.num_kv_heads < world_size:
        return (f"num_kv_heads={config.num_kv_heads} < tensor_parallel_size={world_size}: vLLM replicates kv heads "
                f"across ranks, and the megakernel's ranks each own distinct whole kv heads")
    try:
        require_kernel_shard(config, world_size)
    except ValueError as exc:
        return f"tensor_parallel_size={world_size}: {exc}"
    return None


def layout_reason(config: ModelConfig, max_batch: int = 1, world_size: int = 1) -> str | None:
    """Why the megakernel cannot run this model shape at batch 1 or max_batch (the instance's limit), split over
    world_size ranks, or None."""
    why = tp_reason(config, world_size)
    if why is not None:
        return why
    for batch in sorted({1, max_batch}):
        try:
            layout = StepLayout(config=config, batch=batch, kv_splits=1, block_size=16, max_blocks_per_seq=1,
                                num_sms=1)
            (ShardLayout.of(layout, world_size) if world_size > 1 else layout).validate()
        except ValueError as exc:
            return f"model shape not supported: {exc}"
    return None


def switch_setting(vllm_config: Any, environ: Mapping[str, str] = os.environ) -> tuple[bool, int | None, str]:
    """(on, max_batch or None, why) for one vLLM instance; the first switch that is set wins:
    additional_config={"megakernel": true | false | {"max_batch": N}} (vLLM's per-instance settings; a dict
    is on, with N in 1..MAX_DECODE_BATCH as the largest decode batch sent to the kernel), a megakernel
    architecture name in the model's config (hf_overrides), MEGAKERNEL_VLLM=1. ValueError, saying what is
    accepted, for any other value under the key: an explicit setting is not guessed at."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, Mapping) and CONFIG_KEY in extra:
        value = extra[CONFIG_KEY]
        if isinstance(value, bool):
            return value, None, f"additional_config {CONFIG_KEY}={value}"
        if isinstance(value, Mapping) and set(value) <= {"max_batch"}:
            mb = value.get("max_batch")
            if mb is None:
                return True, None, f"additional_config {CONFIG_KEY}={dict(value)}"
            if isinstance(mb, int) and not isinstance(mb, bool) and 1 <= mb <= MAX_DECODE_BATCH:
                return True, mb, f"additional_config {CONFIG_KEY}={dict(value)}"
        raise ValueError(f"additional_config {CONFIG_KEY!r}: {value!r} is not true, false or "
                         f"{{\"max_batch\": N}} with N an integer in 1..{MAX_DECODE_BATCH}")
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    archs = (hf.get("architectures") if isinstance(hf, Mapping) else getattr(hf, "architectures", None)) or []
    named = [a for a in archs if a in ARCHITECTURES]
    if named:
        return True, None, f"architecture {named[0]} (hf_overrides)"
    if env_override(environ):
        return True, None, f"{ENV_SWITCH}=1"
    return False, None, (f"not switched on (additional_config {{\"{CONFIG_KEY}\": true}}, a megakernel "
                         f"architecture in hf_overrides, or {ENV_SWITCH}=1)")


def max_batch_setting(environ: Mapping[str, str] = os.environ) -> int:
    """The largest decode batch the megakernel serves: MEGAKERNEL_VLLM_MAX_BATCH, or DEFAULT_MAX_BATCH.
    A value that is not an integer in 1..MAX_DECODE_BATCH is refused with a warning (the default applies):
    a plugin that raised would stop vLLM from starting."""
    raw = environ.get(ENV_MAX_BATCH, "").strip()
    if not raw:
        return DEFAULT_MAX_BATCH
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_DECODE_BATCH:
        logger.warning("%s=%r is not an integer in 1..%d; the megakernel serves decode batches up to %d",
                       ENV_MAX_BATCH, raw, MAX_DECODE_BATCH, DEFAULT_MAX_BATCH)
        return DEFAULT_MAX_BATCH
    return value


def decode_buckets(capture_sizes: list[int] | None, max_batch: int = MAX_DECODE_BATCH) -> tuple[int, ...]:
    """Batch sizes an engine is built for: powers of two up to max_batch, plus every CUDA-graph
    capture size <= max_batch (a graph of n rows then runs an engine of exactly n)."""
    sizes = {b for b in POW2_BUCKETS if b <= max_batch}
    sizes.update(s for s in capture_sizes or () if 1 <= s <= max_batch)
    return tuple(sorted(sizes))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows, or None when n exceeds them all."""
    for b in buckets:
        if b >= n:
            return b
    return None


def batch_reason(num_tokens: int, num_reqs: int, max_query_len: int, *, has_embeds: bool = False,
                 has_intermediate: bool = False, max_batch: int = MAX_DECODE_BATCH) -> str | None:
    """Why this forward is not a megakernel decode batch, or None. num_tokens counts rows after
    CUDA-graph padding; num_reqs is the block table's row count."""
    if has_intermediate:
        return "pipeline-parallel intermediate tensors"
    if has_embeds:
        return "the batch carries input embeddings, not token ids"
    if max_query_len != 1 or num_reqs != num_tokens:
        return QUERY_LEN
    if num_tokens > max_batch:
        return (f"decode batch of {num_tokens} exceeds the megakernel's maximum batch {max_batch}"
                + ("" if max_batch == MAX_DECODE_BATCH else f" ({ENV_MAX_BATCH})"))
    return None


# ------------------------------------------------------------------------------------------------
# KV cache
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVGeometry:
    """What the kernel needs to address every layer's cache: per-layer base addresses come from the
    tensors themselves; these are shared by all of them (strides in elements)."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_stride: int
    token_stride: int
    head_stride: int


def split_kv_cache(kv: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's vLLM KV cache -> (k, v) views [num_blocks, block_size, num_kv_heads, head_dim].

    Layouts understood (no copy; the views alias vLLM's memory):
      (num_blocks, num_kv_heads, block_size, 2*head_dim)  vLLM 0.26 FlashAttention: K and V packed in
                                                          the last dim; memory order NHD or HND
      (2, num_blocks, block_size, num_kv_heads, head_dim) FlashAttention before 0.26 (K, V planes)
      (num_blocks, 2, block_size, num_kv_heads, head_dim) FlashInfer
    """
    if isinstance(kv, (list, tuple)):   # one tensor per virtual engine in older vLLM
        kv = kv[0]
    shape = tuple(kv.shape)
    hkv, d = num_kv_heads, head_dim
    if len(shape) == 4 and shape[1] == hkv and shape[3] == 2 * d:
        k, v = kv.transpose(1, 2).split(d, dim=-1)
        return k, v
    if len(shape) == 5 and shape[3:] == (hkv, d):
        if shape[0] == 2 and shape[1] != 2:
            return kv[0], kv[1]
        if shape[1] == 2 and shape[0] != 2:
            return kv[:, 0], kv[:, 1]
    raise ValueError(f"KV cache of shape {shape} (strides {tuple(kv.stride())}) is not a layout the "
                     f"megakernel adapter knows for {hkv} kv heads of dim {d}")


def kv_geometry(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> KVGeometry:
    """Check that all 2L views share shape, dtype, device and strides, with unit stride and 16-byte
    alignment in the head dim (one 16-byte load per lane). ValueError names the first mismatch."""
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError(f"need one K and one V cache per layer; got {len(k_caches)} and {len(v_caches)}")
    ref = k_caches[0]
    if ref.dtype != torch.bfloat16:
        raise ValueError(f"KV cache dtype is {ref.dtype}; the megakernel reads bfloat16")
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        for name, t in (("k", k), ("v", v)):
            if t.shape != ref.shape or t.stride() != ref.stride():
                raise ValueError(f"layer {i} {name} cache has shape {tuple(t.shape)} strides {t.stride()}, "
                                 f"layer 0 k has {tuple(ref.shape)} {ref.stride()}")
            if t.dtype != ref.dtype or t.device != ref.device:
                raise ValueError(f"layer {i} {name} cache is {t.dtype} on {t.device}, layer 0 k is "
                                 f"{ref.dtype} on {ref.device}")
            if t.stride(-1) != 1 or (t.data_ptr() % 16):
                raise ValueError(f"layer {i} {name} cache: head dim stride {t.stride(-1)}, address "
                                 f"{t.data_ptr():#x} (need stride 1 and 16-byte alignment)")
    nb, bs, hkv, d = ref.shape
    sb, st, sh, _ = ref.stride()
    if (d * ref.element_size()) % 16 or any((s * ref.element_size()) % 16 for s in (sb, st, sh)):
        raise ValueError(f"KV cache strides {ref.stride()} are not multiples of 16 bytes")
    return KVGeometry(num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_dim=d, block_stride=sb,
                      token_stride=st, head_stride=sh)


# ------------------------------------------------------------------------------------------------
# Weights, inputs, outputs
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TPGroup:
    """This process's rank in vLLM's tensor-parallel group and the group's two collectives (vllm_model builds it
    from vLLM's GroupCoordinator; the tests from threads)."""

    rank: int
    world_size: int
    gather_object: Callable[[Any], list]                  # obj -> every rank's obj, rank order (the CPU group)
    gather_rows: Callable[[torch.Tensor], torch.Tensor]   # [n, ...] alike on every rank -> [W n, ...], rank order


def _param(module: torch.nn.Module, path: str, shape: tuple[int, ...], model: str, rows: int | None = None):
    t = module.weight.detach()
    if rows is not None:
        t = t[:rows]
    if tuple(t.shape) != shape:
        raise ValueError(f"vLLM parameter {path}.weight has shape {tuple(module.weight.shape)}, expected {shape} "
                         f"for {model}")
    return t


def _layer_views(inner: torch.nn.Module, c: ModelConfig, model: str) -> tuple[list[LayerWeights], torch.Tensor]:
    """Every layer's parameters and the final norm as views, with the shapes of `c` (the model's config, or one
    rank's shard config: vLLM's QKVParallelLinear holds the rank's q|k|v rows, MergedColumnParallelLinear its
    gate|up rows, RowParallelLinear its O and down columns, as model.tensor_parallel.shard_weights cuts them)."""
    h, f = c.hidden_size, c.intermediate_size
    layers = []
    for i, layer in enumerate(inner.layers):
        p = f"model.layers.{i}"
        at, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            attn_norm=_param(layer.input_layernorm, f"{p}.input_layernorm", (h,), model),
            qkv=_param(at.qkv_proj, f"{p}.self_attn.qkv_proj", (c.qkv_rows, h), model),
            q_norm=_param(at.q_norm, f"{p}.self_attn.q_norm", (c.head_dim,), model) if c.qk_norm else None,
            k_norm=_param(at.k_norm, f"{p}.self_attn.k_norm", (c.head_dim,), model) if c.qk_norm else None,
            o_proj=_param(at.o_proj, f"{p}.self_attn.o_proj", (h, c.q_size), model),
            mlp_norm=_param(layer.post_attention_layernorm, f"{p}.post_attention_layernorm", (h,), model),
            gate_up=_param(mlp.gate_up_proj, f"{p}.mlp.gate_up_proj", (2 * f, h), model),
            down=_param(mlp.down_proj, f"{p}.mlp.down_proj", (h, f), model),
        ))
    if len(layers) != c.num_layers:
        raise ValueError(f"vLLM model has {len(layers)} layers, config says {c.num_layers}")
    return layers, _param(inner.norm, "model.norm", (h,), model)


def weights_from_vllm(model: torch.nn.Module, config: ModelConfig, tp: TPGroup | None = None) -> ModelWeights:
    """megakernel's ModelWeights as views of a loaded vLLM Llama / Qwen3 model's parameters.

    vLLM already fuses q/k/v (qkv_proj: q rows, then k, then v) and gate/up (gate_up_proj: gate rows,
    then up), the order ModelWeights uses. The embedding may be padded to a multiple of 64 rows.

    With a tensor-parallel group of more than one rank (`tp`): this rank's shard, equal to
    model.tensor_parallel.shard_weights(whole model, W)[rank] (views of its qkv, o_proj, gate_up and down
    parameters, which vLLM holds cut the same way; a ModelWeights over shard_config), with the WHOLE embedding,
    gathered once here from every rank's VocabParallelEmbedding shard with vLLM's padding rows dropped (the
    kernel's EMBED reads any token's row on every rank): one more copy of the embedding per rank, V x H bf16
    (0.5 GiB for llama-3.2-1b, 1 GiB for llama-3.1-8b). The LM head rows are the rank's V/W vocabulary rows
    (a slice of the gathered embedding when tied; views of vLLM's lm_head shard where its rows are those, else
    gathered and cut). Collective: every rank of the group calls it; a rank whose parameters are not understood
    makes every rank raise ValueError (agreed before any tensor is gathered)."""
    if tp is None or tp.world_size == 1:
        c, v, h = config, config.vocab_size, config.hidden_size
        inner = model.model
        embed = _param(inner.embed_tokens, "model.embed_tokens", (v, h), c.name, rows=v)
        layers, final_norm = _layer_views(inner, c, c.name)
        lm_head = embed if c.tie_word_embeddings else _param(model.lm_head, "lm_head", (v, h), c.name, rows=v)
        return ModelWeights(config=c, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
    return _shard_from_vllm(model, config, tp)


def _vocab_shard(module: torch.nn.Module, path: str, config: ModelConfig) -> tuple[torch.Tensor, tuple[int, int]]:
    """A VocabParallelEmbedding's (or ParallelLMHead's) local weight [rows per rank, H], padding included, and the
    vocabulary ids its first rows hold: (org_vocab_start_index, org_vocab_end_index) of its shard_indices
    (vLLM pads the vocabulary to a multiple of 64, splits the padded rows evenly, and puts each rank's real rows
    first; LoRA's added rows, which would follow, are refused)."""
    weight = module.weight.detach()
    if weight.dim() != 2 or weight.shape[1] != config.hidden_size:
        raise ValueError(f"vLLM parameter {path}.weight has shape {tuple(weight.shape)}, expected (rows, "
                         f"{config.hidden_size}) for {config.name}")
    indices = getattr(module, "shard_indices", None)
    if indices is None:
        raise ValueError(f"{path} ({type(module).__name__}) has no shard_indices: not a vLLM VocabParallelEmbedding")
    if getattr(module, "num_added_embeddings", 0):
        raise ValueError(f"{path} has {module.num_added_embeddings} added (LoRA) vocabulary rows")
    lo, hi = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
    if not 0 <= hi - lo <= weight.shape[0]:
        raise ValueError(f"{path}: vocabulary ids [{lo}, {hi}) in {weight.shape[0]} rows")
    return weight, (lo, hi)


def _vocab_ranges(tp: TPGroup, ids: tuple[int, int], config: ModelConfig, rows: int,
                  path: str) -> list[tuple[int, int]]:
    """Every rank's vocabulary ids of a vocabulary shard of `rows` rows, checked to cover the vocabulary in rank
    order (ValueError otherwise, on every rank alike). Collective."""
    entries = gather_checked(tp.gather_object, {"rank": tp.rank, "ids": ids}, tp.world_size, f"gathering {path}")
    ranges = [tuple(e["ids"]) for e in entries]
    expect = 0
    for r, (lo, hi) in enumerate(ranges):
        if lo != expect or not 0 <= hi - lo <= rows:
            raise ValueError(f"{path}: the ranks' vocabulary ids {ranges} do not cover 0..{config.vocab_size - 1} in "
                             f"rank order (rank {r})")
        expect = hi
    if expect != config.vocab_size:
        raise ValueError(f"{path}: the ranks hold vocabulary ids up to {expect}; {config.name} has "
                         f"{config.vocab_size}")
    return ranges


def _gather_vocab(local: torch.Tensor, ranges: list[tuple[int, int]], tp: TPGroup) -> torch.Tensor:
    """Every rank's vocabulary shard -> the whole matrix [V, H] in vocabulary order, vLLM's padding rows dropped.
    Collective."""
    rows = local.shape[0]
    gathered = tp.gather_rows(local.contiguous())          # [W rows, H]: every rank's, padding included
    if all(hi - lo == rows for lo, hi in ranges):
        return gathered
    return torch.cat([gathered[r * rows:r * rows + hi - lo] for r, (lo, hi) in enumerate(ranges)])


def _shard_from_vllm(model: torch.nn.Module, config: ModelConfig, tp: TPGroup) -> ModelWeights:
    sc = shard_config(config, tp.world_size)
    inner = model.model
    reason = None
    try:
        layers, final_norm = _layer_views(inner, sc, config.name)
        embed_local, embed_ids = _vocab_shard(inner.embed_tokens, "model.embed_tokens", config)
        if not config.tie_word_embeddings:
            head_local, head_ids = _vocab_shard(model.lm_head, "lm_head", config)
    except (ValueError, AttributeError) as exc:
        reason = str(exc)
    # (before any tensor is gathered: a rank that stopped here would leave the others in the gather)
    why = agreed_reason(tp.gather_object, tp.rank, tp.world_size, reason)
    if why is not None:
        raise ValueError(why)
    ranges = _vocab_ranges(tp, embed_ids, config, embed_local.shape[0], "model.embed_tokens")
    embed = _gather_vocab(embed_local, ranges, tp)
    per_rank = sc.vocab_size
    lo = tp.rank * per_rank
    if config.tie_word_embeddings:
        lm_head = embed[lo:lo + per_rank]
    else:
        ranges = _vocab_ranges(tp, head_ids, config, head_local.shape[0], "lm_head")
        if all(a == r * per_rank and b - a >= per_rank for r, (a, b) in enumerate(ranges)):
            lm_head = head_local[:per_rank]                  # vLLM's shard starts with exactly this rank's rows
        else:
            lm_head = _gather_vocab(head_local, ranges, tp)[lo:lo + per_rank].clone()
    return ModelWeights(config=sc, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head,
                        meta={"rank": tp.rank, "world_size": tp.world_size})


def stage_decode_inputs(tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                        input_ids: torch.Tensor, input_positions: torch.Tensor, slot_mapping: torch.Tensor,
                        vllm_block_table: torch.Tensor) -> None:
    """Copy one decode batch of n rows into an engine's input buffers of B >= n rows, on the device,
    without a host sync (so it can sit in a CUDA graph).

    tokens, positions int32 [B]; block_table int32 [B, nb] (engine buffers, written in place);
    input_ids, input_positions [n]; slot_mapping [>= n] (-1 marks a padded row); vllm_block_table
    int32 [>= n, >= 1]. Rows that are padding (slot -1, or past n) get token 0, position 0 and an
    all-zero block table row (block 0: vLLM's null block)."""
    n = input_ids.shape[0]
    nb = block_table.shape[1]
    w = min(nb, vllm_block_table.shape[1])
    valid = slot_mapping[:n] >= 0
    tokens[:n].copy_(torch.where(valid, input_ids, 0))
    positions[:n].copy_(torch.where(valid, input_positions[:n], 0))
    block_table[:n, :w].copy_(torch.where(valid[:, None], vllm_block_table[:n, :w], 0))
    if n < tokens.shape[0]:
        tokens[n:].zero_()
        positions[n:].zero_()
        block_table[n:].zero_()


def final_hidden(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The model's final RMSNorm of the residual stream x [n, H] (float32 from the kernel), computed in
    float32 and rounded once to `dtype`: the hidden states vLLM's LM head expects."""
    return rms_norm(x, norm_weight, eps).to(dtype)


def rope_positions(max_seq_len: int, block_size: int) -> int:
    """Positions the shared packed weights' RoPE tables must cover for an engine of this max_seq_len and
    block size: the engine decodes positions up to its cache length, max_seq_len rounded up to blocks."""
    return -(-max_seq_len // block_size) * block_size


def engine_kwargs(engine_cls: type, **optional: Any) -> dict[str, Any]:
    """The subset of `optional` keyword arguments that engine_cls's constructor accepts."""
    params = inspect.signature(engine_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optional)
    return {k: val for k, val in optional.items() if k in params}
