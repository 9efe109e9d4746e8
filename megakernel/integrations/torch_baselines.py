"""The plain torch decode step that the megakernel is measured against (BASELINES.md), run three ways.

One step: embedding, then per layer RMSNorm -> fused QKV matmul -> (QK-norm) -> RoPE -> append K,V to a
static contiguous cache [B, Hkv, S, D] -> SDPA over the whole cache under a mask -> O matmul + residual
-> RMSNorm -> fused gate/up matmul -> SiLU*up -> down matmul + residual; final norm, LM head, greedy
argmax on the device. No host sync and no shape change between steps, so a step can be captured:

- "eager": the ops launched one at a time (CPU or CUDA);
- "graph": one step captured in a torch.cuda.CUDAGraph with static input buffers, replayed per step;
- "compile": the step through torch.compile (default mode, or e.g. "max-autotune-no-cudagraphs"),
  then captured in a CUDA graph the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.integrations.backends import BackendUnavailable
from megakernel.model import ops
from megakernel.model.config import ModelConfig
from megakernel.model.weights import ModelWeights

MODES = ("eager", "graph", "compile")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does it: statistics in float32, result back in the activation dtype, then the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchDecodeStep:
    """A dense Llama/Qwen3 decode step in plain torch ops over a static KV cache.

    `step(tokens [B], positions [B]) -> next tokens [B]` (int64, on `device`); `last_logits()` gives
    the float32 logits [B, V] of the last step. The tensor `step` returns is overwritten by the next
    step in the graph modes: consume or copy it first.
    """

    def __init__(self, weights: ModelWeights, device: torch.device | str = "cpu", mode: str = "eager",
                 dtype: torch.dtype | None = None, compile_mode: str | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = torch.device(device)
        if mode != "eager" and device.type != "cuda":
            raise BackendUnavailable(f"the torch '{mode}' baseline captures a CUDA graph and needs a CUDA "
                                      f"device; got device {device}")
        config: ModelConfig = weights.config
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads={config.num_heads} is not a multiple of num_kv_heads={config.num_kv_heads}")
        self.config = config
        self.device = device
        self.mode = mode
        self.compile_mode = compile_mode
        self.weights = weights.to(device=device, dtype=dtype)
        self.dtype = self.weights.embed.dtype
        self.name = {"eager": "torch-eager", "graph": "torch-graph", "compile": "torch-compile"}[mode]
        self.batch = 0
        self.max_seq_len = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    # -- buffers ---------------------------------------------------------------------------------
    def reset(self, batch: int, max_seq_len: int) -> None:
        """Allocate a zeroed cache for `batch` sequences of up to `max_seq_len` tokens (and capture a graph)."""
        cfg = self.config
        if batch < 1 or max_seq_len < 1:
            raise ValueError(f"need batch >= 1 and max_seq_len >= 1, got {batch}, {max_seq_len}")
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} is past max_position_embeddings="
                             f"{cfg.max_position_embeddings} of {cfg.name}")
        self.batch, self.max_seq_len = batch, max_seq_len
        self._graph = None
        dev, dt = self.device, self.dtype
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        # Zeros, not NaN: masked slots get softmax weight 0, and 0 * NaN would still poison the output.
        self.k_cache = torch.zeros(shape, dtype=dt, device=dev)
        self.v_cache = torch.zeros(shape, dtype=dt, device=dev)
        cos, sin = ops.rope_cos_sin(ops.rope_inv_freq(cfg), torch.arange(max_seq_len, dtype=torch.long))
        self._cos = cos.to(device=dev, dtype=dt)          # [S, D]
        self._sin = sin.to(device=dev, dtype=dt)          # [S, D]
        self._kv_index = torch.arange(max_seq_len, device=dev)
        self._batch_index = torch.arange(batch, device=dev)
        self._static_tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self._static_positions = torch.zeros(batch, dtype=torch.long, device=dev)
        if self.mode != "eager":
            self._capture()

    def _capture(self) -> None:
        fn = self._forward
        if self.mode == "compile":
            kwargs = {} if self.compile_mode in (None, "default") else {"mode": self.compile_mode}
            fn = torch.compile(self._forward, fullgraph=True, **kwargs)
        # Warm up on a side stream (allocator pools, cuBLAS handles, compilation), then capture one step.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(self._static_tokens, self._static_positions)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._static_next, self._static_logits = fn(self._static_tokens, self._static_positions)
        self._graph = graph
        # The warm-up wrote K,V into slot 0 of every sequence; start from a clean cache.
        self.k_cache.zero_()
        self.v_cache.zero_()

    # -- the step --------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, w = self.config, self.weights
        eps = cfg.rms_norm_eps
        batch, hq, hkv, d = tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = hq // hkv
        x = F.embedding(tokens, w.embed)                                 # [B, H]
        cos = self._cos.index_select(0, positions)[:, None, :]            # [B, 1, D]
        sin = self._sin.index_select(0, positions)[:, None, :]            # [B, 1, D]
        mask = (self._kv_index[None, :] <= positions[:, None])[:, None, None, :]   # [B, 1, 1, S]
        bidx = self._batch_index
        for layer, lw in enumerate(w.layers):
            h = _rms_norm(x, lw.attn_norm, eps)
            q, k, v = F.linear(h, lw.qkv).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(batch, hq, d)
            k = k.reshape(batch, hkv, d)
            v = v.reshape(batch, hkv, d)
            if cfg.qk_norm:
                q = _rms_norm(q, lw.q_norm, eps)
                k = _rms_norm(k, lw.k_norm, eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # [B, Hkv, S, D]
            k_cache[bidx, :, positions] = k
            v_cache[bidx, :, positions] = v
            # GQA without repeating K/V: the `group` query heads of a kv head act as `group` query rows.
            attn = F.scaled_dot_product_attention(q.reshape(batch, hkv, group, d), k_cache, v_cache,
                                                  attn_mask=mask, scale=d ** -0.5)   # [B, Hkv, G, D]
            x = x + F.linear(attn.reshape(batch, hq * d), lw.o_proj)
            h = _rms_norm(x, lw.mlp_norm, eps)
            gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.down)
        logits = F.linear(_rms_norm(x, w.final_norm, eps), w.lm_head).float()   # [B, V]
        return logits.argmax(dim=-1), logits

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decode one token per sequence: tokens/positions int64 [B] on the device -> next tokens [B]."""
        if not self.batch:
            raise RuntimeError(f"{self.name}: call reset(batch, max_seq_len) before step()")
        if self._graph is None:
            next_tokens, self._logits = self._forward(tokens, positions)
            return next_tokens
        self._static_tokens.copy_(tokens)
        self._static_positions.copy_(positions)
        self._graph.replay()
        self._logits = self._static_logits
        return self._static_next

    def last_logits(self) -> torch.Tensor | None:
        """Float32 logits [B, V] of the last step (None before the first)."""
        return self._logits
