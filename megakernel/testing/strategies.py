"""Hypothesis strategies for the dense decode shapes the megakernel accepts, and for seeds.

Edges are drawn on purpose: a KV length of 1, lengths at block-size boundaries (block_size - 1,
block_size, block_size + 1, ...), the cache limit itself, RoPE positions 0 and max - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


# -- shapes the kernel accepts, for single-stage tests -------------------------------------------------------

BLOCK_SIZES = (4, 8, 16, 32)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class StageCase:
    """One single-stage test: a decode shape the kernel accepts, the model around it, the KV split count,
    which layer the instruction runs in, and the seed of every random tensor (weights and buffers)."""

    shape: DecodeShape
    architecture: str
    num_layers: int
    layer: int
    vocab_size: int
    kv_splits: int
    seed: int
    # axes real checkpoints vary (drawn: an injected bug that only shows on one of them must show here)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: object = None        # a model.config.RopeScaling or None
    tie_word_embeddings: bool = False

    def to_config(self):
        return self.shape.to_config(architecture=self.architecture, num_layers=self.num_layers,
                                    vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                                    rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                    tie_word_embeddings=self.tie_word_embeddings)

    def describe(self) -> str:
        """Everything needed to rebuild the case, for failure messages."""
        s = self.shape
        return (f"{self.architecture} H={s.hidden_size} F={s.intermediate_size} heads={s.num_heads}/"
                f"{s.num_kv_heads} D={s.head_dim} V={self.vocab_size} L={self.num_layers} layer={self.layer} "
                f"B={s.batch} kv_lens={s.kv_lens} block={s.block_size} max_seq={s.max_seq_len} "
                f"splits={self.kv_splits} eps={self.rms_norm_eps} theta={self.rope_theta} "
                f"rope_scaling={self.rope_scaling} tied={self.tie_word_embeddings} seed={self.seed}")


def _accepted_head_counts(head_dim: int, max_heads: int, col_pass: int = 256) -> list[tuple[int, int]]:
    """(kv heads, GQA ratio) pairs whose query width num_heads * head_dim is a whole number of column passes."""
    return [(k, r) for k in KV_HEADS for r in GQA_RATIOS
            if k * r <= max_heads and (k * r * head_dim) % col_pass == 0]


@st.composite
def kernel_decode_shapes(draw, max_hidden: int = 4096, max_intermediate: int | None = None, head_dims=HEAD_DIMS,
                         max_heads: int = 64, max_batch: int = 8, max_blocks: int = 16,
                         block_sizes=BLOCK_SIZES, min_batch: int = 1) -> DecodeShape:
    """Decode shapes StepLayout.validate accepts: hidden and intermediate multiples of 256, query width
    (heads x head_dim) a multiple of 256, GQA ratio <= 8, head_dim 64/128, batch min_batch..max_batch. The cache holds
    a whole number of blocks (max_seq_len = block_size x blocks), so a KV length of max_seq_len puts the
    decoded token at the cache limit - 1; KV lengths 1 and block edges are drawn often."""
    block_size = draw(st.sampled_from(tuple(block_sizes)))
    max_seq_len = block_size * draw(st.integers(1, max_blocks))
    head_dim = draw(st.sampled_from(tuple(head_dims)))
    kv_heads, ratio = draw(st.sampled_from(_accepted_head_counts(head_dim, max_heads)))
    hidden = 256 * draw(st.integers(1, max_hidden // 256))
    max_f = max_intermediate if max_intermediate is not None else 4 * max_hidden
    intermediate = 256 * draw(st.integers(1, max_f // 256))
    batch = draw(st.integers(min_batch, max_batch))
    kv_lens = tuple(draw(st.lists(kv_lengths(max_seq_len, block_size), min_size=batch, max_size=batch)))
    return DecodeShape(hidden_size=hidden, num_heads=kv_heads * ratio, num_kv_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=intermediate, batch=batch, kv_lens=kv_lens, block_size=block_size,
                       max_seq_len=max_seq_len)


@dataclass(frozen=True)
class ModelAxes:
    """The config fields real checkpoints vary beyond the layer shapes: an injected bug that only shows on one
    of them must show in the tests that draw them (stage, VM and end-to-end)."""

    architecture: str               # Llama, or Qwen3 with QK-norm
    vocab_size: int                 # any multiple of 8, so the LM head's tiles have ragged ends
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: object            # a model.config.RopeScaling or None
    tie_word_embeddings: bool

    def apply(self, config):
        """`config` (a ModelConfig) with these fields (QK-norm follows the architecture)."""
        return replace(config, architecture=self.architecture, qk_norm=self.architecture == "Qwen3ForCausalLM",
                       vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                       rope_scaling=self.rope_scaling, tie_word_embeddings=self.tie_word_embeddings)


@st.composite
def model_axes(draw, max_vocab: int = 4096, min_vocab: int = 8) -> ModelAxes:
    """Llama or Qwen3; a vocabulary that is any multiple of 8 in [min_vocab, max_vocab]; rms_norm_eps 1e-5 /
    1e-6 / 1e-2; rope_theta 1e4 / 5e5 / 1e6; no RoPE scaling, llama3 scaling (with its frequency bands inside a
    short cache, or Llama 3.2's) or linear; tied or untied embeddings."""
    from megakernel.model.config import RopeScaling

    scaling = draw(st.sampled_from([None, RopeScaling("llama3", 8.0, 1.0, 4.0, 8),
                                    RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), RopeScaling("linear", 2.0)]))
    return ModelAxes(architecture=draw(st.sampled_from(ARCHITECTURES)),
                     vocab_size=8 * draw(st.integers(-(-min_vocab // 8), max_vocab // 8)),
                     rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6, 1e-2])),
                     rope_theta=draw(st.sampled_from([10000.0, 500000.0, 1e6])), rope_scaling=scaling,
                     tie_word_embeddings=draw(st.booleans()))


@st.composite
def stage_cases(draw, max_hidden: int = 4096, max_intermediate: int | None = None, max_heads: int = 64,
                max_batch: int = 8, max_blocks: int = 16, max_vocab: int = 4096, max_splits: int = 8,
                min_batch: int = 1) -> StageCase:
    """A StageCase over `kernel_decode_shapes` and `model_axes`: 1-2 layers (the instruction in either),
    1..max_splits KV splits."""
    shape = draw(kernel_decode_shapes(max_hidden=max_hidden, max_intermediate=max_intermediate,
                                      max_heads=max_heads, max_batch=max_batch, max_blocks=max_blocks,
                                      min_batch=min_batch))
    num_layers = draw(st.integers(1, 2))
    axes = draw(model_axes(max_vocab=max_vocab))
    return StageCase(shape=shape, architecture=axes.architecture, num_layers=num_layers,
                     layer=draw(st.integers(0, num_layers - 1)), vocab_size=axes.vocab_size,
                     kv_splits=draw(st.integers(1, max_splits)), seed=draw(seeds()),
                     rms_norm_eps=axes.rms_norm_eps, rope_theta=axes.rope_theta, rope_scaling=axes.rope_scaling,
                     tie_word_embeddings=axes.tie_word_embeddings)


@dataclass(frozen=True)
class LayoutRequest:
    """A step layout as a caller might ask for it, supported or not (for rejection tests)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    batch: int


@st.composite
def layout_requests(draw) -> LayoutRequest:
    """Shapes on both sides of every StepLayout limit: hidden/intermediate multiples of 64 (some not of 256),
    head_dim 32..256 (96 included), GQA ratios up to 16, vocabularies not a multiple of 8, batch 0..10."""
    head_dim = draw(st.sampled_from((32, 64, 96, 128, 256)))
    kv_heads = draw(st.sampled_from((1, 2, 4, 8)))
    ratio = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
    return LayoutRequest(hidden_size=64 * draw(st.integers(1, 24)), intermediate_size=64 * draw(st.integers(1, 48)),
                         num_heads=kv_heads * ratio, num_kv_heads=kv_heads, head_dim=head_dim,
                         vocab_size=draw(st.integers(8, 600)), batch=draw(st.integers(0, 10)))
