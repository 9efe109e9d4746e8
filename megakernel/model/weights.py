"""Model weights in the packed layout the decode kernel reads, and conversion to/from HF checkpoints.

Packed layout per layer: ``qkv`` is q_proj, k_proj, v_proj stacked by rows; ``gate_up`` is gate_proj
then up_proj stacked by rows. Every matrix is [out_features, in_features], as in torch.nn.Linear.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import ModelConfig

HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
# Buffers some older checkpoints store; they are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match its config: the message names the tensor."""


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, H]: q heads, then k heads, then v heads
    q_norm: torch.Tensor | None  # [D] (Qwen3 only)
    k_norm: torch.Tensor | None  # [D] (Qwen3 only)
    o_proj: torch.Tensor  # [H, q_size]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2F, H]: gate rows 0..F-1, up rows F..2F-1
    down: torch.Tensor  # [H, F]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("attn_norm", "qkv", "q_norm", "k_norm", "o_proj", "mlp_norm", "gate_up", "down"):
            t = getattr(self, name)
            if t is not None:
                yield name, t


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same object as embed when tied
    meta: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "ModelWeights":
        """A copy on `device` / in `dtype` (each None = unchanged); a tied LM head stays tied."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        embed = mv(self.embed)
        tied = self.lm_head is self.embed
        layers = [LayerWeights(**{name: mv(getattr(lw, name)) for name in LayerWeights.__dataclass_fields__})
                  for lw in self.layers]
        return ModelWeights(config=self.config, embed=embed, layers=layers, final_norm=mv(self.final_norm),
                            lm_head=embed if tied else mv(self.lm_head), meta=dict(self.meta))

    def num_bytes(self) -> int:
        """Bytes held, counting a tied LM head once."""
        seen: set[int] = set()
        total = 0
        for t in [self.embed, self.lm_head, self.final_norm] + [t for lw in self.layers for _, t in lw.tensors()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------

def random_weights(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    std: float | None = None,
    rng_device: str | torch.device = "cpu",
) -> ModelWeights:
    """Seeded random weights, drawn in float32 on `rng_device` (CPU by default, so the values do not
    depend on `device`), then cast to `dtype` and moved to `device`.

    With ``std=None`` a projection with fan-in n is drawn from N(0, 1/n), so it maps a unit-RMS input
    to a unit-RMS output. The embedding has std 1 when untied (the RMS of the layer outputs added to
    the residual stream) and 0.5/sqrt(H) when tied: a larger tied embedding makes the current
    token's own logit win, and generation repeats it. Logits have a spread of about 1 (0.5 tied).
    Measured on CPU (bf16 vs float32 activations, 8 layers, H=1024, V=32000): a gain of 1 gives ~1%
    relative logit error and 0.5-3% greedy flips with diverse tokens; a gain of 2 makes the network
    chaotic (6% error, 15% flips), and a flat std of 0.1-0.3 at H >= 1024 is a larger gain still.
    With ``std`` given, every matrix uses it. Norm weights are 1 + 0.1 N(0, 1), never all ones, so a
    kernel that ignores one fails.
    """
    gen = torch.Generator(device=rng_device)
    gen.manual_seed(seed)
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim

    def draw(rows: int, cols: int, default_std: float) -> torch.Tensor:
        s = std if std is not None else default_std
        t = torch.randn(rows, cols, generator=gen, device=rng_device, dtype=torch.float32) * s
        return t.to(device=device, dtype=dtype)

    def norm(n: int) -> torch.Tensor:
        t = 1.0 + 0.1 * torch.randn(n, generator=gen, device=rng_device, dtype=torch.float32)
        return t.to(device=device, dtype=dtype)

    embed = draw(config.vocab_size, h, 0.5 * h ** -0.5 if config.tie_word_embeddings else 1.0)
    layers = []
    for _ in range(config.num_layers):
        layers.append(LayerWeights(
            attn_norm=norm(h),
            qkv=draw(config.qkv_rows, h, h ** -0.5),
            q_norm=norm(d) if config.qk_norm else None,
            k_norm=norm(d) if config.qk_norm else None,
            o_proj=draw(h, config.q_size, config.q_size ** -0.5),
            mlp_norm=norm(h),
            gate_up=draw(2 * f, h, h ** -0.5),
            down=draw(h, f, f ** -0.5),
        ))
    final_norm = norm(h)
    lm_head = embed if config.tie_word_embeddings else draw(config.vocab_size, h, h ** -0.5)
    return ModelWeights(config=config, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head,
                        meta={"seed": seed, "std": std})


# ---------------------------------------------------------------------------------------------
# HF naming
# ---------------------------------------------------------------------------------------------

def _layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "attn_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "o_proj": p + "self_attn.o_proj.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `config` holds, with its shape (lm_head.weight included even
    when tied; a tied checkpoint may omit it)."""
    h, f, d, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config.num_layers):
        n = _layer_names(i)
        shapes[n["attn_norm"]] = (h,)
        shapes[n["q"]] = (config.q_size, h)
        shapes[n["k"]] = (config.kv_size, h)
        shapes[n["v"]] = (config.kv_size, h)
        if config.qk_norm:
            shapes[n["q_norm"]] = (d,)
            shapes[n["k_norm"]] = (d,)
        shapes[n["o_proj"]] = (h, config.q_size)
        shapes[n["mlp_norm"]] = (h,)
        shapes[n["gate"]] = (f, h)
        shapes[n["up"]] = (f, h)
        shapes[n["down"]] = (h, f)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def to_hf_state_dict(weights: ModelWeights) -> dict[str, torch.Tensor]:
    """HF-named tensors (views into the packed ones). lm_head.weight is included even when tied,
    as in ``model.state_dict()``."""
    cfg = weights.config
    q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights.embed}
    for i, lw in enumerate(weights.layers):
        n = _layer_names(i)
        sd[n["attn_norm"]] = lw.attn_norm
        sd[n["q"]] = lw.qkv[:q]
        sd[n["k"]] = lw.qkv[q:q + kv]
        sd[n["v"]] = lw.qkv[q + kv:]
        if cfg.qk_norm:
            sd[n["q_norm"]] = lw.q_norm
            sd[n["k_norm"]] = lw.k_norm
        sd[n["o_proj"]] = lw.o_proj
        sd[n["mlp_norm"]] = lw.mlp_norm
        sd[n["gate"]] = lw.gate_up[:f]
        sd[n["up"]] = lw.gate_up[f:]
        sd[n["down"]] = lw.down
    sd["model.norm.weight"] = weights.final_norm
    sd["lm_head.weight"] = weights.lm_head
    return sd


def from_hf_state_dict(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> ModelWeights:
    """Pack HF-named tensors. Raises CheckpointError naming a tensor that is missing, has the wrong
    shape, or is not part of the model. ``dtype=None`` keeps the stored dtype."""
    expected = expected_hf_shapes(config)
    tied = config.tie_word_embeddings
    for name in tensors:
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES):
            raise CheckpointError(f"unexpected tensor {name!r} (shape {tuple(tensors[name].shape)}) for {config.name}")
    for name, shape in expected.items():
        if name not in tensors:
            if name == "lm_head.weight" and tied:
                continue
            raise CheckpointError(f"missing tensor {name!r} (expected shape {shape})")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape}")

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([get(n) for n in names], dim=0).contiguous()

    layers = []
    for i in range(config.num_layers):
        n = _layer_names(i)
        layers.append(LayerWeights(
            attn_norm=get(n["attn_norm"]),
            qkv=cat(n["q"], n["k"], n["v"]),
            q_norm=get(n["q_norm"]) if config.qk_norm else None,
            k_norm=get(n["k_norm"]) if config.qk_norm else None,
            o_proj=get(n["o_proj"]),
            mlp_norm=get(n["mlp_norm"]),
            gate_up=cat(n["gate"], n["up"]),
            down=get(n["down"]),
        ))
    embed = get("model.embed_tokens.weight")
    # A tied checkpoint that still stores lm_head.weight: the embedding is the one the model uses.
    lm_head = embed if tied else get("lm_head.weight")
    return ModelWeights(config=config, embed=embed, layers=layers, final_norm=get("model.norm.weight"),
                        lm_head=lm_head)


# ---------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------

def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, HF_INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, HF_SINGLE_FILE)):
        files = [HF_SINGLE_FILE]
    else:
        files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for x in files:
        if not os.path.exists(os.path.join(path, x)):
            raise FileNotFoundError(f"checkpoint shard {x!r} listed in {HF_INDEX_FILE} is missing from {path}")
    return files


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> ModelWeights:
    """Load an HF checkpoint directory (config.json + one or more *.safetensors) into the packed layout."""
    from safetensors import safe_open

    path = os.fspath(path)
    config = ModelConfig.from_pretrained(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        with safe_open(os.path.join(path, file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard of {path}")
                tensors[name] = f.get_tensor(name)
    return from_hf_state_dict(config, tensors, dtype=dtype, device=device)


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def save_checkpoint(path: str | os.PathLike, weights: ModelWeights, max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors in HF naming (a tied LM head is not stored). With
    `max_shard_bytes`, tensors are split greedily into shards of at most that many bytes (a single
    larger tensor gets a shard of its own) and model.safetensors.index.json is written."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = weights.config
    hf_config = cfg.to_hf_config()
    dtype_name = _DTYPE_NAMES.get(weights.dtype, str(weights.dtype).removeprefix("torch."))
    hf_config["torch_dtype"] = dtype_name  # transformers 4.x
    hf_config["dtype"] = dtype_name  # transformers 5.x
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)

    sd = to_hf_state_dict(weights)
    if cfg.tie_word_embeddings:
        del sd["lm_head.weight"]
    # safetensors refuses views that share storage: give every tensor its own CPU copy.
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in os.listdir(path):
        if stale.endswith(".safetensors") or stale == HF_INDEX_FILE:
            os.remove(os.path.join(path, stale))
    if max_shard_bytes is None or len(shards) == 1:
        save_file(shards[0], os.path.join(path, HF_SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(path, HF_INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
