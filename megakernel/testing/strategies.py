"""Hypothesis strategies for the dense decode shapes the megakernel accepts, and for seeds.

Edges are drawn on purpose: a KV length of 1, lengths at block-size boundaries (block_size - 1,
block_size, block_size + 1, ...), the cache limit itself, RoPE positions 0 and max - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

HEAD_DIMS = (64, 128)
KV_HEADS = (1, 2, 4, 8)
GQA_RATIOS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DecodeShape:
    """One decode step's shapes: model dimensions, batch and each sequence's KV length (incl. the new token)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    batch: int
    kv_lens: tuple[int, ...]      # one per sequence, 1..max_seq_len
    block_size: int
    max_seq_len: int

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def positions(self) -> tuple[int, ...]:
        """Position of the token being decoded in each sequence (kv_len - 1)."""
        return tuple(n - 1 for n in self.kv_lens)

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def to_config(self, architecture: str = "LlamaForCausalLM", num_layers: int = 1, vocab_size: int = 512,
                  **overrides):
        """A ModelConfig with these dimensions (Qwen3 architecture gets QK-norm)."""
        from megakernel.model.config import ModelConfig

        fields = dict(
            architecture=architecture, hidden_size=self.hidden_size, num_layers=num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, vocab_size=vocab_size, tie_word_embeddings=False,
            rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
            qk_norm=architecture == "Qwen3ForCausalLM", max_position_embeddings=self.max_seq_len,
            name="hypothesis")
        fields.update(overrides)
        return ModelConfig(**fields)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for torch.Generator / random_weights."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def kv_lengths(max_seq_len: int, block_size: int = 16) -> st.SearchStrategy[int]:
    """KV lengths in [1, max_seq_len], weighted toward 1, block boundaries and the cache limit."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    edges = sorted({n for k in (1, 2, 3) for n in (k * block_size - 1, k * block_size, k * block_size + 1)
                    if 1 <= n <= max_seq_len})
    options = [st.just(1), st.just(max_seq_len), st.integers(1, max_seq_len)]
    if edges:
        options.insert(1, st.sampled_from(edges))
    return st.one_of(*options)


def rope_positions(max_position: int) -> st.SearchStrategy[int]:
    """RoPE positions in [0, max_position), with 0, 1 and max_position - 1 drawn often."""
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    return st.one_of(st.sampled_from(sorted({0, min(1, max_position - 1), max_position - 1})),
                     st.integers(0, max_position - 1))


@st.composite
def decode_shapes(draw, hidden_multiple: int = 256, max_hidden: int = 4096, head_dims=HEAD_DIMS,
                  max_heads: int = 64, max_batch: int = 8, max_seq_len: int = 4096,
                  block_size: int = 16) -> DecodeShape:
    """Dense decode shapes: hidden a multiple of `hidden_multiple`, GQA ratios 1-8, head_dim from `head_dims`,
    batch 1..max_batch, a KV length per sequence from `kv_lengths` (1, block edges, the cache limit)."""
    if max_hidden < hidden_multiple:
        raise ValueError(f"max_hidden={max_hidden} is below hidden_multiple={hidden_multiple}")
    hidden = hidden_multiple * draw(st.integers(1, max_hidden // hidden_multiple))
    intermediate = hidden_multiple * draw(st.integers(1, 4 * max_hidden // hidden_multiple))
    kv_heads = draw(st.sampled_from([k for k in KV_HEADS if k <= max_heads]))
    ratio = draw(st.sampled_from([r for r in GQA_RATIOS if kv_heads * r <= max_heads]))
    head_dim = draw(st.sampled_from(tuple(head_dims)))
    batch = draw(st.integers(1, max_batch))
    kv_lens = tuple(draw(st.lists(kv_lengths(max_seq_len, block_size), min_size=batch, max_size=batch)))
    return DecodeShape(hidden_size=hidden, num_heads=kv_heads * ratio, num_kv_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=intermediate, batch=batch, kv_lens=kv_lens, block_size=block_size,
                       max_seq_len=max_seq_len)
