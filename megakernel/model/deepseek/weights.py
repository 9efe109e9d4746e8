"""DeepSeek-V3 / Kimi-K2 weights in the packed layout the decode kernel streams.

Packed layout of one layer (H hidden, n heads, r = qk_rope_head_dim, c = kv_lora_rank):

* `qkv_a [q_a_rows + c + r, H]`: everything that multiplies the normed hidden state, one matrix.
  Rows: the query part (q_a_proj [q_lora_rank] with q LoRA, else the whole q_proj [n*(nope+r)]),
  then kv_a_proj_with_mqa (latent c rows, then the shared rope key r rows).
* `q_b [n*(nope+r), q_lora_rank]` (None without q LoRA). Query rows are head-major, each head
  [nope | rope], as in the checkpoint.
* `w_uk [n, nope, c]`, `w_uv [n, v, c]`: kv_b_proj split per head for the absorbed decode form
  (q_latent = W_UK^T q_nope; out = W_UV @ (softmax . latent)).
* rope rows (of the query and of the shared key) are always stored in rotate-half order: a checkpoint
  with `rope_interleave` (rotary pairs (x0, x1), (x2, x3), ...) has those rows permuted to
  [x0, x2, ..., x1, x3, ...] on load and back on save. Rotate-half rope applied to the permuted rows
  is exactly transformers' interleaved rope, so one rope convention serves every checkpoint and the
  cached rope key equals transformers' cached `k_rot`.
* dense layers: `gate_up [2F, H]` (gate rows then up rows), `down [H, F]`.
* MoE layers: `router [E, H]` and `router_bias [E]` (e_score_correction_bias), both kept in float32
  as transformers keeps them; `experts_gate_up [E, 2F, H]` (expert e: gate rows then up rows, one
  contiguous block), `experts_down [E, H, F]`; the shared experts as one MLP `shared_gate_up
  [2*n_shared*F, H]`, `shared_down [H, n_shared*F]` (None when n_shared_experts is 0).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Iterator

import torch

from .config import DeepseekConfig

ROUTER_DTYPE = torch.float32
_ROUTER_FIELDS = ("router", "router_bias")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class MissingTensorError(KeyError):
    """A tensor the config requires is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else "missing tensor"


@dataclass
class DeepseekLayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv_a: torch.Tensor  # [q_a_rows + kv_lora_rank + qk_rope_head_dim, H]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor | None  # [num_heads * qk_head_dim, q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [num_heads, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [num_heads, v_head_dim, kv_lora_rank]
    o_proj: torch.Tensor  # [H, num_heads * v_head_dim]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor | None = None  # dense layer [2F, H]
    down: torch.Tensor | None = None  # dense layer [H, F]
    router: torch.Tensor | None = None  # [E, H] float32
    router_bias: torch.Tensor | None = None  # [E] float32
    experts_gate_up: torch.Tensor | None = None  # [E, 2*Fe, H]
    experts_down: torch.Tensor | None = None  # [E, H, Fe]
    shared_gate_up: torch.Tensor | None = None  # [2*Fs, H]
    shared_down: torch.Tensor | None = None  # [H, Fs]

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                yield f.name, t

    def to(self, device=None, dtype=None) -> "DeepseekLayerWeights":
        kw = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t = t.to(device=device, dtype=ROUTER_DTYPE if f.name in _ROUTER_FIELDS else dtype)
            kw[f.name] = t
        return DeepseekLayerWeights(**kw)


@dataclass
class DecoderWeights:
    """The model-level tensors of a decoder family: the embedding, the layers (each with named_tensors() and
    to(device, dtype)), the final norm and the LM head (the same object as embed when tied). DeepseekWeights
    and the Kimi Linear family's weights are this with their own config and layer types."""

    config: object
    embed: torch.Tensor  # [V, H]
    layers: list
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same object as embed when tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors by name ("embed", "layers.3.w_uk", ...); lm_head omitted when tied."""
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for name, t in layer.named_tensors():
                yield f"layers.{i}.{name}", t
        yield "final_norm", self.final_norm
        if self.lm_head is not self.embed:
            yield "lm_head", self.lm_head

    def to(self, device=None, dtype=None):
        """A copy on device / in dtype (each None = unchanged), of the same class; a tied LM head stays tied, and
        the layers keep the tensors their family holds in float32 (layer.to)."""
        embed = self.embed.to(device=device, dtype=dtype)
        lm_head = embed if self.lm_head is self.embed else self.lm_head.to(device=device, dtype=dtype)
        return replace(self, embed=embed, layers=[layer.to(device=device, dtype=dtype) for layer in self.layers],
                       final_norm=self.final_norm.to(device=device, dtype=dtype), lm_head=lm_head)


@dataclass
class DeepseekWeights(DecoderWeights):
    """DeepSeek-V3 / Kimi-K2 weights: a DeepseekConfig and DeepseekLayerWeights (router and router_bias stay
    float32 through to())."""

    config: DeepseekConfig
    layers: list[DeepseekLayerWeights]


# ---- rope row order --------------------------------------------------------------------------------

def interleaved_to_half_perm(rope_dim: int) -> torch.Tensor:
    """Index p with half = interleaved[p]: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _permute_q_rope_rows(q: torch.Tensor, config: DeepseekConfig, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows of every head of a query weight [n*(nope+r), in]."""
    n, nope, r = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    q3 = q.reshape(n, nope + r, q.shape[-1])
    rope = q3[:, nope:, :].index_select(1, perm.to(q.device))
    return torch.cat([q3[:, :nope, :], rope], dim=1).reshape(n * (nope + r), q.shape[-1])


def _permute_kv_rope_rows(kv_a: torch.Tensor, config: DeepseekConfig, perm: torch.Tensor) -> torch.Tensor:
    c = config.kv_lora_rank
    return torch.cat([kv_a[:c], kv_a[c:].index_select(0, perm.to(kv_a.device))], dim=0)


def _rope_perms(config: DeepseekConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(to packed, to checkpoint) row permutations, or None when the checkpoint is already rotate-half."""
    if not config.rope_interleave:
        return None
    perm = interleaved_to_half_perm(config.qk_rope_head_dim)
    return perm, torch.argsort(perm)


# ---- seeded random weights ------------------------------------------------------------------------

def random_weights(
    config: DeepseekConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    std: float | None = None,
) -> DeepseekWeights:
    """Seeded random weights in the packed layout.

    std=None: each matrix ~ N(0, 1/fan_in) (activations stay O(1) through depth), embeddings N(0, 1),
    lm_head N(0, 16/H) so logits have std ~4 and greedy picks are decisive; norm weights 1 + N(0, 0.1^2);
    e_score_correction_bias N(0, 0.05^2). A float std gives every matrix (and the embedding) N(0, std^2).
    Tensors are drawn in float32 (one expert at a time) and cast, so a seed gives the same values
    in every dtype up to rounding.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    H, n = config.hidden_size, config.num_heads

    def mat(*shape: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        s = std if std is not None else gain / math.sqrt(fan_in)
        out = torch.empty(shape, dtype=dtype, device=device)
        # draw per leading slice so a [384, 4096, 7168] expert stack never needs a float32 copy
        rows = out.reshape(-1, shape[-2], shape[-1]) if len(shape) > 2 else out.reshape(1, *shape)
        for r in rows:
            r.copy_(torch.randn(r.shape, generator=gen, device=device, dtype=torch.float32) * s)
        return out

    def norm(dim: int) -> torch.Tensor:
        w = 1.0 + 0.1 * torch.randn(dim, generator=gen, device=device, dtype=torch.float32)
        return w.to(dtype)

    layers = []
    for i in range(config.num_layers):
        q_in = config.q_lora_rank if config.q_lora_rank is not None else H
        layer = DeepseekLayerWeights(
            attn_norm=norm(H),
            qkv_a=mat(config.qkv_a_rows, H, fan_in=H),
            q_a_norm=norm(config.q_lora_rank) if config.q_lora_rank is not None else None,
            q_b=mat(config.q_size, q_in, fan_in=q_in) if config.q_lora_rank is not None else None,
            kv_a_norm=norm(config.kv_lora_rank),
            w_uk=mat(n, config.qk_nope_head_dim, config.kv_lora_rank, fan_in=config.kv_lora_rank),
            w_uv=mat(n, config.v_head_dim, config.kv_lora_rank, fan_in=config.kv_lora_rank),
            o_proj=mat(H, config.o_proj_cols, fan_in=config.o_proj_cols),
            mlp_norm=norm(H),
        )
        if config.is_moe_layer(i):
            E, F = config.n_routed_experts, config.moe_intermediate_size
            s = std if std is not None else 1.0 / math.sqrt(H)
            layer.router = (torch.randn(E, H, generator=gen, device=device) * s).to(ROUTER_DTYPE)
            layer.router_bias = (0.05 * torch.randn(E, generator=gen, device=device)).to(ROUTER_DTYPE)
            layer.experts_gate_up = mat(E, 2 * F, H, fan_in=H)
            layer.experts_down = mat(E, H, F, fan_in=F)
            if config.n_shared_experts:
                Fs = config.shared_intermediate_size
                layer.shared_gate_up = mat(2 * Fs, H, fan_in=H)
                layer.shared_down = mat(H, Fs, fan_in=Fs)
        else:
            F = config.intermediate_size
            layer.gate_up = mat(2 * F, H, fan_in=H)
            layer.down = mat(H, F, fan_in=F)
        layers.append(layer)

    embed = mat(config.vocab_size, H, fan_in=1)
    final_norm = norm(H)
    lm_head = embed if config.tie_word_embeddings else mat(config.vocab_size, H, fan_in=H, gain=4.0)
    return DeepseekWeights(config=config, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


# ---- checkpoint reading ---------------------------------------------------------------------------

class _SafetensorsSource:
    """Tensors by HF name across the (possibly sharded) safetensors files of one checkpoint."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            weight_map = None
        self._handles = {f: safe_open(os.path.join(path, f), framework="pt", device="cpu") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map: dict[str, str] = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        f = self.weight_map.get(name)
        if f is None:
            raise MissingTensorError(f"checkpoint {self.path} lacks tensor {name!r}")
        return self._handles[f].get_tensor(name)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, config expects {tuple(shape)}")
    return t


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    config: DeepseekConfig | None = None,
) -> DeepseekWeights:
    """Read config.json + HF-named safetensors (one file, several, or sharded with an index).

    Routed experts may be stored per expert (`mlp.experts.{e}.gate_proj.weight`, the hub layout and
    what transformers' save_pretrained writes) or fused (`mlp.experts.gate_up_proj [E, 2F, H]`,
    `mlp.experts.down_proj [E, H, F]`). Tensors of layers beyond num_hidden_layers (multi-token
    prediction modules) are ignored. A missing tensor raises MissingTensorError naming it.
    """
    path = os.fspath(path)
    config = config or DeepseekConfig.from_pretrained(path)
    device = torch.device(device)
    src = _SafetensorsSource(path)
    H, n = config.hidden_size, config.num_heads
    perms = _rope_perms(config)

    def get(name: str, shape: tuple[int, ...], dt: torch.dtype = dtype) -> torch.Tensor:
        return _check_shape(name, src.get(name), shape).to(device=device, dtype=dt)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if config.q_lora_rank is not None:
            q_a = get(a + "q_a_proj.weight", (config.q_lora_rank, H))
            q_a_norm = get(a + "q_a_layernorm.weight", (config.q_lora_rank,))
            q_b = get(a + "q_b_proj.weight", (config.q_size, config.q_lora_rank))
            if perms:
                q_b = _permute_q_rope_rows(q_b, config, perms[0])
        else:
            q_a = get(a + "q_proj.weight", (config.q_size, H))
            if perms:
                q_a = _permute_q_rope_rows(q_a, config, perms[0])
            q_a_norm = q_b = None
        kv_a = get(a + "kv_a_proj_with_mqa.weight", (config.kv_a_rows, H))
        if perms:
            kv_a = _permute_kv_rope_rows(kv_a, config, perms[0])
        kv_b = get(a + "kv_b_proj.weight", (n * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank))
        kv_b = kv_b.reshape(n, config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)
        layer = DeepseekLayerWeights(
            attn_norm=get(p + "input_layernorm.weight", (H,)),
            qkv_a=torch.cat([q_a, kv_a], dim=0),
            q_a_norm=q_a_norm,
            q_b=q_b,
            kv_a_norm=get(a + "kv_a_layernorm.weight", (config.kv_lora_rank,)),
            w_uk=kv_b[:, : config.qk_nope_head_dim].contiguous(),
            w_uv=kv_b[:, config.qk_nope_head_dim :].contiguous(),
            o_proj=get(a + "o_proj.weight", (H, config.o_proj_cols)),
            mlp_norm=get(p + "post_attention_layernorm.weight", (H,)),
        )
        m = p + "mlp."
        if config.is_moe_layer(i):
            E, F = config.n_routed_experts, config.moe_intermediate_size
            layer.router = get(m + "gate.weight", (E, H), ROUTER_DTYPE)
            layer.router_bias = get(m + "gate.e_score_correction_bias", (E,), ROUTER_DTYPE)
            if m + "experts.gate_up_proj" in src:
                layer.experts_gate_up = get(m + "experts.gate_up_proj", (E, 2 * F, H))
                layer.experts_down = get(m + "experts.down_proj", (E, H, F))
            else:
                gu = torch.empty(E, 2 * F, H, dtype=dtype, device=device)
                dn = torch.empty(E, H, F, dtype=dtype, device=device)
                for e in range(E):
                    x = f"{m}experts.{e}."
                    gu[e, :F] = get(x + "gate_proj.weight", (F, H))
                    gu[e, F:] = get(x + "up_proj.weight", (F, H))
                    dn[e] = get(x + "down_proj.weight", (H, F))
                layer.experts_gate_up, layer.experts_down = gu, dn
            if config.n_shared_experts:
                Fs = config.shared_intermediate_size
                s = m + "shared_experts."
                layer.shared_gate_up = torch.cat(
                    [get(s + "gate_proj.weight", (Fs, H)), get(s + "up_proj.weight", (Fs, H))], dim=0
                )
                layer.shared_down = get(s + "down_proj.weight", (H, Fs))
        else:
            F = config.intermediate_size
            layer.gate_up = torch.cat([get(m + "gate_proj.weight", (F, H)), get(m + "up_proj.weight", (F, H))], dim=0)
            layer.down = get(m + "down_proj.weight", (H, F))
        layers.append(layer)

    embed = get("model.embed_tokens.weight", (config.vocab_size, H))
    if config.tie_word_embeddings:
        lm_head = embed  # transformers ties lm_head to the embedding and ignores a stored copy
    else:
        lm_head = get("lm_head.weight", (config.vocab_size, H))
    final_norm = get("model.norm.weight", (H,))
    return DeepseekWeights(config=config, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


# ---- checkpoint writing ---------------------------------------------------------------------------

def hf_tensors(weights: DeepseekWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, private contiguous CPU tensor) in checkpoint layout, produced one at a time."""
    config = weights.config
    perms = _rope_perms(config)
    to_ckpt = perms[1] if perms else None
    qa = config.q_a_rows

    def own(t: torch.Tensor) -> torch.Tensor:
        # a private contiguous copy: safetensors refuses tensors that share storage
        return t.detach().to("cpu").contiguous().clone()

    yield "model.embed_tokens.weight", own(weights.embed)
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        yield p + "input_layernorm.weight", own(layer.attn_norm)
        if config.q_lora_rank is not None:
            yield a + "q_a_proj.weight", own(layer.qkv_a[:qa])
            yield a + "q_a_layernorm.weight", own(layer.q_a_norm)
            q_b = layer.q_b if to_ckpt is None else _permute_q_rope_rows(layer.q_b, config, to_ckpt)
            yield a + "q_b_proj.weight", own(q_b)
        else:
            q = layer.qkv_a[:qa] if to_ckpt is None else _permute_q_rope_rows(layer.qkv_a[:qa], config, to_ckpt)
            yield a + "q_proj.weight", own(q)
        kv_a = layer.qkv_a[qa:] if to_ckpt is None else _permute_kv_rope_rows(layer.qkv_a[qa:], config, to_ckpt)
        yield a + "kv_a_proj_with_mqa.weight", own(kv_a)
        yield a + "kv_a_layernorm.weight", own(layer.kv_a_norm)
        yield a + "kv_b_proj.weight", own(torch.cat([layer.w_uk, layer.w_uv], dim=1).reshape(-1, config.kv_lora_rank))
        yield a + "o_proj.weight", own(layer.o_proj)
        yield p + "post_attention_layernorm.weight", own(layer.mlp_norm)
        m = p + "mlp."
        if layer.is_moe:
            F = config.moe_intermediate_size
            yield m + "gate.weight", own(layer.router)
            yield m + "gate.e_score_correction_bias", own(layer.router_bias)
            for e in range(config.n_routed_experts):
                x = f"{m}experts.{e}."
                yield x + "gate_proj.weight", own(layer.experts_gate_up[e, :F])
                yield x + "up_proj.weight", own(layer.experts_gate_up[e, F:])
                yield x + "down_proj.weight", own(layer.experts_down[e])
            if layer.shared_gate_up is not None:
                Fs = config.shared_intermediate_size
                s = m + "shared_experts."
                yield s + "gate_proj.weight", own(layer.shared_gate_up[:Fs])
                yield s + "up_proj.weight", own(layer.shared_gate_up[Fs:])
                yield s + "down_proj.weight", own(layer.shared_down)
        else:
            F = config.intermediate_size
            yield m + "gate_proj.weight", own(layer.gate_up[:F])
            yield m + "up_proj.weight", own(layer.gate_up[F:])
            yield m + "down_proj.weight", own(layer.down)
    yield "model.norm.weight", own(weights.final_norm)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", own(weights.lm_head)


def save_checkpoint(
    path: str | os.PathLike, weights: DeepseekWeights, max_shard_bytes: int | None = None
) -> None:
    """Write config.json + HF-named safetensors (per-expert names, interleaved rope rows when the config
    says so) that transformers' DeepseekV3ForCausalLM.from_pretrained loads; sharded with
    model.safetensors.index.json when max_shard_bytes is given."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = weights.config.to_hf_config()
    dtype_name = _DTYPE_NAMES.get(weights.dtype, str(weights.dtype).replace("torch.", ""))
    cfg["torch_dtype"] = dtype_name  # transformers 4.x
    cfg["dtype"] = dtype_name  # transformers 5.x
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)

    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(dict(hf_tensors(weights)), os.path.join(path, "model.safetensors"), meta)
        return

    # write shards to temporary names first: the total count is known only at the end
    shards: list[tuple[str, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            tmp = f"shard-{len(shards):05d}.tmp"
            save_file(current, os.path.join(path, tmp), meta)
            shards.append((tmp, list(current)))
            current, current_bytes = {}, 0

    for name, t in hf_tensors(weights):
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        current[name] = t
        current_bytes += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for k, (tmp, names) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(path, tmp), os.path.join(path, final))
        weight_map.update({name: final for name in names})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
