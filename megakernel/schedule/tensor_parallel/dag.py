"""The instruction DAG of one tensor-parallel decode step: the program every rank runs over its shard.

The ranks run one program (SPMD): the same instructions, waits and signals, with operands in the rank's own
rows (its heads, FFN slice and vocabulary slice); which rank runs it is the context's (on the GPU: a launch
parameter, with the peers' buffer addresses), not the records', so one serialized table serves every rank.
Stages of layer l, each waiting on one counter and signalling one (instructions.tensor_parallel has the data
flow):

    QKV tiles (the rank's q, k, v rows)      wait x[l]'s producer            signal (l, QKV)
    ATTN_PARTIAL (sequence, kv head, split)  wait (l, QKV)                   signal (l, ATTN_PARTIAL)
    [ATTN_REDUCE (sequence, kv head)]        wait (l, ATTN_PARTIAL)          signal (l, ATTN_REDUCE)
    TP_O_PROJ tiles (H rows, K = q_size/W)   wait the attention              signal (l, attention) exchange, every rank
    TP_REDUCE tiles (H rows), a3 = ATTENTION wait that exchange: W x n_o     signal (l, O_PROJ)    -> h[l]
    GATE_UP tiles (2F/W rows)                wait (l, O_PROJ)                signal (l, GATE_UP)
    TP_DOWN tiles (H rows, K = F/W)          wait (l, GATE_UP)               signal (l, FFN) exchange, every rank
    TP_REDUCE tiles (H rows), a3 = FFN       wait that exchange: W x n_down  signal (l, DOWN)      -> x[l+1]
  then TP_LM_HEAD tiles (V/W rows)           wait (L-1, DOWN)                signal the LM head exchange, every rank
       ARGMAX (a0 = W x LM head tiles)       wait that exchange: W x n_lm    signal ARGMAX

(n_o, n_down, n_lm: one rank's TP_O_PROJ, TP_DOWN and TP_LM_HEAD tiles.) `build_tp_program(layout, W,
lm_head=False)` is the same program without its last two stages, as the dense build_program(lm_head=False): the
step ends when the last layer's FFN TP_REDUCE has written x[L] on every rank, and the caller (vLLM, which
computes the logits itself from the final hidden state) writes tokens and positions before every launch.

Counters are per rank. The local ones are numbered as on one GPU (opcodes.counter_id and friends); the
exchange counters follow them: exchange_counter(L, l, part), then lm_exchange_counter(L). An exchange
instruction's signal adds 1 to that counter on every rank (the device: a release store of the data, then
an atomic add on each peer's counter); a consumer waits, as every wait, for its count times the epoch.

Across steps the ranks are not launched together: a rank may start step t+1 while a peer still runs step t.
What keeps a rank's next-step stores out of the receive slots a peer still reads is the chain of exchanges
itself: every stage waits for all tiles of the one before it, so a rank's last exchange of a step follows all
its earlier reduces of that step, and a rank's next step follows its own last reduce, which waited for every
rank's last exchange (with the LM head: the LM head's, which precedes every rank's ARGMAX; without it: the
last layer's TP_DOWN). The only reduces left unordered before a peer's next step are those that close that
last exchange, and the slots they read are stored into next only by the next step's same exchange, which
comes after the next step's earlier exchanges, and so after every rank started its next step (each in its own
stream order, after its previous step). verify.find_tp_races checks it over two steps, with and without the
LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...instructions.layout import ROW_GROUP, StepLayout
from ...instructions.opcodes import (NUM_LAYER_STAGES, Opcode, Stage, argmax_counter, counter_id, embed_counter,
                                     lm_head_counter, num_counters)
from ...instructions.record import NO_COUNTER, Instruction
from ...instructions.tensor_parallel.layout import ShardLayout
from ...instructions.tensor_parallel.reduce import ATTENTION, FFN
from ..dag import FIXED_COST_BYTES, StepProgram, tile_rows

ELEM, F32 = 2, 4           # bf16 weights; float32 activations and partials


def exchange_counter(num_layers: int, layer: int, part: int) -> int:
    """The counter that layer `layer`'s exchange of `part` (ATTENTION: TP_O_PROJ, FFN: TP_DOWN) signals on
    every rank."""
    return num_counters(num_layers) + 2 * layer + part


def lm_exchange_counter(num_layers: int) -> int:
    """The counter the TP_LM_HEAD tiles signal on every rank (ARGMAX waits on it)."""
    return num_counters(num_layers) + 2 * num_layers


def tp_num_counters(num_layers: int) -> int:
    return num_counters(num_layers) + 2 * num_layers + 1


def is_exchange_counter(counter: int, num_layers: int) -> bool:
    return num_counters(num_layers) <= counter < tp_num_counters(num_layers)


def counter_name(counter: int, num_layers: int) -> str:
    """What a counter of a TP program counts, for error reports."""
    L = num_layers
    if 0 <= counter < L * NUM_LAYER_STAGES:
        return f"layer {counter // NUM_LAYER_STAGES} {Stage(counter % NUM_LAYER_STAGES).name}"
    named = {embed_counter(L): "EMBED", lm_head_counter(L): "LM_HEAD", argmax_counter(L): "ARGMAX",
             lm_exchange_counter(L): "LM head exchange"}
    if counter in named:
        return named[counter]
    if is_exchange_counter(counter, L):
        layer, part = divmod(counter - num_counters(L), 2)
        return f"layer {layer} {'attention' if part == ATTENTION else 'FFN'} exchange"
    return f"counter {counter} (none of this program's)"


@dataclass(frozen=True)
class TPStepProgram(StepProgram):
    """A StepProgram (assign works on it) whose layout is rank 0's ShardLayout; `lm_tiles` is one rank's LM
    head tiles. world_size ranks run it, each over rank_layout(rank)."""

    world_size: int = 1

    def rank_layout(self, rank: int) -> ShardLayout:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside 0..{self.world_size - 1}")
        return replace(self.layout, rank=rank)

    def counter_name(self, counter: int) -> str:
        return counter_name(counter, self.layout.config.num_layers)


def _tiles(rows: int, per_tile: int) -> list[tuple[int, int]]:
    return [(lo, min(per_tile, rows - lo)) for lo in range(0, rows, per_tile)]


def build_tp_program(layout: StepLayout, world_size: int, lm_head: bool = True) -> TPStepProgram:
    """The program each of world_size ranks runs for the step `layout` (of the whole model); ValueError naming
    the field where the model does not split that way (ShardLayout.of, ShardLayout.validate). Whether O
    projections merge the attention splits and layer 0's QKV stages the embedding follow the shard's own
    StepLayout rules (its matvec inputs are the ones a rank stages). lm_head=False leaves out TP_LM_HEAD and
    ARGMAX: the same instructions (indices, waits, signals, counters) up to the last FFN TP_REDUCE, which writes
    x[L]; lm_tiles is then 0. The program is a pure function of its arguments, so ranks that build it apart
    (one process each) build the same one."""
    shard = ShardLayout.of(layout, world_size)
    shard.validate()
    c, W = shard.config, world_size
    L, B, S, H = c.num_layers, shard.batch, shard.kv_splits, c.hidden_size
    out: list[Instruction] = []

    def add(**kw) -> None:
        out.append(Instruction(index=len(out), **kw))

    def stage(op: Opcode, layer: int, rows: int, cost_per_row: int, wait: tuple[int, int], signal: int,
              group: int = ROW_GROUP, a3: int = 0) -> int:
        tiles = _tiles(rows, tile_rows(rows, shard.num_sms, group))
        for t, (lo, n) in enumerate(tiles):
            add(opcode=op, layer=layer, a0=lo, a1=n, a2=t, a3=a3, wait_id=wait[0], wait_count=wait[1],
                signal_id=signal, cost=n * cost_per_row + FIXED_COST_BYTES)
        return len(tiles)

    folded = shard.embed_folded
    add(opcode=Opcode.EMBED, a0=0, a1=B, signal_id=counter_id(0, Stage.QKV) if folded else embed_counter(L),
        cost=B * H * ELEM + FIXED_COST_BYTES)
    prev = (embed_counter(L), 1)
    kv_bytes_per_split = 2 * c.head_dim * ELEM * max(1, shard.max_seq_len // S)
    for l in range(L):
        if folded and l == 0:
            # layer 0's QKV stages embed[token] itself; EMBED (x[0], the residual) is one more QKV producer
            n = stage(Opcode.QKV, l, c.qkv_rows, H * ELEM, (NO_COUNTER, 0), counter_id(l, Stage.QKV), a3=1) + 1
        else:
            n = stage(Opcode.QKV, l, c.qkv_rows, H * ELEM, prev, counter_id(l, Stage.QKV))
        for b in range(B):
            for kvh in range(c.num_kv_heads):
                for s in range(S):
                    add(opcode=Opcode.ATTN_PARTIAL, layer=l, a0=b, a1=kvh, a2=s, a3=S,
                        wait_id=counter_id(l, Stage.QKV), wait_count=n,
                        signal_id=counter_id(l, Stage.ATTN_PARTIAL), cost=kv_bytes_per_split + FIXED_COST_BYTES)
        attention = (counter_id(l, Stage.ATTN_PARTIAL), B * c.num_kv_heads * S)
        if not shard.fused_reduce:
            for b in range(B):
                for kvh in range(c.num_kv_heads):
                    add(opcode=Opcode.ATTN_REDUCE, layer=l, a0=b, a1=kvh, a3=S, wait_id=attention[0],
                        wait_count=attention[1], signal_id=counter_id(l, Stage.ATTN_REDUCE), cost=FIXED_COST_BYTES)
            attention = (counter_id(l, Stage.ATTN_REDUCE), B * c.num_kv_heads)
        x_o = exchange_counter(L, l, ATTENTION)
        n = stage(Opcode.TP_O_PROJ, l, H, c.q_size * ELEM, attention, x_o, a3=S if shard.fused_reduce else 0)
        n = stage(Opcode.TP_REDUCE, l, H, W * B * F32, (x_o, W * n), counter_id(l, Stage.O_PROJ), a3=ATTENTION)
        n = stage(Opcode.GATE_UP, l, 2 * c.intermediate_size, H * ELEM, (counter_id(l, Stage.O_PROJ), n),
                  counter_id(l, Stage.GATE_UP), group=2 * ROW_GROUP)
        x_d = exchange_counter(L, l, FFN)
        n = stage(Opcode.TP_DOWN, l, H, c.intermediate_size * ELEM, (counter_id(l, Stage.GATE_UP), n), x_d)
        n = stage(Opcode.TP_REDUCE, l, H, W * B * F32, (x_d, W * n), counter_id(l, Stage.DOWN), a3=FFN)
        prev = (counter_id(l, Stage.DOWN), n)
    if not lm_head:
        return TPStepProgram(layout=shard, instructions=tuple(out), num_counters=tp_num_counters(L), lm_tiles=0,
                             world_size=W)
    x_lm = lm_exchange_counter(L)
    per_rank = len(_tiles(c.vocab_size, tile_rows(c.vocab_size, shard.num_sms)))
    lm_tiles = stage(Opcode.TP_LM_HEAD, 0, c.vocab_size, H * ELEM, prev, x_lm, a3=per_rank)
    add(opcode=Opcode.ARGMAX, a0=W * lm_tiles, wait_id=x_lm, wait_count=W * lm_tiles, signal_id=argmax_counter(L),
        cost=FIXED_COST_BYTES)
    return TPStepProgram(layout=shard, instructions=tuple(out), num_counters=tp_num_counters(L), lm_tiles=lm_tiles,
                         world_size=W)
