"""Torch reference decoder for DeepSeek-V3 / Kimi-K2: absorbed MLA over a paged latent cache + MoE.

Decode step of one layer, per token (n heads, c = kv_lora_rank, r = qk_rope_head_dim):

    x        = rms_norm(h, attn_norm)
    a        = qkv_a @ x                        -> [q part | latent c | rope key r]
    q        = q_b @ rms_norm(q part) (q LoRA) or the q part itself   -> per head [nope | rope]
    c_kv     = rms_norm(latent, kv_a_norm);  k_rope = rope(rope key);  q_rope = rope(q rope)
    cache[pos] = [c_kv | k_rope]                 (one latent_dim row per token, shared by all heads)
    q_lat[h] = W_UK[h]^T q_nope[h]               (absorbed: keys are never expanded)
    s[h, t]  = (q_lat[h] . c_kv[t] + q_rope[h] . k_rope[t]) * softmax_scale
    o[h]     = W_UV[h] @ sum_t softmax(s)[h, t] c_kv[t]
    h       += o_proj @ o
    h       += MLP(rms_norm(h, mlp_norm))        dense, or shared experts + routed top-k experts

Everything is computed in `compute_dtype` (float32 by default); the router always in float32.
`mla_decode_naive` expands K and V per head as transformers does; it is the check on the absorbed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..kv_cache import contiguous_block_table
from ..ops import apply_rope, rms_norm
from ..reference import GenerationResult
from .config import LATENT_NORM_EPS, DeepseekConfig
from .weights import DeepseekLayerWeights, DeepseekWeights

__all__ = [
    "DeepseekReferenceDecoder",
    "GenerationResult",
    "LatentKVCache",
    "apply_rope",
    "contiguous_block_table",
    "gather_latent",
    "mla_decode_absorbed",
    "mla_decode_naive",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "route",
    "write_latent",
]


# ---- rope (YaRN-aware; the generic ops live in model/ops.py) ----------------------------------------

def rope_inv_freq(config: DeepseekConfig) -> torch.Tensor:
    """float32 [qk_rope_head_dim // 2], as transformers computes it (default or YaRN)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / pos_freqs

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(ys.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(ys.beta_fast), correction_dim(ys.beta_slow)
    if ys.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (ys.factor * pos_freqs)
    return inv_inter * (1 - extrapolation) + inv_extra * extrapolation


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions Long [B] -> cos, sin float32 [B, rope_dim] (duplicated halves) times YaRN's attention factor,
    which transformers applies to cos and sin (so to both q_rope and k_rope)."""
    cos, sin = ops.rope_cos_sin(inv_freq, positions)
    return cos * attention_factor, sin * attention_factor


def route(
    x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, config: DeepseekConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc), exactly as transformers' DeepseekV3TopkRouter.

    x [T, H] (the normed hidden state) -> (weights float32 [T, k], expert ids int64 [T, k]).
    Sigmoid scores; e_score_correction_bias added for the choice only; groups ranked by the sum of
    their top-2 biased scores, the best topk_group kept; top-k among those; weights are the unbiased
    scores, renormalised when norm_topk_prob, times routed_scaling_factor.
    """
    T = x.shape[0]
    E, G = config.n_routed_experts, config.n_group
    logits = F.linear(x.float(), router.float())
    scores = logits.sigmoid()
    choice = scores + bias.float()
    group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask[:, :, None].expand(T, G, E // G).reshape(T, E).bool()
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, k=config.num_experts_per_tok, dim=-1)[1]
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


# ---- latent KV cache ------------------------------------------------------------------------------

@dataclass
class LatentKVCache:
    """Paged MLA cache: one row of [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)] per token.

    latent: [L, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]. Position p of sequence b
    lives in block block_table[b, p // block_size] at offset p % block_size. c_kv is stored after
    kv_a_layernorm, k_rope after rope (rotate-half order).
    """

    latent: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: DeepseekConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        fill: float = float("nan"),
    ) -> "LatentKVCache":
        latent = torch.full(
            (config.num_layers, num_blocks, block_size, config.latent_dim), fill, dtype=dtype, device=device
        )
        return cls(latent=latent, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[1]


def gather_latent(latent: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """latent [num_blocks, block_size, D] (one layer), block_row int [max_blocks] -> [seq_len, D]."""
    block_size = latent.shape[1]
    pos = torch.arange(seq_len, device=latent.device)
    blocks = block_row.to(latent.device).long()[pos // block_size]
    return latent[blocks, pos % block_size]


def write_latent(
    latent: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
) -> None:
    """latent [num_blocks, block_size, D] (one layer); rows [B, D] go to each sequence's `positions`."""
    block_size = latent.shape[1]
    pos = positions.to(latent.device).long()
    blocks = block_table.to(latent.device).long().gather(1, (pos // block_size)[:, None])[:, 0]
    latent[blocks, pos % block_size] = rows.to(latent.dtype)


# ---- MLA decode attention -------------------------------------------------------------------------

def mla_decode_absorbed(
    q_nope: torch.Tensor,  # [B, n, nope]
    q_rope: torch.Tensor,  # [B, n, r] (rope applied)
    latent: torch.Tensor,  # [num_blocks, block_size, c + r] (one layer)
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int [B], tokens incl. the current one
    w_uk: torch.Tensor,  # [n, nope, c]
    w_uv: torch.Tensor,  # [n, v, c]
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: attention in the latent space, W_UV applied after. Returns float32 [B, n, v]."""
    B, n, _ = q_nope.shape
    c = w_uk.shape[-1]
    w_uv = w_uv.float()
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope.float(), w_uk.float())  # [B, n, c]
    out = torch.empty(B, n, w_uv.shape[1], dtype=torch.float32, device=q_nope.device)
    for b, length in enumerate(seq_lens.tolist()):
        lat = gather_latent(latent, block_table[b], int(length)).float()  # [T, c + r]
        c_kv, k_rope = lat[:, :c], lat[:, c:]
        scores = (q_lat[b] @ c_kv.T + q_rope[b].float() @ k_rope.T) * scale  # [n, T]
        o_lat = torch.softmax(scores, dim=-1) @ c_kv  # [n, c]
        out[b] = torch.einsum("hc,hvc->hv", o_lat, w_uv)
    return out


def mla_decode_naive(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Non-absorbed MLA decode: expand per-head keys [k_nope | k_rope] and values from the latent
    (what transformers does), then plain attention. Same arguments and result as mla_decode_absorbed."""
    B, n, _ = q_nope.shape
    c, r = w_uk.shape[-1], q_rope.shape[-1]
    out = torch.empty(B, n, w_uv.shape[1], dtype=torch.float32, device=q_nope.device)
    for b, length in enumerate(seq_lens.tolist()):
        lat = gather_latent(latent, block_table[b], int(length)).float()
        c_kv, k_rope = lat[:, :c], lat[:, c:]
        k_nope = torch.einsum("tc,hdc->htd", c_kv, w_uk.float())  # [n, T, nope]
        v = torch.einsum("tc,hvc->htv", c_kv, w_uv.float())  # [n, T, v]
        k = torch.cat([k_nope, k_rope[None].expand(n, -1, r)], dim=-1)  # [n, T, nope + r]
        q = torch.cat([q_nope[b].float(), q_rope[b].float()], dim=-1)  # [n, nope + r]
        probs = torch.softmax(torch.einsum("hd,htd->ht", q, k) * scale, dim=-1)
        out[b] = torch.einsum("ht,htv->hv", probs, v)
    return out


MLA_DECODERS = {"absorbed": mla_decode_absorbed, "naive": mla_decode_naive}


# ---- decoder --------------------------------------------------------------------------------------

class DeepseekReferenceDecoder:
    """Step-at-a-time greedy decoder over a paged latent cache; prefill runs as repeated decode steps."""

    def __init__(
        self, weights: DeepseekWeights, compute_dtype: torch.dtype = torch.float32, attention: str = "absorbed"
    ):
        if attention not in MLA_DECODERS:
            raise ValueError(f"attention={attention!r} not in {sorted(MLA_DECODERS)}")
        self.weights = weights
        self.config = weights.config
        self.compute_dtype = compute_dtype
        self.mla = MLA_DECODERS[attention]
        self.inv_freq = rope_inv_freq(self.config).to(weights.device)

    def _w(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.compute_dtype)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self._w(w)).float()

    def _mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gu = self._linear(x, gate_up)
        gate, up = gu.chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, down)

    def _attention(
        self,
        layer_idx: int,
        layer: DeepseekLayerWeights,
        x: torch.Tensor,  # [B, H] normed
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: LatentKVCache,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        B, n, nope, r, c = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        a = self._linear(x, layer.qkv_a)  # [B, q_a_rows + c + r]
        q = a[:, : cfg.q_a_rows]
        if cfg.q_lora_rank is not None:
            q = self._linear(rms_norm(q, layer.q_a_norm, LATENT_NORM_EPS), layer.q_b)
        q = q.view(B, n, nope + r)
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], cos, sin)
        c_kv = rms_norm(a[:, cfg.q_a_rows : cfg.q_a_rows + c], layer.kv_a_norm, LATENT_NORM_EPS)
        k_rope = apply_rope(a[:, None, cfg.q_a_rows + c :], cos, sin)[:, 0]
        latent = cache.latent[layer_idx]
        write_latent(latent, block_table, positions, torch.cat([c_kv, k_rope], dim=-1))
        o = self.mla(q_nope, q_rope, latent, block_table, positions + 1, self._w(layer.w_uk), self._w(layer.w_uv),
                     cfg.softmax_scale)
        return self._linear(o.reshape(B, n * cfg.v_head_dim), layer.o_proj)

    def _moe(self, layer: DeepseekLayerWeights, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, layer.router, layer.router_bias, self.config)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self._mlp(x[tok], layer.experts_gate_up[e], layer.experts_down[e])
            out.index_add_(0, tok, y * weights[tok, slot, None])
        if layer.shared_gate_up is not None:
            out = out + self._mlp(x, layer.shared_gate_up, layer.shared_down)
        return out

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,  # Long [B]
        positions: torch.Tensor,  # Long [B]
        cache: LatentKVCache,
        block_table: torch.Tensor,  # int32 [B, max_blocks]
    ) -> torch.Tensor:
        """One decode step: writes each token's latent row at `positions`, attends over 0..pos.
        Returns float32 logits [B, V]."""
        cfg, w = self.config, self.weights
        dev = w.device
        tokens, positions, block_table = tokens.to(dev), positions.to(dev).long(), block_table.to(dev)
        h = w.embed[tokens].float()
        cos, sin = rope_cos_sin(self.inv_freq, positions, cfg.rope_attention_factor)
        for i, layer in enumerate(w.layers):
            x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
            h = h + self._attention(i, layer, x, cos, sin, positions, cache, block_table)
            x = rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
            h = h + (self._moe(layer, x) if layer.is_moe else self._mlp(x, layer.gate_up, layer.down))
        return self._linear(rms_norm(h, w.final_norm, cfg.rms_norm_eps), w.lm_head)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        block_size: int = 16,
        cache_dtype: torch.dtype | None = None,
    ) -> GenerationResult:
        """Greedy decoding of a batch of prompts of different lengths, all in one batch per step
        (a sequence still in its prompt feeds the next prompt token, the others their last pick)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        dev = self.weights.device
        B = len(prompts)
        lens = [len(p) for p in prompts]
        max_seq = max(lens) + max_new_tokens
        block_table = contiguous_block_table(B, max_seq, block_size, dev)
        cache = LatentKVCache.allocate(
            self.config, block_table.numel(), block_size, dtype=cache_dtype or self.compute_dtype, device=dev
        )
        generated: list[list[int]] = [[] for _ in range(B)]
        picked: list[list[torch.Tensor]] = [[] for _ in range(B)]
        for t in range(max(lens) + max_new_tokens - 1):
            active = [b for b in range(B) if t <= lens[b] + max_new_tokens - 2]
            feed = [prompts[b][t] if t < lens[b] else generated[b][t - lens[b]] for b in active]
            logits = self.step(
                torch.tensor(feed, dtype=torch.long, device=dev),
                torch.full((len(active),), t, dtype=torch.long, device=dev),
                cache,
                block_table[active],
            )
            for row, b in enumerate(active):
                if t >= lens[b] - 1:
                    generated[b].append(int(logits[row].argmax()))
                    picked[b].append(logits[row].clone())
        return GenerationResult(tokens=generated, logits=[torch.stack(p) for p in picked])
