"""A dense model split for tensor parallelism: the shape of one rank's share and its weights.

Rank r of `world_size` owns whole attention heads and a contiguous slice of the FFN and of the vocabulary:

| matrix   | split by                         | rank r holds                                                    |
|----------|----------------------------------|-----------------------------------------------------------------|
| qkv      | output rows (heads)              | q rows of heads [r*Hq/W, (r+1)*Hq/W), k and v rows of kv heads  |
|          |                                  | [r*Hkv/W, (r+1)*Hkv/W): the kv heads those query heads read      |
| o_proj   | input columns (the same heads)   | columns of its query heads: a partial sum of all H output rows  |
| gate_up  | output rows                      | gate and up rows [r*F/W, (r+1)*F/W)                              |
| down     | input columns                    | the same F/W columns: a partial sum of all H output rows        |
| lm_head  | output rows (vocabulary)         | rows [r*V/W, (r+1)*V/W)                                          |
| embed, norms | replicated                   | all of them (every rank holds the whole residual stream)        |

Each shard is a ModelWeights in the usual packed layout (qkv = q | k | v rows, gate_up = gate | up rows) over
the rank's ModelConfig (`shard_config`), so `pack_weights` turns it into the rows the rank's kernel streams, in
the order it streams them. The shard config describes the rank's matrices: num_heads, num_kv_heads and
intermediate_size are the rank's, vocab_size is the rank's LM head rows; the embedding table stays whole
(tokens are vocabulary ids), so a shard is never tied.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights

# The GPUs of one NVLink host that peer-to-peer stores reach.
SUPPORTED_WORLD_SIZES = (1, 2, 4, 8)
# What a rank splits, and why each must divide: the message names the field.
SPLIT_FIELDS = {
    "num_heads": "every rank owns whole query heads",
    "num_kv_heads": "every rank owns whole kv heads (and the query heads that read them)",
    "intermediate_size": "every rank owns an equal slice of the FFN",
    "vocab_size": "every rank owns an equal slice of the LM head rows",
}


def check_world_size(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the field, unless `config` splits into `world_size` equal shards."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size not in SUPPORTED_WORLD_SIZES:
        raise ValueError(f"world_size={world_size!r} is not supported: {SUPPORTED_WORLD_SIZES} "
                         f"(the GPUs of one NVLink host)")
    for name, why in SPLIT_FIELDS.items():
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(f"{name}={value} of {config.name} is not divisible by world_size={world_size}: {why}")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The ModelConfig of one rank's share (the same for every rank): the whole hidden size, a 1/world_size
    slice of the heads, the FFN and the vocabulary (see the module docstring)."""
    check_world_size(config, world_size)
    w = world_size
    return dataclasses.replace(config, num_heads=config.num_heads // w, num_kv_heads=config.num_kv_heads // w,
                               intermediate_size=config.intermediate_size // w, vocab_size=config.vocab_size // w,
                               tie_word_embeddings=False, name=f"{config.name} tp{w} shard")


def shard_weights(weights: ModelWeights, world_size: int) -> list[ModelWeights]:
    """`weights` split into world_size shards, rank order: each a ModelWeights over `shard_config` holding
    its rows and columns as contiguous copies (embedding and norms shared, not copied)."""
    c = weights.config
    sc = shard_config(c, world_size)
    qs, kvs, fs, vs = sc.q_size, sc.kv_size, sc.intermediate_size, sc.vocab_size
    shards = []
    for r in range(world_size):
        layers = []
        for lw in weights.layers:
            q = lw.qkv[r * qs:(r + 1) * qs]
            k = lw.qkv[c.q_size + r * kvs:c.q_size + (r + 1) * kvs]
            v = lw.qkv[c.q_size + c.kv_size + r * kvs:c.q_size + c.kv_size + (r + 1) * kvs]
            gate = lw.gate_up[r * fs:(r + 1) * fs]
            up = lw.gate_up[c.intermediate_size + r * fs:c.intermediate_size + (r + 1) * fs]
            layers.append(LayerWeights(
                attn_norm=lw.attn_norm, qkv=_cat_rows(q, k, v), q_norm=lw.q_norm, k_norm=lw.k_norm,
                o_proj=lw.o_proj[:, r * qs:(r + 1) * qs].contiguous(), mlp_norm=lw.mlp_norm,
                gate_up=_cat_rows(gate, up), down=lw.down[:, r * fs:(r + 1) * fs].contiguous()))
        shards.append(ModelWeights(config=sc, embed=weights.embed, layers=layers, final_norm=weights.final_norm,
                                   lm_head=weights.lm_head[r * vs:(r + 1) * vs].clone(),
                                   meta={**weights.meta, "rank": r, "world_size": world_size}))
    return shards


def _cat_rows(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=0).contiguous()
