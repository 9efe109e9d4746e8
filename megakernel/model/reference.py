"""Torch reference decoder: one token per sequence per step, over the paged KV cache.

It is the ground truth for the schedule VM and the kernel: same weights, same cache layout, same
op order (RMSNorm -> fused QKV -> QK-norm -> RoPE -> cache append -> paged attention -> O + residual
-> RMSNorm -> fused gate/up -> SiLU*up -> down + residual; final norm -> LM head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import PagedKVCache, contiguous_block_table
from .ops import apply_rope, paged_attention_decode, rms_norm, rope_cos_sin, rope_inv_freq, silu_and_mul
from .weights import ModelWeights


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per sequence: the generated tokens only (not the prompt)
    logits: list[torch.Tensor] | None  # per sequence: float32 [max_new_tokens, V], row t chose tokens[b][t]

    def top2_gaps(self, b: int) -> torch.Tensor:
        """float32 [steps]: top-1 minus top-2 logit at each step of sequence b (small = near-tie)."""
        if self.logits is None:
            raise ValueError("generate(..., return_logits=False) kept no logits")
        top2 = self.logits[b].topk(2, dim=-1).values
        return top2[:, 0] - top2[:, 1]


class ReferenceDecoder:
    def __init__(self, weights: ModelWeights, compute_dtype: torch.dtype = torch.float32):
        self.config = weights.config
        self.compute_dtype = compute_dtype
        # Upcast once: the reference reads the (e.g. bf16) weights exactly, computes in compute_dtype.
        self.weights = weights.to(dtype=compute_dtype)
        self.device = self.weights.device
        self.inv_freq = rope_inv_freq(self.config).to(device=self.device, dtype=compute_dtype)
        self.scale = self.config.head_dim ** -0.5

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,  # Long [B]
        positions: torch.Tensor,  # Long [B]
        cache: PagedKVCache,
        block_table: torch.Tensor,  # int32 [B, max_blocks]
    ) -> torch.Tensor:
        """Run one decode step; writes this token's K (after QK-norm and RoPE) and V into `cache`
        at `positions` and attends over positions 0..pos. Returns float32 logits [B, V]."""
        cfg, w = self.config, self.weights
        b = tokens.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tokens = tokens.to(self.device)
        positions = positions.to(device=self.device, dtype=torch.long)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        seq_lens = positions + 1
        cdt = self.compute_dtype  # ops return float32; cast back so a bf16 compute_dtype stays bf16

        x = w.embed[tokens]  # [B, H]
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps).to(cdt)
            qkv = h @ lw.qkv.t()
            q = qkv[:, :cfg.q_size].reshape(b, hq, d)
            k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(b, hkv, d)
            v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(b, hkv, d)
            if cfg.qk_norm:
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps).to(cdt)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps).to(cdt)
            q = apply_rope(q, cos, sin).to(cdt)
            k = apply_rope(k, cos, sin).to(cdt)
            cache.write(layer, block_table, positions, k, v)
            attn = paged_attention_decode(q, cache.k[layer], cache.v[layer], block_table, seq_lens, self.scale)
            x = x + attn.reshape(b, cfg.q_size).to(cdt) @ lw.o_proj.t()
            h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps).to(cdt)
            gu = h @ lw.gate_up.t()
            f = cfg.intermediate_size
            x = x + silu_and_mul(gu[:, :f], gu[:, f:]).to(cdt) @ lw.down.t()
        x = rms_norm(x, w.final_norm, cfg.rms_norm_eps).to(cdt)
        return (x @ w.lm_head.t()).float()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        cache: PagedKVCache | None = None,
        block_table: torch.Tensor | None = None,
        block_size: int = 16,
        cache_dtype: torch.dtype | None = None,
        return_logits: bool = True,
    ) -> GenerationResult:
        """Greedy generation of `max_new_tokens` per prompt. The prompts are fed one token per step
        (each sequence at its own position); once every prompt is in, all sequences decode together,
        each at its own position. Without `cache`, one of `cache_dtype` (default: compute dtype) is
        allocated with a contiguous block table."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        cfg = self.config
        batch = len(prompts)
        lens = [len(p) for p in prompts]
        total = max(lens) + max_new_tokens
        if cache is None:
            block_table = contiguous_block_table(batch, total, block_size, self.device)
            cache = PagedKVCache.allocate(cfg, batch * block_table.shape[1], block_size,
                                          dtype=cache_dtype or self.compute_dtype, device=self.device)
        elif block_table is None:
            raise ValueError("a cache was given without its block_table")
        if block_table.shape[1] * cache.block_size < total:
            raise ValueError(f"block_table [{tuple(block_table.shape)}] with block size {cache.block_size} "
                             f"holds fewer than {total} tokens")

        # Prefill: every prompt token but the last, for the sequences that still have one.
        for s in range(max(lens) - 1):
            rows = [i for i in range(batch) if s < lens[i] - 1]
            self._step_rows(rows, [prompts[i][s] for i in rows], [s] * len(rows), cache, block_table)

        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        current = [p[-1] for p in prompts]
        rows = list(range(batch))
        for t in range(max_new_tokens):
            logits = self._step_rows(rows, current, [lens[i] - 1 + t for i in rows], cache, block_table)
            nxt = logits.argmax(dim=-1).tolist()
            for i in rows:
                out_tokens[i].append(nxt[i])
                if return_logits:
                    out_logits[i].append(logits[i].cpu())
            current = nxt
        return GenerationResult(
            tokens=out_tokens,
            logits=[torch.stack(rows_) for rows_ in out_logits] if return_logits else None,
        )

    def _step_rows(self, rows: list[int], tokens: list[int], positions: list[int],
                   cache: PagedKVCache, block_table: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(rows, dtype=torch.long, device=block_table.device)
        return self.step(
            torch.tensor(tokens, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            cache,
            block_table.index_select(0, idx),
        )
