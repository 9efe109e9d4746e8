"""vLLM model classes whose pure-decode steps run through the megakernel.

``MegakernelLlamaForCausalLM`` / ``MegakernelQwen3ForCausalLM`` subclass vLLM's own classes: weights
load, prefill, chunked prefill and mixed batches run through the stock layers (torch.compile,
FlashAttention). A forward whose every request has one query token and whose batch is at most the limit
below (at most 64, ``vllm_mapping.MAX_DECODE_BATCH``) runs as one megakernel launch instead, in place in vLLM's paged KV
cache:

    tokens, positions   <- vLLM's input_ids / positions buffers (padded rows masked, see below)
    block table         <- the attention metadata's block_table (rows [:n], first max_blocks columns)
    KV cache            <- every layer's kv_cache tensor, bound once by address (bind_kv_caches)
    megakernel launch   -> x[L], the residual stream after the last layer (float32 [B, H])
    forward returns     final RMSNorm(x[L]) in the model dtype, like the stock model does

vLLM then computes logits and samples as usual (its LM head and sampler), so sampling parameters,
logprobs and structured output behave as in stock vLLM. The kernel writes each token's K/V at
block_table[b, pos // block_size], offset pos % block_size: the slot vLLM's slot_mapping names.

Padded rows (CUDA-graph padding: slot_mapping == -1) get token 0, position 0 and an all-zero block
table row: block 0 is vLLM's null block, never given to a request, so what the kernel writes there
is harmless; the engines name it their scratch block, so the kernel's aliasing check (several padded
rows append to its slot 0) lets those appends through.

CUDA graphs: the forward uses only vLLM's persistent buffers (input ids, positions, block table,
slot mapping) and preallocated engine buffers, with no host sync, so vLLM captures it whole in
FULL graphs (``cudagraph_mode="FULL_DECODE_ONLY"``; FULL_AND_PIECEWISE works the same way for the
decode graphs). Engines are built per batch bucket (the powers of two and every capture size up to the
limit) at the first decode forward of that size, which vLLM runs eagerly as warm-up before it captures.

Switch: an instance decodes through the megakernel only where vLLM's ``additional_config`` says so
(``{"megakernel": true}``), its architecture is a megakernel name (hf_overrides) or ``MEGAKERNEL_VLLM=1``
(``switch_setting``); otherwise it is vLLM's stock model in every step.

Batch limit: ``additional_config={"megakernel": {"max_batch": N}}``, else ``MEGAKERNEL_VLLM_MAX_BATCH``
(1..64, default ``vllm_mapping.DEFAULT_MAX_BATCH``), is the largest decode batch sent to the megakernel; larger decode
batches run stock (at 2-8 vLLM's batched GEMMs overtook the megakernel of 2026-11-30; past 8 the kernel's
wgmma path has not been measured inside vLLM yet: profiles/RESULTS.md).

Fallback: whenever the megakernel cannot serve a batch (unsupported model or vLLM config, batch above
the limit, no Hopper GPU, KV cache layout not understood, engine without the per-layer KV cache API)
the stock path runs, and the reason is logged once.

Tensor parallel (``tensor_parallel_size`` > 1; pipeline parallel runs stock): every rank's worker process decodes
through a TensorParallelRank (runtime.tensor_parallel) over its shard, the partial sums exchanged by the kernels
through CUDA IPC mappings of the peers' buffers, x[L] the same bits on every rank; vLLM's LM head (its
vocabulary-parallel GEMM and gather) computes the logits as usual. The shard is views of vLLM's own per-rank
parameters (weights_from_vllm), plus the whole embedding gathered once at load time. Decode batches go to the
kernel up to ``vllm_mapping.TP_MAX_BATCH``; models with fewer kv heads than ranks (vLLM replicates them), or whose
heads, FFN or vocabulary do not split, run stock with the reason logged. A rank must never run stock while its
peers launch their kernels (they would wait on its exchange signals until the kernel's timeout, and it would join
vLLM collectives they never start), so every such decision is the same on every rank: from the batch (vLLM runs
the same steps on every rank), agreed over the group at weight load (runtime.collective), collective at engine
build, and on the decode path an exception is raised (the step fails) instead of running that rank stock.

What these classes decide from plain data (the switch, the batch limit and buckets, the reasons a batch runs
stock, the KV cache's geometry, the weights and the step's inputs) is megakernel.integrations.vllm_mapping: plain
torch, testable without vLLM or a GPU. The classes exist only where vLLM imports.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter
from dataclasses import asdict
from typing import Any

import torch

from megakernel.instructions.layout import KERNEL_CAPABILITY, pack_weights
from megakernel.integrations.vllm_mapping import (QUERY_LEN, TP_MAX_BATCH, KVGeometry, TPGroup, batch_reason,
                                                  decode_buckets, engine_kwargs, final_hidden, kv_geometry,
                                                  layout_reason, max_batch_setting, megakernel_config, pick_bucket,
                                                  rope_positions, split_kv_cache, stage_decode_inputs, switch_setting,
                                                  tensor_parallel_size, vllm_config_reason, weights_from_vllm)
from megakernel.model.config import ModelConfig
from megakernel.model.tensor_parallel import shard_config
from megakernel.model.weights import ModelWeights
from megakernel.runtime.collective import agreed_reason, process_group_gather

logger = logging.getLogger("vllm.megakernel")

ENV_CHECK = "MEGAKERNEL_VLLM_CHECK"   # "1": read the kernel's error word after every eager launch

# What the vLLM-side integration did in this process (the GPU tools read it; graph replays do not
# run Python, so "captured" lists the graph sizes that contain a megakernel launch).
STATS: dict[str, Any] = {"eager_steps": 0, "captured": [], "engines": [], "fallbacks": Counter(),
                         "disabled": None}
_LOGGED: set[str] = set()
_ADAPTERS: "weakref.WeakSet[MegakernelDecode]" = weakref.WeakSet()
_CUDA: bool | None = None   # whether this torch has CUDA, asked on first use (not at import: fork safety)


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (False without CUDA)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = torch.cuda.is_available()
    return _CUDA and torch.cuda.is_current_stream_capturing()


def _log_once(message: str, level: int = logging.INFO,
              consequence: str = "this batch runs on the stock vLLM path") -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, "megakernel: %s; %s", message, consequence)


# ------------------------------------------------------------------------------------------------
# The adapter between one vLLM model instance and its megakernel engines
# ------------------------------------------------------------------------------------------------

class MegakernelDecode:
    """Owns the engines of one vLLM model; `maybe_decode` returns the final hidden states of a
    decode batch it served, or None (the caller then runs the stock forward).

    With tensor_parallel_size > 1 it is one rank's: its engines are TensorParallelRank (runtime.tensor_parallel),
    one per batch bucket up to TP_MAX_BATCH, over this rank's shard, and every decision that makes a rank run
    stock or build an engine is the same on every rank (see _prepare_tensor_parallel and _engine)."""

    world_size = 1                   # vLLM's tensor_parallel_size (the constructor reads it)
    tp: TPGroup | None = None        # this rank's group, from the weights' load on (tensor_parallel_size > 1)

    def __init__(self, model: torch.nn.Module, vllm_config: Any):
        self._model = weakref.ref(model)
        self.disabled: str | None = None
        self.engines: dict[int, Any] = {}
        self.weights: ModelWeights | None = None
        self.packed = None
        self.kv: tuple[list[torch.Tensor], list[torch.Tensor], KVGeometry] | None = None
        self._kv_key: tuple[int, ...] | None = None
        self.engine_cls = None
        # engine keywords beside the adapter's own: empty, so the engines take the shipped layout and
        # kernel options, which the vLLM parity runs on the GPU host check (profiles/RESULTS.md); where a
        # different layout would be pinned for vLLM
        self.layout_kw: dict[str, Any] = {}
        self.prepared = False
        self.config: ModelConfig | None = None
        self.kv_config: ModelConfig | None = None     # the KV cache's heads: the model's, or one rank's shard's
        self.world_size = tensor_parallel_size(vllm_config)
        mc = vllm_config.model_config
        self.max_seq_len = int(mc.max_model_len)
        self.dtype = mc.dtype
        self.block_size = int(getattr(vllm_config.cache_config, "block_size", None) or 16)
        capture = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None)
        on, max_batch, self.switch = switch_setting(vllm_config)
        self.max_batch = max_batch or max_batch_setting()
        if self.world_size > 1 and self.max_batch > TP_MAX_BATCH:
            if on:
                _log_once(f"tensor_parallel_size={self.world_size}: decode batches up to {TP_MAX_BATCH} run on the "
                          f"megakernel (not {self.max_batch})", consequence="larger ones on the stock vLLM path")
            self.max_batch = TP_MAX_BATCH
        self.buckets = decode_buckets(capture, self.max_batch)
        self.check = os.environ.get(ENV_CHECK, "") == "1"
        if not on:
            # vLLM's stock code throughout: nothing viewed, packed or built (quietly: the stock classes map here)
            self.disabled = self.switch
            logger.debug("megakernel: %s; this model runs on the stock vLLM path", self.switch)
            _ADAPTERS.add(self)
            return
        why = vllm_config_reason(vllm_config)
        if why is None:
            try:
                self.config = megakernel_config(mc.hf_config, name=str(getattr(mc, "model", "vllm")))
                why = layout_reason(self.config, self.max_batch, self.world_size)
                if why is None:
                    self.kv_config = shard_config(self.config, self.world_size) if self.world_size > 1 \
                        else self.config
            except ValueError as exc:
                why = f"model config not supported: {exc}"
        if why is not None:
            self._disable(why)
        _ADAPTERS.add(self)

    # -------------------------------------------------------------- setup
    def _disable(self, why: str) -> None:
        self.disabled = why
        STATS["disabled"] = why
        _log_once(f"disabled ({why})", logging.WARNING, "every batch runs on the stock vLLM path")

    def on_weights_loaded(self) -> None:
        """After vLLM loaded the weights: view them, check the GPU and the engine API, and pack the
        weights once (before vLLM sizes its KV cache, so the copy is accounted for)."""
        if self.disabled or self.prepared:
            return
        self.prepared = True
        try:
            self._prepare()
        except Exception as exc:   # never fail vLLM's model loading: log it, go stock
            logger.exception("megakernel: preparing the decode path raised")
            self.engine_cls = None
            self._disable(f"preparing the decode path raised {type(exc).__name__}: {exc}")

    def _prepare(self) -> None:
        if self.world_size > 1:
            return self._prepare_tensor_parallel()
        model = self._model()
        try:
            self.weights = weights_from_vllm(model, self.config)
        except (ValueError, AttributeError) as exc:
            return self._disable(f"weights not understood: {exc}")
        why = self._runtime_reason(self.weights.embed.device)
        if why is not None:
            return self._disable(why)
        self.norm_weight = self.weights.final_norm
        self.eps = self.config.rms_norm_eps
        if "packed_weights" in engine_kwargs(self.engine_cls, packed_weights=None):
            self.packed = self._pack()

    def _prepare_tensor_parallel(self) -> None:
        """_prepare on one rank of vLLM's tensor-parallel group: this rank's shard with the whole embedding
        (weights_from_vllm, collective), packed once. Every reason to go stock is agreed over the group before
        the next collective step (runtime.collective.agreed_reason), so every rank decides alike: a rank that
        ran stock while another launched the kernel would leave the other waiting on its exchange counters until
        the kernel's timeout, and join vLLM collectives the other never starts."""
        model = self._model()
        self.tp = self._tp_group()
        try:
            why = self._runtime_reason(model.model.embed_tokens.weight.device)
        except Exception as exc:   # noqa: BLE001 (agreed below, then every rank goes stock)
            why = f"checking the GPU raised {type(exc).__name__}: {exc}"
        why = agreed_reason(self.tp.gather_object, self.tp.rank, self.world_size, why)
        if why is not None:
            self.engine_cls = None
            return self._disable(why)
        try:
            self.weights = weights_from_vllm(model, self.config, self.tp)    # (failures agreed inside)
        except (ValueError, AttributeError) as exc:
            self.engine_cls = None
            return self._disable(f"weights not understood: {exc}")
        why = None
        try:
            self.packed = self._pack()
        except Exception as exc:   # noqa: BLE001 (agreed below)
            why = f"packing the weights raised {type(exc).__name__}: {exc}"
        why = agreed_reason(self.tp.gather_object, self.tp.rank, self.world_size, why)
        if why is not None:
            self.engine_cls, self.packed = None, None
            return self._disable(why)
        self.norm_weight = self.weights.final_norm
        self.eps = self.config.rms_norm_eps

    def _tp_group(self) -> TPGroup:
        return vllm_tp_group()

    def _runtime_reason(self, device: torch.device) -> str | None:
        """Why this process cannot run the megakernel on `device` (not a CUDA GPU, not sm_90, the runtime does not
        import or lacks the per-layer KV cache API), or None, with the engine class and vLLM's forward context
        functions set."""
        self.device = device
        if device.type != "cuda":
            return f"the model lives on {device}, not a CUDA GPU"
        cap = torch.cuda.get_device_capability(device)
        if cap != KERNEL_CAPABILITY:
            return f"the GPU is sm_{cap[0]}{cap[1]}; the megakernel is built for sm_90a (Hopper)"
        try:
            if self.world_size > 1:
                from megakernel.runtime.tensor_parallel import TensorParallelRank as engine_cls
            else:
                from megakernel.runtime.engine import MegakernelEngine as engine_cls
        except Exception as exc:   # cutlass DSL missing or broken: the stock path still works
            return f"megakernel.runtime does not import: {exc}"
        if not hasattr(engine_cls, "bind_kv_caches"):
            return (f"{engine_cls.__name__} has no bind_kv_caches() (the per-layer KV cache API described in "
                    f"docs/vllm.md)")
        from vllm.forward_context import get_forward_context, is_forward_context_available
        self._fc_get, self._fc_available = get_forward_context, is_forward_context_available
        self.engine_cls = engine_cls
        return None

    def _pack(self):
        """The weights packed once for every bucket's engine (vLLM loads weights under set_default_torch_dtype(model
        dtype): the RoPE tables are float32)."""
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            return pack_weights(self.weights, rope_positions(self.max_seq_len, self.block_size)).to(self.device)
        finally:
            torch.set_default_dtype(old)

    def _bind(self) -> bool:
        """Find vLLM's per-layer KV caches (False until vLLM allocated them) and bind them to every
        engine; again whenever vLLM moved them (sleep / wake-up)."""
        model = self._model()
        attn = self._attn_layers(model)
        first = attn[0].kv_cache
        first = first[0] if isinstance(first, (list, tuple)) else first
        if first.numel() == 0:
            return False
        if self._kv_key is not None and self._kv_key[0] == first.data_ptr():
            return True
        c = self.kv_config
        try:
            pairs = [split_kv_cache(a.kv_cache, c.num_kv_heads, c.head_dim) for a in attn]
            k_list, v_list = [p[0] for p in pairs], [p[1] for p in pairs]
            geom = kv_geometry(k_list, v_list)
        except ValueError as exc:
            self._disable(f"KV cache not understood: {exc}")
            return False
        if (geom.num_kv_heads, geom.head_dim) != (c.num_kv_heads, c.head_dim):
            self._disable(f"KV cache has {geom.num_kv_heads} heads of dim {geom.head_dim}, the model "
                          f"{c.num_kv_heads} of {c.head_dim}")
            return False
        self.kv = (k_list, v_list, geom)
        self._kv_key = (k_list[0].data_ptr(),)
        for eng in self.engines.values():
            eng.bind_kv_caches(k_list, v_list)
        return True

    def _attn_layers(self, model: torch.nn.Module) -> list:
        if not hasattr(self, "_attn"):
            self._attn = [layer.self_attn.attn for layer in model.model.layers]
            self.layer_name = self._attn[0].layer_name
        return self._attn

    def _engine(self, n: int):
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            return None
        eng = self.engines.get(bucket)
        if eng is not None:
            return eng
        if _capturing():
            # vLLM warms every graph size up eagerly before capturing it; no engine means the warm-up
            # fell back, and the capture must do the same.
            _log_once(f"no engine for batch {bucket} at CUDA graph capture")
            return None
        k_list, v_list, geom = self.kv
        # (scratch_block: the padded rows all append to the null block, which the kernel's aliasing check exempts)
        if self.world_size > 1:
            kw = dict(packed_weights=self.packed, kv_caches=(k_list, v_list), lm_head=False, scratch_block=0,
                      gather=self.tp.gather_object, **self.layout_kw)
        else:
            kw = engine_kwargs(self.engine_cls, packed_weights=self.packed, own_kv_cache=False, lm_head=False,
                               scratch_block=0, **self.layout_kw)
        if self.packed is None:
            kw.pop("packed_weights", None)
        elif self.packed.rope_cos.shape[0] < rope_positions(self.max_seq_len, geom.block_size):
            # vLLM's cache blocks are larger than cache_config said at load time: this engine packs its own
            _log_once(f"the KV cache's block size {geom.block_size} is not the {self.block_size} the weights "
                      f"were packed for", consequence="each engine packs its own weights")
            kw.pop("packed_weights", None)
        try:
            if self.world_size > 1:
                # collective (every rank builds this bucket's engine in the same forward, as vLLM runs the same
                # steps on every rank); a failure on any rank raises on every rank, so all of them go stock
                eng = self.engine_cls(self.weights, self.config, self.world_size, self.tp.rank, bucket,
                                      self.max_seq_len, block_size=geom.block_size, device=self.device, **kw)
            else:
                eng = self.engine_cls(self.weights, bucket, self.max_seq_len, block_size=geom.block_size,
                                      device=self.device, **kw)
                eng.bind_kv_caches(k_list, v_list)
            eng.bufs.block_table.zero_()
        except Exception as exc:
            self._disable(f"building the batch-{bucket} engine failed: {type(exc).__name__}: {exc}")
            return None
        self.engines[bucket] = eng
        options = sorted(k for k in kw if k not in ("gather", "kv_caches"))
        STATS["engines"].append({"batch": bucket, "options": options, "kv": asdict(geom),
                                 "rank": self.tp.rank if self.tp else 0})
        logger.info("megakernel: batch-%d engine ready (options: %s; KV cache %s)", bucket,
                    ", ".join(options) or "none", geom)
        return eng

    # -------------------------------------------------------------- hot path
    def maybe_decode(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
        if self.disabled:
            return None
        try:
            return self._decode(input_ids, positions, intermediate_tensors, inputs_embeds)
        except Exception as exc:   # a bug on this path must not take vLLM down: log it, go stock
            logger.exception("megakernel: the decode path raised")
            self._disable(f"the decode path raised {type(exc).__name__}: {exc}")
            if self.world_size > 1:
                # a rank going stock alone would leave its peers' kernels waiting on its exchange signals and join
                # vLLM's collectives its peers never start: the step fails instead
                raise
            return None

    def _decode(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any,
                inputs_embeds: torch.Tensor | None) -> torch.Tensor | None:
        if not self.prepared and not _capturing():
            self.on_weights_loaded()   # weights that did not come through load_weights (dummy weights)
        if self.engine_cls is None:
            return None
        if not self._fc_available():
            return None
        all_md = self._fc_get().attn_metadata
        if not all_md or input_ids is None and inputs_embeds is None:
            return None   # profiling and dummy runs without attention
        model = self._model()
        self._attn_layers(model)
        if isinstance(all_md, list):
            return self._fallback("micro-batched forward (dual-batch overlap)")
        md = all_md.get(self.layer_name) if isinstance(all_md, dict) else all_md
        if md is None:
            return None
        block_table = getattr(md, "block_table", None)
        if block_table is None:
            block_table = getattr(md, "block_table_tensor", None)
        slot_mapping = getattr(md, "slot_mapping", None)
        max_query_len = getattr(md, "max_query_len", None)
        if block_table is None or slot_mapping is None or max_query_len is None:
            return self._fallback(f"attention metadata {type(md).__name__} has no block_table / "
                                  f"slot_mapping / max_query_len")
        n = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        why = batch_reason(n, block_table.shape[0], int(max_query_len), has_embeds=inputs_embeds is not None,
                           has_intermediate=intermediate_tensors is not None, max_batch=self.max_batch)
        if why is not None:
            return None if why == QUERY_LEN else self._fallback(why)
        if not self._bind():
            return None
        eng = self._engine(n)
        if eng is None:
            return None
        b = eng.bufs
        stage_decode_inputs(b.tokens, b.positions, b.block_table, input_ids, positions, slot_mapping,
                            block_table)
        eng.launch()
        if _capturing():
            STATS["captured"].append(n)
        else:
            STATS["eager_steps"] += 1
            if self.check:
                eng.check()
        return final_hidden(b.x[-1][:n], self.norm_weight, self.eps, self.dtype)

    def _fallback(self, why: str) -> None:
        STATS["fallbacks"][why] += 1
        _log_once(why)
        return None

    def describe(self) -> dict[str, Any]:
        kv = asdict(self.kv[2]) if self.kv else None
        return {"switch": self.switch, "disabled": self.disabled, "buckets": list(self.buckets),
                "max_batch": self.max_batch, "tensor_parallel": {"rank": self.tp.rank if self.tp else 0,
                                                                  "world_size": self.world_size},
                "engines": sorted(self.engines), "packed_once": self.packed is not None, "kv": kv,
                "max_seq_len": self.max_seq_len}

    def check_flags(self) -> None:
        """Once per step, without a device sync: if an engine's kernel reported an error (its flag in mapped
        host memory, MegakernelEngine.error_flag), disable the decode path and raise the kernel's error, so
        vLLM's step fails with it instead of sampling from hidden states the kernel did not write. (Captured
        CUDA graphs keep their launches, which then run no instruction: the step cannot go on silently.)"""
        for eng in self.engines.values():
            code = eng.error_flag()
            if code is None:
                continue
            try:
                eng.check()          # the device word: the error's details (one sync, on the error path only)
            except Exception as exc:   # noqa: BLE001 (MegakernelError, or a CUDA error)
                err: Exception = exc
            else:
                err = RuntimeError(f"megakernel: error code {code} in the host flag, not on the device")
            self._disable(f"the kernel reported an error: {err}")
            raise err

    def check_engines(self) -> None:
        """Raise MegakernelError if any engine's error word is set (syncs the device)."""
        for eng in self.engines.values():
            eng.check()


def vllm_tp_group() -> TPGroup:
    """This process's rank in vLLM's tensor-parallel group (vllm.distributed.parallel_state.get_tp_group(): a
    GroupCoordinator) with its collectives: objects through torch.distributed.all_gather_object over the group's
    CPU (gloo) group, tensors through the coordinator's all_gather over its device group."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return TPGroup(rank=group.rank_in_group, world_size=group.world_size,
                   gather_object=process_group_gather(group.cpu_group),
                   gather_rows=lambda t: group.all_gather(t, dim=0))


def check_all() -> list[dict[str, Any]]:
    """Check every engine of every live adapter in this process; return their descriptions."""
    out = []
    for adapter in list(_ADAPTERS):
        adapter.check_engines()
        out.append(adapter.describe())
    return out


def report(worker: Any = None) -> dict[str, Any]:
    """What the megakernel path did in this process, as plain data, with every engine's error word
    checked (kernel_error: None, or what the check raised). `worker` is ignored: vLLM's
    ``LLM.collective_rpc(report)`` runs this in the process that holds the model, which with vLLM's
    default engine process is not the caller's (callables need VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    stats = dict(STATS)
    stats["fallbacks"] = dict(STATS["fallbacks"])
    stats["captured"] = list(STATS["captured"])
    stats["engines"] = list(STATS["engines"])
    stats["pid"] = os.getpid()
    try:
        stats["adapters"] = check_all()
        stats["kernel_error"] = None
    except Exception as exc:   # noqa: BLE001 (MegakernelError, or a CUDA error)
        stats["kernel_error"] = f"{type(exc).__name__}: {exc}"
    return stats


# ------------------------------------------------------------------------------------------------
# The vLLM classes
# ------------------------------------------------------------------------------------------------

class MegakernelDecodeMixin:
    """Put before a vLLM ForCausalLM class: decode batches through the megakernel, the rest stock."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        # not an nn.Module attribute: its tensors stay out of the state dict
        object.__setattr__(self, "megakernel", MegakernelDecode(self, vllm_config))

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        self.megakernel.on_weights_loaded()
        return loaded

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        hidden = self.megakernel.maybe_decode(input_ids, positions, intermediate_tensors, inputs_embeds)
        if hidden is not None:
            return hidden
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def compute_logits(self, hidden_states, *args, **kwargs):
        # every step runs this eagerly, CUDA-graph replays too: where the kernel's error flag is read
        self.megakernel.check_flags()
        return super().compute_logits(hidden_states, *args, **kwargs)


try:
    from vllm.model_executor.models.llama import LlamaForCausalLM as _VllmLlamaForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM as _VllmQwen3ForCausalLM
except ImportError as _exc:   # vLLM absent: the functions above still work
    VLLM_IMPORT_ERROR: ImportError | None = _exc
else:
    VLLM_IMPORT_ERROR = None

    class MegakernelLlamaForCausalLM(MegakernelDecodeMixin, _VllmLlamaForCausalLM):
        """vLLM's LlamaForCausalLM with megakernel decode."""

    class MegakernelQwen3ForCausalLM(MegakernelDecodeMixin, _VllmQwen3ForCausalLM):
        """vLLM's Qwen3ForCausalLM with megakernel decode."""
