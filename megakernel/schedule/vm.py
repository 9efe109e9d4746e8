"""The instruction VM: executes the serialized per-SM queues with each stage's torch reference, in
an interleaved order that mimics concurrent SMs, and checks every wait against the counters exactly
as the device does (targets are per-step counts times the step's epoch). A schedule that would hang
the GPU raises here instead."""

from __future__ import annotations

import torch

from ..instructions import STAGE_MODULES
from ..instructions.context import StageContext
from ..instructions.record import NO_COUNTER, Instruction, deserialize


class ScheduleError(RuntimeError):
    pass


class InstructionVM:
    def __init__(self, ctx: StageContext, table: torch.Tensor, lengths: torch.Tensor, num_counters: int):
        self.ctx = ctx
        self.queues: list[list[Instruction]] = deserialize(table, lengths)
        self.counters = [0] * num_counters
        self.epoch = 0
        self.trace: list[tuple[int, int]] = []   # (sm, instruction index) in execution order

    def step(self, order: str = "round-robin") -> torch.Tensor:
        """Run one decode step; returns out_tokens. `order` interleaves SMs round-robin (one
        instruction each per round) or 'reverse' (highest SM first), to shake out order bugs."""
        heads = [0] * len(self.queues)
        remaining = sum(len(q) for q in self.queues)
        sms = list(range(len(self.queues)))
        if order == "reverse":
            sms.reverse()
        self.trace.clear()
        while remaining:
            progressed = False
            for sm in sms:
                q = self.queues[sm]
                if heads[sm] >= len(q):
                    continue
                ins = q[heads[sm]]
                if ins.wait_id != NO_COUNTER:
                    target = (self.epoch + 1) * ins.wait_count
                    if self.counters[ins.wait_id] < target:
                        continue
                STAGE_MODULES[ins.opcode].reference(ins, self.ctx)
                if ins.signal_id != NO_COUNTER:
                    self.counters[ins.signal_id] += 1
                heads[sm] += 1
                remaining -= 1
                progressed = True
                self.trace.append((sm, ins.index))
            if not progressed:
                stuck = [self.queues[sm][heads[sm]] for sm in sms if heads[sm] < len(self.queues[sm])]
                raise ScheduleError("deadlock: " + ", ".join(
                    f"#{i.index} {i.opcode.name} waits counter {i.wait_id} for "
                    f"{(self.epoch + 1) * i.wait_count}, has {self.counters[i.wait_id]}" for i in stuck[:4]))
        self.epoch += 1
        return self.ctx.bufs.out_tokens


class VMDecoder:
    """A whole decode step on the CPU through the instruction VM: same program, same serialized
    queues, same buffers the GPU kernel uses. The CPU twin of runtime.MegakernelEngine.

    lm_head=False runs the program without LM_HEAD and ARGMAX (as the engine's lm_head=False):
    `step_hidden` then returns x[L], and `step` (next tokens) raises RuntimeError."""

    def __init__(self, weights, batch: int, max_seq_len: int, block_size: int = 16, num_sms: int = 132,
                 policy: str = "balanced", kv_splits: int | None = None, num_blocks: int | None = None,
                 lm_head: bool = True, fold_embed: bool = False):
        from ..instructions.layout import StepLayout, allocate_buffers, default_kv_splits, pack_weights
        from ..instructions.record import serialize
        from .assign import assign
        from .dag import build_program

        config = weights.config
        blocks_per_seq = -(-max_seq_len // block_size)
        self.layout = StepLayout(config=config, batch=batch,
                                 kv_splits=kv_splits or default_kv_splits(config, batch, num_sms, blocks_per_seq * block_size),
                                 block_size=block_size, max_blocks_per_seq=blocks_per_seq, num_sms=num_sms,
                                 fold_embed=fold_embed)
        self.program = build_program(self.layout, lm_head=lm_head)
        self.queues = assign(self.program, policy)
        table, lengths = serialize(self.queues)
        packed = pack_weights(weights, self.layout.max_seq_len)
        bufs = allocate_buffers(self.layout, self.program.lm_tiles, self.program.num_counters)
        nb = num_blocks or batch * blocks_per_seq
        shape = (config.num_layers, nb, block_size, config.num_kv_heads, config.head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=weights.embed.dtype)
        v_cache = torch.full(shape, float("nan"), dtype=weights.embed.dtype)
        self.ctx = StageContext(self.layout, packed, bufs, k_cache, v_cache)
        self.vm = InstructionVM(self.ctx, table, lengths, self.program.num_counters)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             order: str = "round-robin") -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next tokens int32 [B], logits float32 [B, V])."""
        if not self.program.has_lm_head:
            raise RuntimeError("this VMDecoder was built with lm_head=False: its step ends at x[L] with no "
                               "LM head and no ARGMAX, so there are no next tokens or logits; use step_hidden()")
        return run_vm_step(self.vm, self.layout, self.ctx.bufs, tokens, positions, block_table,
                           self.ctx.k_cache.shape[1], order)

    def step_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                    order: str = "round-robin") -> torch.Tensor:
        """One step -> x[L] float32 [B, H] (a copy): the residual stream after the last layer, before
        the final norm. With the LM head, the step also advances tokens/positions as `step` does."""
        execute_vm_step(self.vm, self.layout, self.ctx.bufs, tokens, positions, block_table,
                        self.ctx.k_cache.shape[1], order)
        return self.ctx.bufs.x[-1].clone()


def execute_vm_step(vm: InstructionVM, layout, bufs, tokens, positions, block_table, num_blocks: int,
                    order: str = "round-robin") -> torch.Tensor:
    """Validate the step inputs, poison the buffers, load the inputs and run one step through the VM;
    the results are left in `bufs`. -> the VM's out_tokens buffer (not a copy)."""
    from ..instructions.layout import validate_step_inputs
    validate_step_inputs(layout, tokens, positions, block_table, num_blocks)
    bufs.poison()
    bufs.tokens.copy_(tokens.to(torch.int32))
    bufs.positions.copy_(positions.to(torch.int32))
    bufs.block_table.copy_(block_table.to(torch.int32))
    return vm.step(order)


def run_vm_step(vm: InstructionVM, layout, bufs, tokens, positions, block_table, num_blocks: int,
                order: str = "round-robin") -> tuple[torch.Tensor, torch.Tensor]:
    """`execute_vm_step` -> (next tokens int32 [B], logits float32 [B, V]). Shared by the dense and
    DeepSeek decoders."""
    out = execute_vm_step(vm, layout, bufs, tokens, positions, block_table, num_blocks, order)
    return out.clone(), bufs.logits.clone()
