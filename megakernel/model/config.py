"""Model description: the shape of a Llama / Qwen3 decoder, read from a Hugging Face config.json.

Only what the decode megakernel supports is accepted; anything else raises ``ValueError`` naming the
config field and its value, so an unsupported checkpoint fails at load time, not as wrong tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ARCH_TO_MODEL_TYPE = {arch: mt for mt, arch in _MODEL_TYPE_TO_ARCH.items()}
# transformers' own defaults for fields a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen3ForCausalLM": 32768}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``linear`` divides every frequency by ``factor``; ``llama3`` divides
    only the low frequencies and blends the middle band (the Llama 3.1 recipe)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor={self.factor!r} must be > 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor!r} must exceed "
                f"low_freq_factor={self.low_freq_factor!r}"
            )

    def to_hf(self) -> dict[str, Any]:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": float(self.factor)}
        if self.rope_type == "llama3":
            return {
                "rope_type": "llama3",
                "factor": float(self.factor),
                "low_freq_factor": float(self.low_freq_factor),
                "high_freq_factor": float(self.high_freq_factor),
                "original_max_position_embeddings": int(self.original_max_position_embeddings),
            }
        return {"rope_type": "default"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a dense decoder-only model (Llama family, Qwen3)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    qk_norm: bool
    max_position_embeddings: int
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "default":
            # One spelling for "no scaling", so equal models compare equal.
            object.__setattr__(self, "rope_scaling", None)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer (matrices and norms)."""
        h, f = self.hidden_size, self.intermediate_size
        n = self.qkv_rows * h + h * self.q_size + 2 * f * h + h * f + 2 * h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of weights one decode step reads: every layer, the final norm and the LM head.
        The embedding table is not counted (a step reads one row per sequence); a tied LM head is
        counted once."""
        n = self.num_layers * self.layer_params() + self.hidden_size + self.vocab_size * self.hidden_size
        return n * dtype_bytes

    # ---- Hugging Face interop ------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: str = "custom") -> "ModelConfig":
        """Build from a config.json dict or a ``transformers.PretrainedConfig`` (v4.56+ and v5)."""
        if not isinstance(cfg, dict):
            to_dict = getattr(cfg, "to_dict", None)
            if to_dict is None:
                raise ValueError(f"config of type {type(cfg).__name__} is neither a dict nor a PretrainedConfig")
            cfg = to_dict()
        cfg = dict(cfg)

        architecture = _architecture(cfg)

        def get(key: str, default: Any = None) -> Any:
            value = cfg.get(key, default)
            return default if value is None else value

        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if cfg.get(key) is None:
                raise ValueError(f"{key} is missing from the config")

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{key}={cfg[key]!r} is not supported (projections must have no bias)")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window={cfg['use_sliding_window']!r} is not supported")
        layer_types = cfg.get("layer_types")
        if layer_types:
            other = sorted({t for t in layer_types if t != "full_attention"})
            if other:
                raise ValueError(f"layer_types contains {other!r}; only 'full_attention' is supported")
        prf = cfg.get("partial_rotary_factor")
        if prf is not None and float(prf) != 1.0:
            raise ValueError(f"partial_rotary_factor={prf!r} is not supported (only 1.0)")

        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            # transformers' defaults: Llama derives it, Qwen3Config defaults to 128.
            head_dim = 128 if architecture == "Qwen3ForCausalLM" else hidden // num_heads
        rope_theta, rope_scaling = _rope(cfg)

        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads", num_heads)),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            max_position_embeddings=int(get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture])),
            name=name,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None) -> "ModelConfig":
        """Read ``path/config.json`` (``path`` may also be the json file itself)."""
        path = os.fspath(path)
        file = path if path.endswith(".json") else os.path.join(path, "config.json")
        with open(file) as f:
            cfg = json.load(f)
        return cls.from_hf_config(cfg, name=name or os.path.basename(os.path.normpath(os.path.dirname(file))) or "custom")

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.56+ and 5.x) loads as the same model.
        RoPE uses the legacy ``rope_theta`` / ``rope_scaling`` keys, which both versions accept."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _ARCH_TO_MODEL_TYPE[self.architecture],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": float(self.rope_theta),
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rms_norm_eps": float(self.rms_norm_eps),
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if self.architecture == "LlamaForCausalLM":
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
            d["sliding_window"] = None
            d["max_window_layers"] = self.num_layers
        return d


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if archs:
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures={archs!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"model_type={model_type!r} (architectures={archs!r}) is not supported "
        f"(supported: {SUPPORTED_ARCHITECTURES})"
    )


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either the legacy keys (rope_theta, rope_scaling) or the
    transformers 5 ``rope_parameters`` dict (which carries rope_theta inside)."""
    params = cfg.get("rope_parameters")
    if params is not None and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type parameters: accept only the single full-attention entry.
        if set(params) != {"full_attention"}:
            raise ValueError(f"rope_parameters for layer types {sorted(params)!r} are not supported")
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling")
    src_name = "rope_scaling"
    if scaling is None and params is not None:
        scaling, src_name = params, "rope_parameters"
    theta = cfg.get("rope_theta")
    if theta is None and params is not None:
        theta = params.get("rope_theta")
    if theta is None and scaling is not None:
        theta = scaling.get("rope_theta")
    theta = _DEFAULT_ROPE_THETA if theta is None else float(theta)
    if not scaling:
        return theta, None

    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{src_name}.rope_type={rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if rope_type == "default":
        return theta, None
    factor = scaling.get("factor")
    if factor is None:
        raise ValueError(f"{src_name}.factor is missing for rope_type={rope_type!r}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(factor))
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ValueError(f"{src_name}.{key} is missing for rope_type='llama3'")
    return theta, RopeScaling(
        "llama3",
        factor=float(factor),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
