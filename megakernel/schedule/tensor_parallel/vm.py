"""The multi-rank instruction VM: every rank's serialized per-SM queues run interleaved on the CPU, each
instruction through its stage's torch reference on its rank's context, every wait checked against that
rank's counters exactly as the device does (targets are per-step counts times the epoch), and the signals of
the exchange stages landing on the counter of every rank. A schedule that would hang a GPU (a signal
dropped, a cycle across ranks) raises ScheduleError naming the rank, SM and instruction instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...instructions import STAGE_MODULES
from ...instructions.layout import StepLayout, default_kv_splits, pack_weights, validate_step_inputs
from ...instructions.record import NO_COUNTER, Instruction, deserialize, serialize
from ...instructions.tensor_parallel import EXCHANGE_OPCODES
from ...instructions.tensor_parallel.layout import TPStageContext, allocate_tp_buffers
from ...model.tensor_parallel import shard_config, shard_weights
from ..assign import assign
from ..vm import ScheduleError
from .dag import TPStepProgram, build_tp_program, counter_name

ORDERS = ("round-robin", "reverse", "greedy")


def run_ranks(queues: list[list[list[Instruction]]], counters: list[list[int]], epoch: int, num_layers: int,
              order: str = "round-robin", execute: Callable[[int, Instruction], None] | None = None,
              trace: list | None = None) -> None:
    """Run one step of every rank's queues (queues[rank][sm]) against per-rank counters, in place.

    order: 'round-robin' (ranks 0.., SMs 0.., one instruction each per round), 'reverse' (highest rank and
    SM first) or 'greedy' (highest rank first, each SM running until it blocks, so ranks drift apart).
    `execute(rank, ins)` runs an instruction (None: counters only). An exchange opcode's signal adds 1 to
    its counter on every rank, any other on its own rank. `trace` collects (rank, sm, index)."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is unknown (known: {ORDERS})")
    world = len(queues)
    heads = [[0] * len(q) for q in queues]
    remaining = sum(len(q) for rank in queues for q in rank)
    ranks = list(range(world))
    if order != "round-robin":
        ranks.reverse()
    sms = [list(range(len(queues[r]))) for r in range(world)]
    if order == "reverse":
        for s in sms:
            s.reverse()
    while remaining:
        progressed = False
        for r in ranks:
            for sm in sms[r]:
                q = queues[r][sm]
                while heads[r][sm] < len(q):
                    ins = q[heads[r][sm]]
                    if ins.wait_id != NO_COUNTER and counters[r][ins.wait_id] < (epoch + 1) * ins.wait_count:
                        break
                    if execute is not None:
                        execute(r, ins)
                    if ins.signal_id != NO_COUNTER:
                        for dst in (range(world) if ins.opcode in EXCHANGE_OPCODES else (r,)):
                            counters[dst][ins.signal_id] += 1
                    heads[r][sm] += 1
                    remaining -= 1
                    progressed = True
                    if trace is not None:
                        trace.append((r, sm, ins.index))
                    if order != "greedy":
                        break
        if not progressed:
            raise ScheduleError(_deadlock(queues, heads, counters, epoch, num_layers))


def _deadlock(queues, heads, counters, epoch: int, num_layers: int, per_rank: int = 3) -> str:
    """'deadlock: ' and the first stuck queue heads of every rank, with the counter each waits on."""
    parts = []
    for r, rank_queues in enumerate(queues):
        stuck = [(sm, q[heads[r][sm]]) for sm, q in enumerate(rank_queues) if heads[r][sm] < len(q)]
        for sm, i in stuck[:per_rank]:
            parts.append(f"rank {r} SM {sm}: #{i.index} {i.opcode.name} layer {i.layer} waits counter {i.wait_id} "
                         f"({counter_name(i.wait_id, num_layers)}) for {(epoch + 1) * i.wait_count}, has "
                         f"{counters[r][i.wait_id]}")
        if len(stuck) > per_rank:
            parts.append(f"rank {r}: {len(stuck) - per_rank} more SMs stuck")
    return "deadlock: " + "; ".join(parts)


def simulate_ranks(queues: list[list[list[Instruction]]], num_counters: int, num_layers: int,
                   order: str = "round-robin") -> list[tuple[int, int, int]]:
    """Run every rank's queues against counters without data: -> (rank, sm, index) in completion order;
    ScheduleError naming the stuck ranks and instructions if no SM of any rank can make progress."""
    trace: list[tuple[int, int, int]] = []
    run_ranks(queues, [[0] * num_counters for _ in queues], 0, num_layers, order, trace=trace)
    return trace


def rank_tables(program: TPStepProgram, policy: str = "balanced") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's queues (program assigned to its SMs by `policy`), serialized: [(table, lengths)] by rank.
    The ranks run one program, so the tables are equal; each rank still gets its own copy to load."""
    queues = assign(program, policy)
    return [serialize(queues) for _ in range(program.world_size)]


class TPInstructionVM:
    """Executes every rank's serialized queues (tables[rank] = (table, lengths)) with the stage references
    on contexts[rank], interleaved across ranks and SMs, against per-rank counters."""

    def __init__(self, contexts: list[TPStageContext], tables: list[tuple[torch.Tensor, torch.Tensor]],
                 num_counters: int):
        if len(contexts) != len(tables):
            raise ValueError(f"{len(contexts)} rank contexts and {len(tables)} rank tables")
        for r, ctx in enumerate(contexts):
            if ctx.layout.rank != r or ctx.layout.world_size != len(contexts):
                raise ValueError(f"context {r} is rank {ctx.layout.rank} of {ctx.layout.world_size}; "
                                 f"expected rank {r} of {len(contexts)}")
        self.contexts = contexts
        self.queues = [deserialize(table, lengths) for table, lengths in tables]
        self.counters = [[0] * num_counters for _ in contexts]
        self.num_layers = contexts[0].layout.config.num_layers
        self.epoch = 0
        self.trace: list[tuple[int, int, int]] = []   # (rank, sm, instruction index) in execution order

    def step(self, order: str = "round-robin") -> list[torch.Tensor]:
        """Run one decode step on every rank, interleaved by `order` (ORDERS, see run_ranks); -> every rank's
        out_tokens buffer (not copies)."""
        self.trace.clear()

        def execute(rank: int, ins: Instruction) -> None:
            STAGE_MODULES[ins.opcode].reference(ins, self.contexts[rank])

        run_ranks(self.queues, self.counters, self.epoch, self.num_layers, order, execute, self.trace)
        self.epoch += 1
        return [ctx.bufs.out_tokens for ctx in self.contexts]


class TPVMDecoder:
    """A tensor-parallel decode step on the CPU: world_size ranks, each with its shard of the weights
    (model.tensor_parallel.shard_weights, packed as its kernel streams them), the KV cache of its own kv heads
    (`k_caches[rank]`, NaN-filled), its buffers and its serialized queues, all run by one TPInstructionVM.
    The CPU twin of one megakernel per GPU with the exchanges between them (runtime.tensor_parallel).
    Every rank gets the same step inputs. lm_head=False runs the program without TP_LM_HEAD and ARGMAX (as the
    vLLM ranks do): `step_hidden` then returns x[L], and `step` raises RuntimeError."""

    def __init__(self, weights, world_size: int, batch: int, max_seq_len: int, block_size: int = 16,
                 num_sms: int = 132, policy: str = "balanced", kv_splits: int | None = None,
                 num_blocks: int | None = None, fold_embed: bool = False, fuse_attn_reduce: bool | None = None,
                 lm_head: bool = True):
        config = weights.config
        blocks_per_seq = -(-max_seq_len // block_size)
        # splits per (sequence, kv head) as a rank would choose them: it has 1/W of the kv heads
        splits = kv_splits or default_kv_splits(shard_config(config, world_size), batch, num_sms,
                                                blocks_per_seq * block_size)
        self.layout = StepLayout(config=config, batch=batch, kv_splits=splits, block_size=block_size,
                                 max_blocks_per_seq=blocks_per_seq, num_sms=num_sms, fold_embed=fold_embed,
                                 fuse_attn_reduce=fuse_attn_reduce)
        self.program = build_tp_program(self.layout, world_size, lm_head=lm_head)
        self.world_size = world_size
        self.tables = rank_tables(self.program, policy)
        simulate_ranks([deserialize(t, n) for t, n in self.tables], self.program.num_counters, config.num_layers)
        self.num_blocks = num_blocks or batch * blocks_per_seq
        self.k_caches, self.v_caches, self.contexts = [], [], []
        for rank, shard in enumerate(shard_weights(weights, world_size)):
            layout = self.program.rank_layout(rank)
            sc = layout.config
            shape = (sc.num_layers, self.num_blocks, block_size, sc.num_kv_heads, sc.head_dim)
            self.k_caches.append(torch.full(shape, float("nan"), dtype=weights.embed.dtype))
            self.v_caches.append(torch.full(shape, float("nan"), dtype=weights.embed.dtype))
            bufs = allocate_tp_buffers(layout, self.program.lm_tiles, self.program.num_counters)
            self.contexts.append(TPStageContext(layout, pack_weights(shard, self.layout.max_seq_len), bufs,
                                                self.k_caches[-1], self.v_caches[-1]))
        for ctx in self.contexts:
            ctx.peers = [other.bufs for other in self.contexts]
        self.vm = TPInstructionVM(self.contexts, self.tables, self.program.num_counters)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             order: str = "round-robin") -> tuple[torch.Tensor, torch.Tensor]:
        """Validate the inputs, poison every rank's buffers, load the inputs into each and run one step.
        -> (rank 0's next tokens int32 [B], the logits float32 [B, V]: the ranks' vocabulary slices side by
        side). Every rank's own results stay in `contexts[rank].bufs`."""
        if not self.program.has_lm_head:
            raise RuntimeError("this TPVMDecoder was built with lm_head=False: its step ends at x[L] with no LM "
                               "head and no ARGMAX, so there are no next tokens or logits; use step_hidden()")
        out = self._run(tokens, positions, block_table, order)
        return out[0].clone(), torch.cat([ctx.bufs.logits for ctx in self.contexts], dim=1)

    def step_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                    order: str = "round-robin") -> torch.Tensor:
        """One step -> rank 0's x[L] float32 [B, H] (a copy; every rank holds the same bits): the residual stream
        after the last layer, before the final norm. With the LM head the step also advances tokens and
        positions, as `step` does."""
        self._run(tokens, positions, block_table, order)
        return self.contexts[0].bufs.x[-1].clone()

    def _run(self, tokens, positions, block_table, order: str) -> list[torch.Tensor]:
        validate_step_inputs(self.layout, tokens, positions, block_table, self.num_blocks)
        for ctx in self.contexts:
            bufs = ctx.bufs
            bufs.poison()
            bufs.tokens.copy_(tokens.to(torch.int32))
            bufs.positions.copy_(positions.to(torch.int32))
            bufs.block_table.copy_(block_table.to(torch.int32))
        return self.vm.step(order)
