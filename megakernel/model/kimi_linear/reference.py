"""Torch reference decoder for Kimi Linear: KDA layers over a per-sequence state cache, NoPE MLA layers
over the paged latent cache of the DeepSeek reference, MoE (DeepSeek-V3 routing) or dense MLPs.

Decode step of a KDA layer, per token and head (dk = dv = linear_head_dim, x the normed hidden state):

    u        = [q_proj | k_proj | v_proj] x                   (3D channels)
    q, k, v  = silu(sum_j conv[:, j] * [conv_state | u][:, j])  conv_state: the last K-1 u of the sequence
    g        = -exp(A_log[h]) * softplus(f_b f_a x + dt_bias)  per channel decay (log space), [nh, dk]
    beta     = sigmoid(b_proj x)                                [nh]
    q        = l2norm(q) / sqrt(dk);  k = l2norm(k)
    S        = diag(exp(g)) S                                   recurrent state [nh, dk, dv]
    S        = S + k (beta (v - S^T k))^T                       delta rule
    o        = S^T q
    h       += o_proj(rms_norm(o, o_norm) * sigmoid(g_b g_a x))

An MLA layer is DeepSeek's absorbed MLA without any rotary embedding: the latent row
[rms_norm(c_kv) | k_rope (unrotated)] is cached per token and the scale is (nope + rope) ** -0.5.
Everything is computed in `compute_dtype` (float32 by default); the recurrent state, the conv inputs and
the router in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..deepseek.reference import (
    LatentKVCache,
    contiguous_block_table,
    mla_decode_absorbed,
    mla_decode_naive,
    route,
    write_latent,
)
from ..ops import rms_norm
from ..reference import GenerationResult
from .config import L2NORM_EPS, LATENT_NORM_EPS, KimiLinearConfig
from .weights import KDAWeights, KimiLinearLayerWeights, KimiLinearWeights, MLAWeights

__all__ = [
    "GenerationResult",
    "KDAStateCache",
    "KimiLinearCache",
    "KimiLinearReferenceDecoder",
    "LatentKVCache",
    "contiguous_block_table",
    "kda_decay",
    "kda_recurrent_step",
    "l2norm",
]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' form, not F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_decay(gate_logits: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """gate_logits [..., nh, dk] (f_b f_a x + dt_bias), a_log [nh] -> log decay g = -exp(A_log) softplus(.),
    softplus with transformers' overflow guard (identity above 20)."""
    g = gate_logits.float()
    sp = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -torch.exp(a_log.float())[:, None] * sp


def kda_recurrent_step(
    state: torch.Tensor,  # [B, nh, dk, dv]
    q: torch.Tensor,  # [B, nh, dk] (after l2norm and scale)
    k: torch.Tensor,  # [B, nh, dk] (after l2norm)
    v: torch.Tensor,  # [B, nh, dv]
    g: torch.Tensor,  # [B, nh, dk] log decay
    beta: torch.Tensor,  # [B, nh]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule. Returns (output [B, nh, dv], new state)."""
    state = state * g.exp()[..., None]
    kv_mem = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


# ---- caches ---------------------------------------------------------------------------------------

@dataclass
class KDAStateCache:
    """Per-sequence KDA state: recurrent [L_kda, S, nh, dk, dv] and the convolution's last K-1 inputs
    conv [L_kda, S, 3D, K-1] (oldest first), float32; S sequence slots, the i-th KDA layer at index i."""

    recurrent: torch.Tensor
    conv: torch.Tensor

    @classmethod
    def allocate(cls, config: KimiLinearConfig, num_slots: int, device: str | torch.device = "cpu") -> "KDAStateCache":
        L, nh, dk = config.num_kda_layers, config.linear_num_heads, config.linear_head_dim
        return cls(
            recurrent=torch.zeros(L, num_slots, nh, dk, dk, dtype=torch.float32, device=device),
            conv=torch.zeros(L, num_slots, config.conv_dim, config.conv_state_len, dtype=torch.float32, device=device),
        )

    @property
    def num_slots(self) -> int:
        return self.recurrent.shape[1]

    def reset(self, slots: torch.Tensor) -> None:
        self.recurrent[:, slots] = 0
        self.conv[:, slots] = 0


@dataclass
class KimiLinearCache:
    """Both caches of a batch: KDA state by sequence slot, MLA latent rows paged by a block table."""

    kda: KDAStateCache
    latent: LatentKVCache  # [L_mla, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]

    @classmethod
    def allocate(
        cls,
        config: KimiLinearConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fill: float = float("nan"),
    ) -> "KimiLinearCache":
        latent = torch.full((config.num_mla_layers, num_blocks, block_size, config.latent_dim), fill, dtype=dtype,
                            device=device)
        return cls(kda=KDAStateCache.allocate(config, num_slots, device),
                   latent=LatentKVCache(latent=latent, block_size=block_size))


MLA_DECODERS = {"absorbed": mla_decode_absorbed, "naive": mla_decode_naive}


# ---- decoder --------------------------------------------------------------------------------------

class KimiLinearReferenceDecoder:
    """Step-at-a-time greedy decoder; prefill runs as repeated decode steps."""

    def __init__(self, weights: KimiLinearWeights, compute_dtype: torch.dtype = torch.float32,
                 attention: str = "absorbed"):
        if attention not in MLA_DECODERS:
            raise ValueError(f"attention={attention!r} not in {sorted(MLA_DECODERS)}")
        self.weights = weights
        self.config = weights.config
        self.compute_dtype = compute_dtype
        self.mla = MLA_DECODERS[attention]
        # layer index -> index among the layers of its kind (cache row)
        self._kda_row = {layer: j for j, layer in enumerate(self.config.kda_layers)}
        self._mla_row = {layer: j for j, layer in enumerate(self.config.mla_layers)}

    def _w(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.compute_dtype)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self._w(w)).float()

    def _mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, gate_up).chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, down)

    def _moe(self, layer: KimiLinearLayerWeights, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, layer.router, layer.router_bias, self.config)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self._mlp(x[tok], layer.experts_gate_up[e], layer.experts_down[e])
            out.index_add_(0, tok, y * weights[tok, slot, None])
        if layer.shared_gate_up is not None:
            out = out + self._mlp(x, layer.shared_gate_up, layer.shared_down)
        return out

    def _kda(self, row: int, w: KDAWeights, x: torch.Tensor, cache: KDAStateCache, slots: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        B, nh, dk, D = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_dim
        u = self._linear(x, w.qkv)  # [B, 3D]
        window = torch.cat([cache.conv[row, slots], u[:, :, None]], dim=-1)  # [B, 3D, K]
        cache.conv[row, slots] = window[:, :, 1:]
        qkv = F.silu((window * w.conv.float()[None]).sum(dim=-1))
        q, k, v = (t.reshape(B, nh, dk) for t in qkv.split(D, dim=-1))
        g = kda_decay((self._linear(self._linear(x, w.f_a), w.f_b) + w.dt_bias.float()).view(B, nh, dk), w.A_log)
        beta = torch.sigmoid(self._linear(x, w.b_proj))
        q = l2norm(q) * dk ** -0.5
        k = l2norm(k)
        o, state = kda_recurrent_step(cache.recurrent[row, slots], q, k, v, g, beta)
        cache.recurrent[row, slots] = state
        gate = self._linear(self._linear(x, w.g_a), w.g_b).view(B, nh, dk)
        o = rms_norm(o, w.o_norm, cfg.rms_norm_eps) * torch.sigmoid(gate)
        return self._linear(o.reshape(B, D), w.o_proj)

    def _mla_attn(self, row: int, w: MLAWeights, x: torch.Tensor, positions: torch.Tensor, cache: LatentKVCache,
                  block_table: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        B, n, nope, c = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if w.q_proj is not None:
            q = self._linear(x, w.q_proj)
        else:
            q = self._linear(rms_norm(self._linear(x, w.q_a), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
        q = q.view(B, n, cfg.qk_head_dim)
        kv = self._linear(x, w.kv_a)
        c_kv = rms_norm(kv[:, :c], w.kv_a_norm, LATENT_NORM_EPS)
        latent = cache.latent[row]
        write_latent(latent, block_table, positions, torch.cat([c_kv, kv[:, c:]], dim=-1))  # NoPE: key unrotated
        o = self.mla(q[..., :nope], q[..., nope:], latent, block_table, positions + 1, self._w(w.w_uk),
                     self._w(w.w_uv), cfg.softmax_scale)
        return self._linear(o.reshape(B, n * cfg.v_head_dim), w.o_proj)

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,  # Long [B]
        positions: torch.Tensor,  # Long [B]
        cache: KimiLinearCache,
        block_table: torch.Tensor,  # int32 [B, max_blocks]
        slots: torch.Tensor | None = None,  # Long [B]: each sequence's KDA state slot (default 0..B-1)
    ) -> torch.Tensor:
        """One decode step for a batch. A sequence at position 0 starts from a zero KDA state (its slot is
        reset); MLA rows are written at `positions`. Returns float32 logits [B, V]."""
        cfg, w = self.config, self.weights
        dev = w.device
        tokens, positions, block_table = tokens.to(dev), positions.to(dev).long(), block_table.to(dev)
        slots = torch.arange(tokens.shape[0], device=dev) if slots is None else slots.to(dev).long()
        fresh = slots[positions == 0]
        if fresh.numel():
            cache.kda.reset(fresh)
        h = w.embed[tokens].float()
        for i, layer in enumerate(w.layers):
            x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
            if layer.kda is not None:
                h = h + self._kda(self._kda_row[i], layer.kda, x, cache.kda, slots)
            else:
                h = h + self._mla_attn(self._mla_row[i], layer.mla, x, positions, cache.latent, block_table)
            x = rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
            h = h + (self._moe(layer, x) if layer.is_moe else self._mlp(x, layer.gate_up, layer.down))
        return self._linear(rms_norm(h, w.final_norm, cfg.rms_norm_eps), w.lm_head)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                 cache_dtype: torch.dtype | None = None) -> GenerationResult:
        """Greedy decoding of a batch of prompts of different lengths, all in one batch per step (a sequence
        still in its prompt feeds its next prompt token, the others their last pick)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        dev = self.weights.device
        B = len(prompts)
        lens = [len(p) for p in prompts]
        block_table = contiguous_block_table(B, max(lens) + max_new_tokens, block_size, dev)
        cache = KimiLinearCache.allocate(self.config, B, block_table.numel(), block_size,
                                         dtype=cache_dtype or self.compute_dtype, device=dev)
        generated: list[list[int]] = [[] for _ in range(B)]
        picked: list[list[torch.Tensor]] = [[] for _ in range(B)]
        for t in range(max(lens) + max_new_tokens - 1):
            active = [b for b in range(B) if t <= lens[b] + max_new_tokens - 2]
            feed = [prompts[b][t] if t < lens[b] else generated[b][t - lens[b]] for b in active]
            idx = torch.tensor(active, dtype=torch.long, device=dev)
            logits = self.step(torch.tensor(feed, dtype=torch.long, device=dev),
                               torch.full((len(active),), t, dtype=torch.long, device=dev),
                               cache, block_table[idx], slots=idx)
            for row, b in enumerate(active):
                if t >= lens[b] - 1:
                    generated[b].append(int(logits[row].argmax()))
                    picked[b].append(logits[row].clone())
        return GenerationResult(tokens=generated, logits=[torch.stack(p) for p in picked])
