"""DeepSeek-V3 / Kimi-K2 model description: MLA attention + sigmoid-routed MoE.

`DeepseekConfig` is read from a Hugging Face config.json of `DeepseekV3ForCausalLM` (model_type
`deepseek_v3`, or `kimi_k2` which is the same architecture under another name). It knows nothing of
kernels. The semantics follow transformers' `DeepseekV3ForCausalLM` (>= 4.56), which is what the
reference decoder is proven against:

* a layer is MoE when `layer >= first_k_dense_replace` (transformers ignores `moe_layer_freq`, so
  only `moe_layer_freq == 1`, where both definitions agree, is accepted);
* routing: sigmoid scores, `e_score_correction_bias` added for the choice only, group-limited top-k
  (group score = sum of the group's top-2 biased scores), optional renormalisation, then
  `routed_scaling_factor` (the `noaux_tc` method; transformers implements no other);
* the latent norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever `rms_norm_eps` says;
* YaRN: cos/sin are multiplied by `rope_attention_factor`, the softmax scale by
  `yarn_mscale(factor, mscale_all_dim) ** 2` (DeepSeek's definition).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURE = "DeepseekV3ForCausalLM"
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as config.json writes it (`rope_scaling` / `rope_parameters`, type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor or self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor!r}: YaRN needs factor >= 1")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings!r} must be > 0"
            )

    def to_hf(self) -> dict:
        out: dict[str, Any] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": float(self.factor),
            "original_max_position_embeddings": int(self.original_max_position_embeddings),
            "beta_fast": float(self.beta_fast),
            "beta_slow": float(self.beta_slow),
        }
        if self.mscale is not None:
            out["mscale"] = float(self.mscale)
        if self.mscale_all_dim is not None:
            out["mscale_all_dim"] = float(self.mscale_all_dim)
        if self.attention_factor is not None:
            out["attention_factor"] = float(self.attention_factor)
        if not self.truncate:
            out["truncate"] = False
        return out


def check_routing(c) -> None:
    """ValueError naming the field for a routed-expert setup the MoE stages cannot run: more experts per token
    than experts, groups that do not divide the experts or hold fewer than 2, more groups kept than there are,
    kept groups with fewer experts than a token takes, a scaling factor <= 0. (DeepSeek-V3 / Kimi-K2 and Kimi
    Linear share the router: sigmoid scores, group-limited top-k.)"""
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_routed_experts % c.n_group:
        raise ValueError(f"n_group={c.n_group} must divide n_routed_experts={c.n_routed_experts}")
    if c.n_routed_experts // c.n_group < 2:
        raise ValueError(f"n_group={c.n_group}: a group needs >= 2 experts (group score = sum of its top 2)")
    if c.topk_group > c.n_group:
        raise ValueError(f"topk_group={c.topk_group} exceeds n_group={c.n_group}")
    if c.topk_group * c.experts_per_group < c.num_experts_per_tok:
        raise ValueError(f"topk_group={c.topk_group} leaves {c.topk_group * c.experts_per_group} experts, fewer than "
                         f"num_experts_per_tok={c.num_experts_per_tok}")
    if c.routed_scaling_factor <= 0:
        raise ValueError(f"routed_scaling_factor={c.routed_scaling_factor!r} must be > 0")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True)
class DeepseekConfig:
    # shapes
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    intermediate_size: int  # FFN width of the dense (first_k_dense_replace) layers
    # MLA
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (Moonlight, DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    moe_layer_freq: int = 1
    # rope / norms
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True  # checkpoint stores rope dims as interleaved pairs (transformers' default)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str = field(default="deepseek_v3", compare=False)  # same architecture under either name
    architecture: str = ARCHITECTURE
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "vocab_size", "intermediate_size", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group", "max_position_embeddings"):
            _positive(f, getattr(self, f))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts!r} must be >= 0")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace!r} must lie in [0, num_layers]")
        if self.scoring_func != "sigmoid":
            raise ValueError(
                f"scoring_func={self.scoring_func!r} is not supported: DeepseekV3ForCausalLM routes with sigmoid only"
            )
        if self.moe_layer_freq != 1:
            raise ValueError(
                f"moe_layer_freq={self.moe_layer_freq!r} is not supported: transformers makes every layer "
                "from first_k_dense_replace on an MoE layer, which is moe_layer_freq 1"
            )
        check_routing(self)
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if self.architecture != ARCHITECTURE:
            raise ValueError(f"architecture={self.architecture!r} is not {ARCHITECTURE!r}")

    # ---- per-head / per-layer sizes -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_size(self) -> int:
        """Rows of the full query projection: heads * (nope + rope)."""
        return self.num_heads * self.qk_head_dim

    @property
    def q_a_rows(self) -> int:
        """Rows of the query part of `qkv_a`: q_lora_rank, or the whole query when there is no q LoRA."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.q_size

    @property
    def kv_a_rows(self) -> int:
        """Rows of kv_a_proj_with_mqa: latent (kv_lora_rank) then the shared rope key (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qkv_a_rows(self) -> int:
        """Rows of the fused projection of the normed hidden state: query part then kv_a."""
        return self.q_a_rows + self.kv_a_rows

    @property
    def latent_dim(self) -> int:
        """Width of one token's latent KV cache entry: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def o_proj_cols(self) -> int:
        return self.num_heads * self.v_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def shared_intermediate_size(self) -> int:
        """FFN width of the shared expert MLP (transformers fuses the shared experts into one MLP)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside [0, {self.num_layers})")
        return layer >= self.first_k_dense_replace

    # ---- parameter counts (elements) -----------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """Weights of one MLA block incl. its input norm and latent norms."""
        h = self.hidden_size
        n = h  # input_layernorm
        n += self.qkv_a_rows * h
        if self.q_lora_rank is not None:
            n += self.q_lora_rank + self.q_size * self.q_lora_rank  # q_a_layernorm + q_b_proj
        n += self.kv_lora_rank  # kv_a_layernorm
        n += self.num_heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank  # kv_b_proj
        n += h * self.o_proj_cols
        return n

    @property
    def dense_mlp_params(self) -> int:
        """gate + up + down of one dense layer (its norm not included)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """gate + up + down of one routed expert."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def router_params(self) -> int:
        """Router weight [E, H] plus e_score_correction_bias [E]."""
        return self.n_routed_experts * (self.hidden_size + 1)

    def layer_params(self, layer: int) -> int:
        n = self.attention_params + self.hidden_size  # + post_attention_layernorm
        if self.is_moe_layer(layer):
            n += self.router_params + self.shared_expert_params + self.n_routed_experts * self.expert_params
        else:
            n += self.dense_mlp_params
        return n

    def active_layer_params(self, layer: int) -> int:
        """Weights one token reads in a layer: only its top-k routed experts."""
        n = self.attention_params + self.hidden_size
        if self.is_moe_layer(layer):
            n += self.router_params + self.shared_expert_params + self.num_experts_per_tok * self.expert_params
        else:
            n += self.dense_mlp_params
        return n

    @property
    def total_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else emb
        return emb + lm_head + self.hidden_size + sum(self.layer_params(i) for i in range(self.num_layers))

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights (every expert), every tensor at dtype_bytes."""
        return self.total_params * dtype_bytes

    # ---- rope / softmax scale ------------------------------------------------------------------
    @property
    def rope_attention_factor(self) -> float:
        """Multiplier transformers applies to cos and sin (YaRN's attention factor)."""
        ys = self.rope_scaling
        if ys is None:
            return 1.0
        if ys.attention_factor is not None:
            return float(ys.attention_factor)
        if ys.mscale and ys.mscale_all_dim:
            return float(yarn_mscale(ys.factor, ys.mscale) / yarn_mscale(ys.factor, ys.mscale_all_dim))
        return yarn_mscale(ys.factor)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 under YaRN."""
        scale = self.qk_head_dim ** (-0.5)
        ys = self.rope_scaling
        if ys is not None and ys.mscale_all_dim:
            m = yarn_mscale(ys.factor, ys.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: str = "custom") -> "DeepseekConfig":
        """Build from a config.json dict or a transformers PretrainedConfig (>= 4.56 or 5.x field names)."""
        if not isinstance(cfg, dict):
            to_dict = getattr(cfg, "to_dict", None)
            if to_dict is None:
                raise ValueError(f"config of type {type(cfg).__name__} is neither a dict nor a PretrainedConfig")
            cfg = to_dict()
        return cls(name=name, **_parse_hf(cfg))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None) -> "DeepseekConfig":
        with open(os.path.join(os.fspath(path), "config.json")) as fh:
            cfg = json.load(fh)
        return cls.from_hf_config(cfg, name=name or os.path.basename(os.path.normpath(os.fspath(path))))

    def to_hf_config(self) -> dict:
        """A config.json dict that DeepseekV3Config accepts on transformers 4.56 and 5.x.

        Rope is written in the legacy `rope_theta` + `rope_scaling` form that both versions read;
        model_type is always `deepseek_v3` so that transformers loads it without remote code.
        """
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.n_routed_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "num_experts_per_tok": self.num_experts_per_tok,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rope_interleave": self.rope_interleave,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    def summary(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = None if self.rope_scaling is None else asdict(self.rope_scaling)
        return d


# ---- config.json parsing ---------------------------------------------------------------------------

def _require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config field {key}={cfg.get(key)!r} is required for {ARCHITECTURE}")
    return cfg[key]


def _parse_rope(cfg: dict) -> tuple[float, YarnScaling | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and not any(isinstance(v, dict) for v in params.values()):
        scaling: dict | None = params
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    elif params:
        raise ValueError(f"rope_parameters={params!r}: per-layer-type rope parameters are not supported")
    else:
        scaling = cfg.get("rope_scaling")
        theta = cfg.get("rope_theta", 10000.0)
    if theta is None:
        theta = 10000.0
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported (only 'default' and 'yarn')")
    if scaling.get("factor") is None:
        raise ValueError("rope_scaling.factor=None is not supported: give the YaRN factor explicitly")
    # rope_scaling's own first, then a top-level one, then max_position_embeddings: what transformers' parse of
    # the same config.json holds (tests/unit/test_deepseek_config.py checks it)
    orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if orig is None:
        orig = cfg.get("max_position_embeddings")
    for key in ("partial_rotary_factor", "short_factor", "long_factor"):
        if scaling.get(key) not in (None, 1.0):
            raise ValueError(f"rope_scaling.{key}={scaling.get(key)!r} is not supported")
    ys = YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(orig),
        # transformers falls back to 32 / 1 when these are missing or 0 (`or`)
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=None if scaling.get("mscale") is None else float(scaling["mscale"]),
        mscale_all_dim=None if scaling.get("mscale_all_dim") is None else float(scaling["mscale_all_dim"]),
        attention_factor=None if scaling.get("attention_factor") is None else float(scaling["attention_factor"]),
        truncate=bool(scaling.get("truncate", True)),
    )
    return float(theta), ys


def _hf_default(cfg: dict, key: str):
    """cfg[key], or, where config.json leaves it out, the default transformers' DeepseekV3Config gives it
    (Kimi-K2's model_type reads the same class): a missing field never means something else here."""
    if key in cfg:
        return cfg[key]
    from transformers import DeepseekV3Config
    return getattr(DeepseekV3Config(), key)


def _parse_hf(cfg: dict) -> dict:
    archs = cfg.get("architectures")
    if archs and ARCHITECTURE not in archs:
        raise ValueError(f"architectures={archs!r} does not contain {ARCHITECTURE!r}")
    model_type = cfg.get("model_type", "deepseek_v3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if cfg.get("quantization_config"):
        qc = cfg["quantization_config"]
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: use a bf16/fp32 checkpoint")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("attention_bias"):
        raise ValueError(f"attention_bias={cfg['attention_bias']!r} is not supported")
    topk_method = cfg.get("topk_method")
    if topk_method not in (None, "noaux_tc"):
        raise ValueError(
            f"topk_method={topk_method!r} is not supported: DeepseekV3ForCausalLM implements only 'noaux_tc'"
        )
    heads = _require(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads!r} must equal num_attention_heads={heads} for MLA")
    if cfg.get("n_routed_experts") is None:
        raise ValueError("n_routed_experts=None (a model without MoE) is not supported")
    rope_theta, rope_scaling = _parse_rope(cfg)
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    return dict(
        hidden_size=_require(cfg, "hidden_size"),
        num_layers=_require(cfg, "num_hidden_layers"),
        num_heads=heads,
        vocab_size=_require(cfg, "vocab_size"),
        intermediate_size=_require(cfg, "intermediate_size"),
        q_lora_rank=_hf_default(cfg, "q_lora_rank"),
        kv_lora_rank=_require(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_require(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_require(cfg, "qk_rope_head_dim"),
        v_head_dim=_require(cfg, "v_head_dim"),
        n_routed_experts=cfg["n_routed_experts"],
        num_experts_per_tok=_require(cfg, "num_experts_per_tok"),
        n_shared_experts=_hf_default(cfg, "n_shared_experts") or 0,
        moe_intermediate_size=_require(cfg, "moe_intermediate_size"),
        first_k_dense_replace=_hf_default(cfg, "first_k_dense_replace") or 0,
        routed_scaling_factor=float(_hf_default(cfg, "routed_scaling_factor")),
        n_group=_hf_default(cfg, "n_group") or 1,
        topk_group=_hf_default(cfg, "topk_group") or 1,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        scoring_func=cfg.get("scoring_func") or "sigmoid",
        moe_layer_freq=cfg.get("moe_layer_freq") or 1,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_require(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        model_type=model_type,
    )
