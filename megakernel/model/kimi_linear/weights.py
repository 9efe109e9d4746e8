"""Kimi Linear weights in a named per-layer structure, seeded random init, HF checkpoint load / save.

One layer = an attention block (`kda` or `mla`, per `config.layer_types`) + an MLP (dense or MoE, per
`config.mlp_layer_types`). Layout (H hidden; KDA: nh heads of dk, D = nh * dk, K conv kernel; MLA: n heads,
c = kv_lora_rank, r = qk_rope_head_dim):

* `KDAWeights`: `qkv [3D, H]` (q_proj, k_proj, v_proj rows: the short convolution's channel order),
  `conv [3D, K]` (depthwise, no bias), forget gate `f_a [dk, H]`, `f_b [D, dk]`, `dt_bias [D]` (float32,
  as transformers keeps it), `A_log [nh]`, beta `b_proj [nh, H]`, output gate `g_a [dk, H]`, `g_b [D, dk]`,
  `o_norm [dk]` (gated RMSNorm, shared by the heads), `o_proj [H, D]`.
* `MLAWeights`: `q_proj [n*(nope+r), H]` or, with q LoRA, `q_a [q_lora_rank, H]`, `q_a_norm`, `q_b`;
  `kv_a [c + r, H]` (latent rows then the shared, unrotated key), `kv_a_norm [c]`, kv_b_proj split per head
  into `w_uk [n, nope, c]` and `w_uv [n, v, c]` for the absorbed decode, `o_proj [H, n*v]`.
* MLP: dense `gate_up [2F, H]`, `down [H, F]`; MoE `router [E, H]`, `router_bias [E]` (float32),
  `experts_gate_up [E, 2Fe, H]`, `experts_down [E, H, Fe]`, shared experts `shared_gate_up [2Fs, H]`,
  `shared_down [H, Fs]` (None without shared experts).

Checkpoints: `load_checkpoint` reads the hub layout that transformers' `save_pretrained` writes
(`self_attn.{q,k,v}_conv1d`, `self_attn.f_a_proj`, `self_attn.A_log`, `block_sparse_moe.experts.{e}.w1/w2/w3`)
and transformers' in-memory layout (`self_attn.conv1d`, `self_attn.forget_gate.*`, `mlp.experts.gate_up_proj`);
`save_checkpoint` writes the hub layout, which `KimiLinearForCausalLM.from_pretrained` converts on load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, is_dataclass
from typing import Iterator

import torch

from ..deepseek.weights import DecoderWeights, MissingTensorError, _check_shape, _SafetensorsSource
from .config import KimiLinearConfig

__all__ = [
    "FP32_FIELDS",
    "KDAWeights",
    "KimiLinearLayerWeights",
    "KimiLinearWeights",
    "MLAWeights",
    "MissingTensorError",
    "hf_tensors",
    "load_checkpoint",
    "random_weights",
    "save_checkpoint",
]

# tensors transformers keeps in float32 whatever the model dtype (_keep_in_fp32_modules_strict)
FP32_FIELDS = ("router", "router_bias", "dt_bias")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _named(obj) -> Iterator[tuple[str, torch.Tensor]]:
    for f in fields(obj):
        t = getattr(obj, f.name)
        if t is None:
            continue
        if is_dataclass(t):
            for name, sub in _named(t):
                yield f"{f.name}.{name}", sub
        elif isinstance(t, torch.Tensor):
            yield f.name, t


def _to(obj, device, dtype):
    kw = {}
    for f in fields(obj):
        t = getattr(obj, f.name)
        if is_dataclass(t):
            t = _to(t, device, dtype)
        elif isinstance(t, torch.Tensor):
            t = t.to(device=device, dtype=torch.float32 if f.name in FP32_FIELDS else dtype)
        kw[f.name] = t
    return type(obj)(**kw)


@dataclass
class KDAWeights:
    qkv: torch.Tensor  # [3D, H]
    conv: torch.Tensor  # [3D, K]
    f_a: torch.Tensor  # [dk, H]
    f_b: torch.Tensor  # [D, dk]
    dt_bias: torch.Tensor  # [D] float32
    A_log: torch.Tensor  # [nh]
    b_proj: torch.Tensor  # [nh, H]
    g_a: torch.Tensor  # [dk, H]
    g_b: torch.Tensor  # [D, dk]
    o_norm: torch.Tensor  # [dk]
    o_proj: torch.Tensor  # [H, D]


@dataclass
class MLAWeights:
    kv_a: torch.Tensor  # [c + r, H]
    kv_a_norm: torch.Tensor  # [c]
    w_uk: torch.Tensor  # [n, nope, c]
    w_uv: torch.Tensor  # [n, v, c]
    o_proj: torch.Tensor  # [H, n * v]
    q_proj: torch.Tensor | None = None  # [n * (nope + r), H] without q LoRA
    q_a: torch.Tensor | None = None  # [q_lora_rank, H]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: torch.Tensor | None = None  # [n * (nope + r), q_lora_rank]


@dataclass
class KimiLinearLayerWeights:
    attn_norm: torch.Tensor  # [H]
    mlp_norm: torch.Tensor  # [H]
    kda: KDAWeights | None = None
    mla: MLAWeights | None = None
    gate_up: torch.Tensor | None = None  # dense [2F, H]
    down: torch.Tensor | None = None  # dense [H, F]
    router: torch.Tensor | None = None  # [E, H] float32
    router_bias: torch.Tensor | None = None  # [E] float32
    experts_gate_up: torch.Tensor | None = None  # [E, 2Fe, H]
    experts_down: torch.Tensor | None = None  # [E, H, Fe]
    shared_gate_up: torch.Tensor | None = None  # [2Fs, H]
    shared_down: torch.Tensor | None = None  # [H, Fs]

    @property
    def is_kda(self) -> bool:
        return self.kda is not None

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return _named(self)

    def to(self, device=None, dtype=None) -> "KimiLinearLayerWeights":
        return _to(self, device, dtype)


@dataclass
class KimiLinearWeights(DecoderWeights):
    """Kimi Linear weights: a KimiLinearConfig and KimiLinearLayerWeights (router, router_bias and dt_bias stay
    float32 through to()); tensors by name as "embed", "layers.0.kda.qkv", "layers.3.mla.w_uk", ..."""

    config: KimiLinearConfig
    layers: list[KimiLinearLayerWeights]


# ---- seeded random weights ------------------------------------------------------------------------

def random_weights(
    config: KimiLinearConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> KimiLinearWeights:
    """Seeded random weights. Matrices ~ N(0, 1/fan_in), embeddings N(0, 1), lm_head N(0, 16/H) (decisive
    greedy picks), norm weights 1 + N(0, 0.1^2), e_score_correction_bias N(0, 0.05^2); KDA as FLA initialises
    it: A_log = log U(1, 16), dt_bias = softplus^-1(dt) with log dt ~ U(log 1e-3, log 1e-1); conv taps
    N(0, 1/K). Drawn in float32 (one expert at a time) and cast, so a seed gives the same values in every
    dtype up to rounding."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    H = config.hidden_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    def mat(*shape: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        s = gain / math.sqrt(fan_in)
        out = torch.empty(shape, dtype=dtype, device=device)
        rows = out.reshape(-1, shape[-2], shape[-1]) if len(shape) > 2 else out.reshape(1, *shape)
        for r in rows:
            r.copy_(randn(*r.shape) * s)
        return out

    def norm(dim: int) -> torch.Tensor:
        return (1.0 + 0.1 * randn(dim)).to(dtype)

    layers = []
    for i in range(config.num_layers):
        layer = KimiLinearLayerWeights(attn_norm=norm(H), mlp_norm=norm(H))
        if config.is_kda_layer(i):
            D, dk, nh = config.kda_dim, config.linear_head_dim, config.linear_num_heads
            K = config.linear_conv_kernel_dim
            u = torch.rand(D, generator=gen, device=device, dtype=torch.float32)
            dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
            a = 1.0 + 15.0 * torch.rand(nh, generator=gen, device=device, dtype=torch.float32)
            layer.kda = KDAWeights(
                qkv=mat(3 * D, H, fan_in=H),
                conv=mat(3 * D, K, fan_in=K),
                f_a=mat(dk, H, fan_in=H),
                f_b=mat(D, dk, fan_in=dk),
                dt_bias=dt + torch.log(-torch.expm1(-dt)),
                A_log=a.log().to(dtype),
                b_proj=mat(nh, H, fan_in=H),
                g_a=mat(dk, H, fan_in=H),
                g_b=mat(D, dk, fan_in=dk),
                o_norm=norm(dk),
                o_proj=mat(H, D, fan_in=D),
            )
        else:
            n, c = config.num_heads, config.kv_lora_rank
            mla = MLAWeights(
                kv_a=mat(config.kv_a_rows, H, fan_in=H),
                kv_a_norm=norm(c),
                w_uk=mat(n, config.qk_nope_head_dim, c, fan_in=c),
                w_uv=mat(n, config.v_head_dim, c, fan_in=c),
                o_proj=mat(H, config.o_proj_cols, fan_in=config.o_proj_cols),
            )
            if config.q_lora_rank is None:
                mla.q_proj = mat(config.q_size, H, fan_in=H)
            else:
                mla.q_a = mat(config.q_lora_rank, H, fan_in=H)
                mla.q_a_norm = norm(config.q_lora_rank)
                mla.q_b = mat(config.q_size, config.q_lora_rank, fan_in=config.q_lora_rank)
            layer.mla = mla
        if config.is_moe_layer(i):
            E, F = config.n_routed_experts, config.moe_intermediate_size
            layer.router = randn(E, H) / math.sqrt(H)
            layer.router_bias = 0.05 * randn(E)
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
    lm_head = mat(config.vocab_size, H, fan_in=H, gain=4.0)
    return KimiLinearWeights(config=config, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


# ---- checkpoint reading ---------------------------------------------------------------------------

def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    config: KimiLinearConfig | None = None,
) -> KimiLinearWeights:
    """Read config.json + HF-named safetensors (one file, several, or sharded with an index), in the hub
    layout or transformers' in-memory one (see the module docstring). A missing tensor raises
    MissingTensorError naming it; a tensor of the wrong shape ValueError. router, router_bias and dt_bias
    are kept in float32."""
    path = os.fspath(path)
    config = config or KimiLinearConfig.from_pretrained(path)
    device = torch.device(device)
    src = _SafetensorsSource(path)
    H = config.hidden_size

    def get(name: str, shape: tuple[int, ...], dt: torch.dtype = dtype) -> torch.Tensor:
        return _check_shape(name, src.get(name), shape).to(device=device, dtype=dt)

    def pick(*names: str) -> str:
        for nm in names:
            if nm in src:
                return nm
        return names[0]  # get() raises MissingTensorError naming the first spelling

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = KimiLinearLayerWeights(
            attn_norm=get(p + "input_layernorm.weight", (H,)),
            mlp_norm=get(p + "post_attention_layernorm.weight", (H,)),
        )
        if config.is_kda_layer(i):
            D, dk, nh = config.kda_dim, config.linear_head_dim, config.linear_num_heads
            K = config.linear_conv_kernel_dim
            if a + "conv1d.weight" in src:
                conv = get(a + "conv1d.weight", (3 * D, 1, K))[:, 0]
            else:
                conv = torch.cat([get(a + f"{x}_conv1d.weight", (D, 1, K))[:, 0] for x in "qkv"], dim=0)
            fg = a + "forget_gate."
            layer.kda = KDAWeights(
                qkv=torch.cat([get(a + f"{x}_proj.weight", (D, H)) for x in "qkv"], dim=0),
                conv=conv.contiguous(),
                f_a=get(pick(a + "f_a_proj.weight", fg + "f_a_proj.weight"), (dk, H)),
                f_b=get(pick(a + "f_b_proj.weight", fg + "f_b_proj.weight"), (D, dk)),
                dt_bias=get(pick(a + "dt_bias", fg + "dt_bias"), (D,), torch.float32),
                A_log=get(pick(a + "A_log", fg + "A_log"), (1, 1, nh, 1)).reshape(nh),
                b_proj=get(a + "b_proj.weight", (nh, H)),
                g_a=get(a + "g_a_proj.weight", (dk, H)),
                g_b=get(a + "g_b_proj.weight", (D, dk)),
                o_norm=get(a + "o_norm.weight", (dk,)),
                o_proj=get(a + "o_proj.weight", (H, D)),
            )
        else:
            n, c, nope, v = config.num_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
            kv_b = get(a + "kv_b_proj.weight", (n * (nope + v), c)).reshape(n, nope + v, c)
            mla = MLAWeights(
                kv_a=get(a + "kv_a_proj_with_mqa.weight", (config.kv_a_rows, H)),
                kv_a_norm=get(a + "kv_a_layernorm.weight", (c,)),
                w_uk=kv_b[:, :nope].contiguous(),
                w_uv=kv_b[:, nope:].contiguous(),
                o_proj=get(a + "o_proj.weight", (H, config.o_proj_cols)),
            )
            if config.q_lora_rank is None:
                mla.q_proj = get(a + "q_proj.weight", (config.q_size, H))
            else:
                mla.q_a = get(a + "q_a_proj.weight", (config.q_lora_rank, H))
                mla.q_a_norm = get(a + "q_a_layernorm.weight", (config.q_lora_rank,))
                mla.q_b = get(a + "q_b_proj.weight", (config.q_size, config.q_lora_rank))
            layer.mla = mla
        if config.is_moe_layer(i):
            E, F = config.n_routed_experts, config.moe_intermediate_size
            m = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in src else "mlp.")
            layer.router = get(m + "gate.weight", (E, H), torch.float32)
            layer.router_bias = get(m + "gate.e_score_correction_bias", (E,), torch.float32)
            if m + "experts.gate_up_proj" in src:
                layer.experts_gate_up = get(m + "experts.gate_up_proj", (E, 2 * F, H))
                layer.experts_down = get(m + "experts.down_proj", (E, H, F))
            else:
                gu = torch.empty(E, 2 * F, H, dtype=dtype, device=device)
                dn = torch.empty(E, H, F, dtype=dtype, device=device)
                for e in range(E):
                    x = f"{m}experts.{e}."
                    gu[e, :F] = get(pick(x + "w1.weight", x + "gate_proj.weight"), (F, H))
                    gu[e, F:] = get(pick(x + "w3.weight", x + "up_proj.weight"), (F, H))
                    dn[e] = get(pick(x + "w2.weight", x + "down_proj.weight"), (H, F))
                layer.experts_gate_up, layer.experts_down = gu, dn
            if config.n_shared_experts:
                Fs = config.shared_intermediate_size
                s = m + "shared_experts."
                layer.shared_gate_up = torch.cat(
                    [get(s + "gate_proj.weight", (Fs, H)), get(s + "up_proj.weight", (Fs, H))], dim=0)
                layer.shared_down = get(s + "down_proj.weight", (H, Fs))
        else:
            F = config.intermediate_size
            # save_pretrained writes dense MLPs under block_sparse_moe. too (its MoE renaming is by prefix)
            m = p + ("block_sparse_moe." if p + "block_sparse_moe.gate_proj.weight" in src else "mlp.")
            layer.gate_up = torch.cat([get(m + "gate_proj.weight", (F, H)), get(m + "up_proj.weight", (F, H))], dim=0)
            layer.down = get(m + "down_proj.weight", (H, F))
        layers.append(layer)

    return KimiLinearWeights(
        config=config,
        embed=get("model.embed_tokens.weight", (config.vocab_size, H)),
        layers=layers,
        final_norm=get("model.norm.weight", (H,)),
        lm_head=get("lm_head.weight", (config.vocab_size, H)),
    )


# ---- checkpoint writing ---------------------------------------------------------------------------

def hf_tensors(weights: KimiLinearWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, private contiguous CPU tensor) in the hub layout save_pretrained writes, one at a time."""
    config = weights.config

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous().clone()  # safetensors refuses shared storage

    yield "model.embed_tokens.weight", own(weights.embed)
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        yield p + "input_layernorm.weight", own(layer.attn_norm)
        yield p + "post_attention_layernorm.weight", own(layer.mlp_norm)
        if layer.kda is not None:
            k, D = layer.kda, config.kda_dim
            for j, x in enumerate("qkv"):
                yield a + f"{x}_proj.weight", own(k.qkv[j * D : (j + 1) * D])
                yield a + f"{x}_conv1d.weight", own(k.conv[j * D : (j + 1) * D, None, :])
            yield a + "f_a_proj.weight", own(k.f_a)
            yield a + "f_b_proj.weight", own(k.f_b)
            yield a + "dt_bias", own(k.dt_bias)
            yield a + "A_log", own(k.A_log.reshape(1, 1, -1, 1))
            yield a + "b_proj.weight", own(k.b_proj)
            yield a + "g_a_proj.weight", own(k.g_a)
            yield a + "g_b_proj.weight", own(k.g_b)
            yield a + "o_norm.weight", own(k.o_norm)
            yield a + "o_proj.weight", own(k.o_proj)
        else:
            m = layer.mla
            if m.q_proj is not None:
                yield a + "q_proj.weight", own(m.q_proj)
            else:
                yield a + "q_a_proj.weight", own(m.q_a)
                yield a + "q_a_layernorm.weight", own(m.q_a_norm)
                yield a + "q_b_proj.weight", own(m.q_b)
            yield a + "kv_a_proj_with_mqa.weight", own(m.kv_a)
            yield a + "kv_a_layernorm.weight", own(m.kv_a_norm)
            yield a + "kv_b_proj.weight", own(torch.cat([m.w_uk, m.w_uv], dim=1).reshape(-1, config.kv_lora_rank))
            yield a + "o_proj.weight", own(m.o_proj)
        if layer.is_moe:
            F = config.moe_intermediate_size
            m = p + "block_sparse_moe."
            yield m + "gate.weight", own(layer.router)
            yield m + "gate.e_score_correction_bias", own(layer.router_bias)
            for e in range(config.n_routed_experts):
                x = f"{m}experts.{e}."
                yield x + "w1.weight", own(layer.experts_gate_up[e, :F])
                yield x + "w3.weight", own(layer.experts_gate_up[e, F:])
                yield x + "w2.weight", own(layer.experts_down[e])
            if layer.shared_gate_up is not None:
                Fs = config.shared_intermediate_size
                s = m + "shared_experts."
                yield s + "gate_proj.weight", own(layer.shared_gate_up[:Fs])
                yield s + "up_proj.weight", own(layer.shared_gate_up[Fs:])
                yield s + "down_proj.weight", own(layer.shared_down)
        else:
            F = config.intermediate_size
            m = p + "mlp."
            yield m + "gate_proj.weight", own(layer.gate_up[:F])
            yield m + "up_proj.weight", own(layer.gate_up[F:])
            yield m + "down_proj.weight", own(layer.down)
    yield "model.norm.weight", own(weights.final_norm)
    yield "lm_head.weight", own(weights.lm_head)


def save_checkpoint(path: str | os.PathLike, weights: KimiLinearWeights, max_shard_bytes: int | None = None) -> None:
    """Write config.json + hub-layout safetensors that KimiLinearForCausalLM.from_pretrained loads; sharded
    with model.safetensors.index.json when max_shard_bytes is given."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = weights.config.to_hf_config()
    cfg["dtype"] = _DTYPE_NAMES.get(weights.dtype, str(weights.dtype).replace("torch.", ""))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(dict(hf_tensors(weights)), os.path.join(path, "model.safetensors"), meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in hf_tensors(weights):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), meta)
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
