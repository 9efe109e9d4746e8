"""What the Kimi Linear KDA stages share: the row layout of the fused input projection, the channels
and state regions of a head group, and the head group of an instruction.

Fused projection of one KDA layer (`kda_in[l]`, rows, D = linear_num_heads * dk, nh heads):

    [q (D) | k (D) | v (D) | f_a (dk) | g_a (dk) | beta (nh) | zero rows up to a ROW_GROUP multiple]

q, k, v in the short convolution's channel order (q_proj, k_proj, v_proj rows), so channel i of the
convolution is row i; f_a and g_a are the low-rank halves of the forget and output gates (their f_b,
g_b halves are per head and applied by KDA_STATE), beta the rows of b_proj.
"""

from __future__ import annotations

from ..layout import ROW_GROUP


def kda_offsets(config) -> dict[str, int]:
    """First row of each part of the fused projection."""
    D, dk = config.kda_dim, config.linear_head_dim
    return {"q": 0, "k": D, "v": 2 * D, "f_a": 3 * D, "g_a": 3 * D + dk, "beta": 3 * D + 2 * dk}


def kda_proj_rows(config) -> int:
    """Rows of the fused projection, padded to a multiple of ROW_GROUP."""
    used = 3 * config.kda_dim + 2 * config.linear_head_dim + config.linear_num_heads
    return -(-used // ROW_GROUP) * ROW_GROUP


def head_range(ins, layout) -> range:
    """The heads of a KDA_STATE instruction: [a1 * g, (a1 + 1) * g), g = layout.kda_head_group."""
    g = layout.kda_head_group
    return range(ins.a1 * g, (ins.a1 + 1) * g)


def channel_spans(config, heads: range) -> list[tuple[int, int]]:
    """The convolution channels [lo, hi) of a head range: its q, k and v channels."""
    D, dk = config.kda_dim, config.linear_head_dim
    return [(part * D + heads.start * dk, part * D + heads.stop * dk) for part in range(3)]
