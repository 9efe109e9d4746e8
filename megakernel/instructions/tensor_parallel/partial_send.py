"""TP_O_PROJ and TP_DOWN: one rank's partial sums of a layer's O projection and of its FFN's down
projection, stored into every rank's receive buffer.

Operands, as O_PROJ and DOWN: a0 = first row, a1 = row count, a2 = tile index; TP_O_PROJ's a3 = number of KV
splits when it merges the attention splits itself (its input is then the log-sum-exp merge of attn_part[l]),
else 0 (its input is attn_out[l]).

Rank r holds the columns of Wo that read its own query heads (of Wdown: its slice of the FFN), so a tile
computes rows [a0, a0 + a1) of y_r = Wo[:, cols_r] . attn_r (Wdown[:, cols_r] . act_r): a partial sum of H
rows, with no residual. It stores y_r with plain stores into slot r of recv_o[l] (recv_down[l]) of every rank,
itself included, and its signal lands on the exchange counter of every rank (schedule.tensor_parallel: the
signal of an EXCHANGE_OPCODES instruction goes to all ranks). TP_REDUCE adds the slots up.
"""

from __future__ import annotations

from ..attention import merge_splits
from ..context import StageContext, matvec
from ..layout import streamed_rows
from ..matvec_stages import per_batch
from ..opcodes import Opcode
from ..record import Instruction

OPCODES = (Opcode.TP_O_PROJ, Opcode.TP_DOWN)


def recv_name(op: Opcode) -> str:
    """The receive buffer an exchange opcode stores into (and TP_REDUCE of that part reads)."""
    return {Opcode.TP_O_PROJ: "recv_o", Opcode.TP_DOWN: "recv_down"}[op]


def recv_regions(name: str, layer: int, src: int, lo: int, hi: int, layout) -> list:
    """Rows [lo, hi) of slot `src` of a receive buffer [.., W, B, H], every sequence: index (src*B + b)*H + i."""
    nb, h = layout.batch, layout.config.hidden_size
    return [(name, layer, (src * nb + b) * h + lo, (src * nb + b) * h + hi) for b in range(nb)]


def reads(ins: Instruction, layout) -> list:
    c, nb, l = layout.config, layout.batch, ins.layer
    if ins.opcode == Opcode.TP_DOWN:
        return per_batch("act", l, 0, c.intermediate_size, nb, c.intermediate_size)
    if ins.a3 > 0:
        return [("attn_part", l, 0, nb * c.num_heads * ins.a3)]
    return per_batch("attn_out", l, 0, c.q_size, nb, c.q_size)


def writes(ins: Instruction, layout) -> list:
    """Nothing of the rank's own buffers but its slot of the receive buffer, which peer_writes names."""
    return []


def peer_writes(ins: Instruction, layout) -> list:
    """Regions written on every rank (its own included): this rank's slot of the layer's receive buffer."""
    return recv_regions(recv_name(ins.opcode), ins.layer, layout.rank, ins.a0, ins.a0 + ins.a1, layout)


def reference(ins: Instruction, ctx: StageContext) -> None:
    w, b = ctx.weights, ctx.bufs
    l, lo, hi, rank = ins.layer, ins.a0, ins.a0 + ins.a1, ctx.layout.rank
    if ins.opcode == Opcode.TP_O_PROJ:
        if ins.a3 > 0:
            inp = merge_splits(b.attn_part_lse[l], b.attn_part_o[l]).reshape(b.h.shape[1], -1)
        else:
            inp = b.attn_out[l]
        y = matvec(streamed_rows(w, w.o_proj[l, lo:hi]), inp)
        for peer in ctx.peers:
            peer.recv_o[l, rank, :, lo:hi] = y
    elif ins.opcode == Opcode.TP_DOWN:
        y = matvec(streamed_rows(w, w.down[l, lo:hi]), b.act[l])
        for peer in ctx.peers:
            peer.recv_down[l, rank, :, lo:hi] = y
    else:
        raise ValueError(f"{ins.opcode!r} is not a partial-sum exchange stage")
