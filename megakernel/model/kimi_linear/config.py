"""Kimi Linear model description: KDA (Kimi Delta Attention) layers interleaved with NoPE MLA layers,
MoE MLP layers with shared experts after the first dense ones.

`KimiLinearConfig` is read from a Hugging Face config.json of `KimiLinearForCausalLM` (model_type
`kimi_linear`) exactly as transformers' `KimiLinearConfig` (5.x) interprets it:

* names: transformers stores several fields under another name (its `attribute_map`): the experts
  count is `num_experts` (alias `num_local_experts`), top-k `num_experts_per_token` (alias
  `num_experts_per_tok`), `num_shared_experts` (`n_shared_experts`), `moe_renormalize`
  (`norm_topk_prob`), `num_expert_group` (`n_group`), `model_max_length` (`max_position_embeddings`).
  When both spellings are in one dict the stored name wins (it is assigned last). `n_routed_experts`
  (DeepSeek's name) is *not* read by transformers, so it is rejected when it disagrees.
* layer kinds: `layer_types` when given (legacy "attention"/"mamba" remapped), else the 1-based
  `linear_attn_config.kda_layers` / `full_attn_layers` when *both* lists are present, else
  transformers' default pattern (layer i is MLA when i > 0 and i % 4 == 0).
* `linear_attn_config.{head_dim, num_heads, short_conv_kernel_size}` override the top-level
  `linear_head_dim`, `linear_num_heads`, `linear_conv_kernel_dim`.
* MLP kinds: `mlp_layer_types` when given, else "dense" for i < `first_k_dense_replace` (default 1)
  and "sparse" after.
* the MLA layers use no rotary embedding at all (NoPE): the `qk_rope_head_dim` part of the key is
  still a shared, cached, but unrotated key; the softmax scale is (nope + rope) ** -0.5.
* the latent norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever `rms_norm_eps` says; the
  KDA output norm uses `rms_norm_eps`.
* the short convolution's activation is `hidden_act` (silu).
* `tie_word_embeddings` is not honoured by transformers (KimiLinearForCausalLM ties nothing), so it is
  rejected rather than silently ignored.

Anything the project cannot run raises ValueError naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..deepseek.config import check_routing

ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_TYPE = "kimi_linear"
KDA = "linear_attention"
MLA = "full_attention"
LAYER_TYPES = (KDA, MLA)
DENSE = "dense"
SPARSE = "sparse"
MLP_LAYER_TYPES = (DENSE, SPARSE)
# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# transformers' l2norm of q and k in KDA: x / sqrt(sum(x^2) + eps)
L2NORM_EPS = 1e-6
# the KDA key/value head dim must be a multiple of this (the decode kernel's tile)
KDA_HEAD_DIM_MULTIPLE = 16
_LEGACY_LAYER_TYPES = {"mamba": KDA, "attention": MLA}

# transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B's shapes)
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 163839,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_local_experts": 256,
    "mlp_layer_types": None,
    "layer_types": None,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}
# field name -> the name transformers stores it under (KimiLinearConfig.attribute_map)
HF_ATTRIBUTE_MAP = {
    "max_position_embeddings": "model_max_length",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True)
class KimiLinearConfig:
    # shapes
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int  # FFN width of the dense layers
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) or "full_attention" (MLA)
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse" (MoE)
    # MLA (NoPE)
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the shared (unrotated) key part of the latent
    v_head_dim: int
    # KDA
    linear_num_heads: int
    linear_head_dim: int  # dk == dv
    linear_conv_kernel_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # norms / misc
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    architecture: str = ARCHITECTURE
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        for f in ("hidden_size", "num_layers", "vocab_size", "intermediate_size", "num_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_num_heads", "linear_head_dim",
                  "linear_conv_kernel_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "n_group", "topk_group", "max_position_embeddings"):
            _positive(f, getattr(self, f))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_layers}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types contains {bad[0]!r}: only {LAYER_TYPES} are supported")
        if len(self.mlp_layer_types) != self.num_layers:
            raise ValueError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers={self.num_layers}"
            )
        bad = [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        if bad:
            raise ValueError(f"mlp_layer_types contains {bad[0]!r}: only {MLP_LAYER_TYPES} are supported")
        if self.linear_head_dim % KDA_HEAD_DIM_MULTIPLE:
            raise ValueError(
                f"linear_head_dim={self.linear_head_dim} (linear_attn_config.head_dim) must be a multiple of "
                f"{KDA_HEAD_DIM_MULTIPLE}"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(
                f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} (linear_attn_config.short_conv_kernel_size) "
                "must be >= 2"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts!r} must be >= 0")
        check_routing(self)
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if self.architecture != ARCHITECTURE:
            raise ValueError(f"architecture={self.architecture!r} is not {ARCHITECTURE!r}")

    # ---- per-layer kinds ------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside [0, {self.num_layers})")

    def is_kda_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.layer_types[layer] == KDA

    def is_mla_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.layer_types[layer] == MLA

    def is_moe_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.mlp_layer_types[layer] == SPARSE

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based indices of the MLA layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(t == SPARSE for t in self.mlp_layer_types)

    # ---- MLA sizes ------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.qk_head_dim

    @property
    def kv_a_rows(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's MLA cache row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def o_proj_cols(self) -> int:
        return self.num_heads * self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** (-0.5)

    # ---- KDA sizes ------------------------------------------------------------------------------
    @property
    def kda_dim(self) -> int:
        """linear_num_heads * linear_head_dim: width of each of q, k, v (and of the forget gate)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v concatenated."""
        return 3 * self.kda_dim

    @property
    def conv_state_len(self) -> int:
        """Inputs the convolution keeps per sequence between steps: kernel - 1."""
        return self.linear_conv_kernel_dim - 1

    # ---- MoE sizes ------------------------------------------------------------------------------
    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    # ---- parameter counts (elements) ----------------------------------------------------------
    @property
    def mla_params(self) -> int:
        h = self.hidden_size
        n = self.q_size * h if self.q_lora_rank is None else (
            self.q_lora_rank * h + self.q_lora_rank + self.q_size * self.q_lora_rank)
        n += self.kv_a_rows * h + self.kv_lora_rank
        n += self.num_heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
        return n + h * self.o_proj_cols

    @property
    def kda_params(self) -> int:
        h, d, dk, nh = self.hidden_size, self.kda_dim, self.linear_head_dim, self.linear_num_heads
        n = 3 * d * h + self.conv_dim * self.linear_conv_kernel_dim  # q/k/v proj + conv
        n += dk * h + d * dk + d + nh  # forget gate: f_a, f_b, dt_bias, A_log
        n += nh * h  # b_proj
        n += dk * h + d * dk + dk  # g_a, g_b, o_norm
        return n + h * d  # o_proj

    def layer_params(self, layer: int) -> int:
        h = self.hidden_size
        n = 2 * h + (self.kda_params if self.is_kda_layer(layer) else self.mla_params)
        if self.is_moe_layer(layer):
            e = 3 * h * self.moe_intermediate_size
            n += self.n_routed_experts * (h + 1) + 3 * h * self.shared_intermediate_size + self.n_routed_experts * e
        else:
            n += 3 * h * self.intermediate_size
        return n

    @property
    def total_params(self) -> int:
        return 2 * self.vocab_size * self.hidden_size + self.hidden_size + sum(
            self.layer_params(i) for i in range(self.num_layers))

    # ---- HF config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: str = "custom") -> "KimiLinearConfig":
        """Build from a config.json dict or a transformers config (through its to_dict()), as the dense and
        DeepSeek families' configs do."""
        if not isinstance(cfg, dict):
            to_dict = getattr(cfg, "to_dict", None)
            if to_dict is None:
                raise ValueError(f"config of type {type(cfg).__name__} is neither a dict nor a PretrainedConfig")
            cfg = to_dict()
        return cls(name=name, **_parse_hf(cfg))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None) -> "KimiLinearConfig":
        with open(os.path.join(os.fspath(path), "config.json")) as fh:
            d = json.load(fh)
        return cls.from_hf_config(d, name=name or os.path.basename(os.path.normpath(os.fspath(path))))

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers' KimiLinearConfig reads back to this config (the
        checkpoint's own names: linear_attn_config with 1-based layer lists, num_experts, ...)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.linear_num_heads,
                "head_dim": self.linear_head_dim,
                "short_conv_kernel_size": self.linear_conv_kernel_dim,
            },
            "mlp_layer_types": list(self.mlp_layer_types),
            "num_experts": self.n_routed_experts,
            "num_experts_per_token": self.num_experts_per_tok,
            "num_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "moe_renormalize": self.norm_topk_prob,
            "moe_router_activation_func": "sigmoid",
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "model_max_length": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    def summary(self) -> dict:
        return asdict(self)


# ---- config.json parsing -----------------------------------------------------------------------

_MISSING = object()


def _get(d: dict, key: str) -> Any:
    """A field as transformers' KimiLinearConfig resolves it: its stored name (attribute_map) wins over
    the field name, then transformers' default."""
    stored = HF_ATTRIBUTE_MAP.get(key)
    if stored is not None and stored in d:
        return d[stored]
    if key in d:
        return d[key]
    return HF_DEFAULTS[key]


def _given(d: dict, key: str) -> bool:
    stored = HF_ATTRIBUTE_MAP.get(key)
    return key in d or (stored is not None and stored in d)


def _layer_list(lac: dict, key: str, num_layers: int) -> list[int]:
    v = lac[key]
    if not isinstance(v, (list, tuple)) or any(not isinstance(i, int) or isinstance(i, bool) for i in v):
        raise ValueError(f"linear_attn_config.{key}={v!r} must be a list of 1-based layer numbers")
    bad = [i for i in v if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"linear_attn_config.{key} contains {bad[0]} outside [1, {num_layers}] (layers are 1-based)"
        )
    if len(set(v)) != len(v):
        raise ValueError(f"linear_attn_config.{key}={list(v)!r} repeats a layer")
    return list(v)


def _parse_layer_types(d: dict, num_layers: int) -> list[str]:
    lac = d.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ValueError(f"linear_attn_config={lac!r} must be a dict")
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, (list, tuple)):
            raise ValueError(f"layer_types={lt!r} must be a list")
        return [_LEGACY_LAYER_TYPES.get(t, t) for t in lt]
    has_kda, has_full = "kda_layers" in lac, "full_attn_layers" in lac
    if has_kda != has_full:
        # transformers ignores a lone list and falls back to its default pattern
        missing = "full_attn_layers" if has_kda else "kda_layers"
        raise ValueError(
            f"linear_attn_config.{missing} is missing while the other layer list is given: transformers would "
            "ignore both and use its default layer pattern"
        )
    if not has_kda:
        return [MLA if i and i % 4 == 0 else KDA for i in range(num_layers)]
    kda = _layer_list(lac, "kda_layers", num_layers)
    full = _layer_list(lac, "full_attn_layers", num_layers)
    both = sorted(set(kda) & set(full))
    if both:
        raise ValueError(f"linear_attn_config: layer {both[0]} is in both kda_layers and full_attn_layers")
    unset = sorted(set(range(1, num_layers + 1)) - set(kda) - set(full))
    if unset:
        raise ValueError(
            f"linear_attn_config: layer {unset[0]} is in neither kda_layers nor full_attn_layers"
        )
    types = [""] * num_layers
    for i in full:
        types[i - 1] = MLA
    for i in kda:
        types[i - 1] = KDA
    return types


def _parse_hf(d: dict) -> dict:
    archs = d.get("architectures")
    if archs and ARCHITECTURE not in archs:
        raise ValueError(f"architectures={archs!r} does not contain {ARCHITECTURE!r}")
    model_type = d.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ValueError(f"model_type={model_type!r} is not {MODEL_TYPE!r}")
    if d.get("quantization_config"):
        qc = d["quantization_config"]
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: use a bf16/fp32 checkpoint")
    act = _get(d, "hidden_act")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if _get(d, "attention_bias"):
        raise ValueError(f"attention_bias={_get(d, 'attention_bias')!r} is not supported")
    if _get(d, "tie_word_embeddings"):
        raise ValueError(
            "tie_word_embeddings=True is not supported: transformers' KimiLinearForCausalLM ties nothing "
            "(it keeps a separate lm_head)"
        )
    if d.get("mla_use_nope") is False:
        raise ValueError("mla_use_nope=False (MLA with RoPE) is not supported: transformers' Kimi Linear MLA is NoPE")
    for key in ("rope_scaling", "rope_parameters"):
        if d.get(key):
            raise ValueError(f"{key}={d[key]!r} is not supported: Kimi Linear's MLA layers use no rotary embedding")
    router_act = d.get("moe_router_activation_func")
    if router_act not in (None, "sigmoid"):
        raise ValueError(
            f"moe_router_activation_func={router_act!r} is not supported (transformers routes with sigmoid)"
        )
    if d.get("moe_layer_freq") not in (None, 1):
        raise ValueError(
            f"moe_layer_freq={d['moe_layer_freq']!r} is not supported: transformers derives MoE layers from "
            "first_k_dense_replace / mlp_layer_types only, which is moe_layer_freq 1"
        )
    if d.get("num_nextn_predict_layers"):
        raise ValueError(f"num_nextn_predict_layers={d['num_nextn_predict_layers']!r} (MTP) is not supported")

    num_layers = _get(d, "num_hidden_layers")
    _positive("num_hidden_layers", num_layers)
    heads = _get(d, "num_attention_heads")
    kv_heads = _get(d, "num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads!r} must equal num_attention_heads={heads} for MLA")

    lac = d.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ValueError(f"linear_attn_config={lac!r} must be a dict")
    layer_types = _parse_layer_types(d, num_layers)
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = d.get("first_k_dense_replace", 1)
        if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
            raise ValueError(f"first_k_dense_replace={first_dense!r} must be an int >= 0")
        mlp_types = [DENSE if i < first_dense else SPARSE for i in range(num_layers)]
    elif not isinstance(mlp_types, (list, tuple)):
        raise ValueError(f"mlp_layer_types={mlp_types!r} must be a list")
    if SPARSE in mlp_types:
        # transformers would fall back to the 48B model's 256 experts / top-8: for a custom config that is
        # almost surely a forgotten field, so the project asks for them
        for key in ("num_local_experts", "num_experts_per_tok"):
            if not _given(d, key) or _get(d, key) is None:
                raise ValueError(
                    f"{HF_ATTRIBUTE_MAP[key]} (or {key}) is required when a layer is MoE (mlp_layer_types "
                    f"'{SPARSE}'); transformers would silently take {HF_DEFAULTS[key]}"
                )
    n_experts = _get(d, "num_local_experts")
    if "n_routed_experts" in d and d["n_routed_experts"] != n_experts:
        raise ValueError(
            f"n_routed_experts={d['n_routed_experts']!r} is not read by transformers' KimiLinearConfig (it reads "
            f"num_experts, here {n_experts}): rename the field"
        )
    topk_group = _get(d, "topk_group")
    if topk_group is None:
        raise ValueError("topk_group=None is not supported: transformers' router needs an int (torch.topk k)")
    eos = _get(d, "eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    return dict(
        hidden_size=_get(d, "hidden_size"),
        num_layers=num_layers,
        vocab_size=_get(d, "vocab_size"),
        intermediate_size=_get(d, "intermediate_size"),
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        num_heads=heads,
        q_lora_rank=_get(d, "q_lora_rank"),
        kv_lora_rank=_get(d, "kv_lora_rank"),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(d, "qk_rope_head_dim"),
        v_head_dim=_get(d, "v_head_dim"),
        linear_num_heads=lac.get("num_heads", _get(d, "linear_num_heads")),
        linear_head_dim=lac.get("head_dim", _get(d, "linear_head_dim")),
        linear_conv_kernel_dim=lac.get("short_conv_kernel_size", _get(d, "linear_conv_kernel_dim")),
        n_routed_experts=n_experts,
        num_experts_per_tok=_get(d, "num_experts_per_tok"),
        n_shared_experts=_get(d, "n_shared_experts"),
        moe_intermediate_size=_get(d, "moe_intermediate_size"),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor")),
        n_group=_get(d, "n_group"),
        topk_group=topk_group,
        norm_topk_prob=bool(_get(d, "norm_topk_prob")),
        rms_norm_eps=float(_get(d, "rms_norm_eps")),
        max_position_embeddings=_get(d, "max_position_embeddings"),
        pad_token_id=_get(d, "pad_token_id"),
        bos_token_id=_get(d, "bos_token_id"),
        eos_token_id=eos,
    )
