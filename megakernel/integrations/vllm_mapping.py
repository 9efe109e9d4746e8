"""How a vLLM instance's settings, batches, KV cache and weights map onto the megakernel's: the switch and the batch
limit, the batch buckets, the reasons a batch runs on the stock path, the paged KV cache's geometry, the weights
read from vLLM's modules and the step's inputs staged from vLLM's buffers. Plain torch, testable without vLLM or a
GPU; megakernel.integrations.vllm_model's classes use it where vLLM imports."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megakernel.instructions.layout import KERNEL_CAPABILITY, KERNEL_MAX_BATCH, StepLayout
from megakernel.integrations.vllm_plugin import ARCHITECTURES, ENV_SWITCH, env_override, stock_architecture
from megakernel.model.config import ModelConfig
from megakernel.model.ops import rms_norm
from megakernel.model.weights import LayerWeights, ModelWeights

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
    """Why this vLLM configuration cannot use the megakernel at all, or None."""
    pc = vllm_config.parallel_config
    for field in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(pc, field, 1) != 1:
            return f"{field}={getattr(pc, field)} (the megakernel runs a whole model on one GPU)"
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


def layout_reason(config: ModelConfig, max_batch: int = 1) -> str | None:
    """Why the megakernel cannot run this model shape at batch 1 or max_batch (the instance's limit), or None."""
    for batch in sorted({1, max_batch}):
        try:
            StepLayout(config=config, batch=batch, kv_splits=1, block_size=16, max_blocks_per_seq=1,
                       num_sms=1).validate()
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

def weights_from_vllm(model: torch.nn.Module, config: ModelConfig) -> ModelWeights:
    """megakernel's ModelWeights as views of a loaded vLLM Llama / Qwen3 model's parameters (no copy).

    vLLM already fuses q/k/v (qkv_proj: q rows, then k, then v) and gate/up (gate_up_proj: gate rows,
    then up), the order ModelWeights uses. The embedding may be padded to a multiple of 64 rows."""
    inner = model.model
    c = config
    h, f, v = c.hidden_size, c.intermediate_size, c.vocab_size

    def param(module: torch.nn.Module, path: str, shape: tuple[int, ...], rows: int | None = None):
        t = module.weight.detach()
        if rows is not None:
            t = t[:rows]
        if tuple(t.shape) != shape:
            raise ValueError(f"vLLM parameter {path}.weight has shape {tuple(module.weight.shape)}, "
                             f"expected {shape} for {c.name}")
        return t

    embed = param(inner.embed_tokens, "model.embed_tokens", (v, h), rows=v)
    layers = []
    for i, layer in enumerate(inner.layers):
        p = f"model.layers.{i}"
        at, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            attn_norm=param(layer.input_layernorm, f"{p}.input_layernorm", (h,)),
            qkv=param(at.qkv_proj, f"{p}.self_attn.qkv_proj", (c.qkv_rows, h)),
            q_norm=param(at.q_norm, f"{p}.self_attn.q_norm", (c.head_dim,)) if c.qk_norm else None,
            k_norm=param(at.k_norm, f"{p}.self_attn.k_norm", (c.head_dim,)) if c.qk_norm else None,
            o_proj=param(at.o_proj, f"{p}.self_attn.o_proj", (h, c.q_size)),
            mlp_norm=param(layer.post_attention_layernorm, f"{p}.post_attention_layernorm", (h,)),
            gate_up=param(mlp.gate_up_proj, f"{p}.mlp.gate_up_proj", (2 * f, h)),
            down=param(mlp.down_proj, f"{p}.mlp.down_proj", (h, f)),
        ))
    if len(layers) != c.num_layers:
        raise ValueError(f"vLLM model has {len(layers)} layers, config says {c.num_layers}")
    lm_head = embed if c.tie_word_embeddings else param(model.lm_head, "lm_head", (v, h), rows=v)
    return ModelWeights(config=c, embed=embed, layers=layers, final_norm=param(inner.norm, "model.norm", (h,)),
                        lm_head=lm_head)


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
