"""SM assignment policies: split the global instruction order into one queue per SM.

Every queue keeps the global (topological) order, which makes the schedule deadlock-free: the
earliest unfinished instruction in that order has all its producers finished and sits at the head
of its own queue. `simulate` checks that anyway, and the VM runs it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ..instructions.record import Instruction
from .dag import StepProgram

# Instructions of one stage are balanced among themselves; a stage boundary is where SMs wait.
def _stage_key(ins: Instruction) -> tuple[int, int]:
    return ins.layer, int(ins.opcode)


def round_robin(program: StepProgram) -> list[list[Instruction]]:
    """Instruction i of each stage goes to SM i mod num_sms."""
    n = program.layout.num_sms
    queues: list[list[Instruction]] = [[] for _ in range(n)]
    counts: dict[tuple[int, int], int] = {}
    for ins in program.instructions:
        k = _stage_key(ins)
        i = counts.get(k, 0)
        counts[k] = i + 1
        queues[i % n].append(ins)
    return queues


def balanced(program: StepProgram) -> list[list[Instruction]]:
    """Within each stage, largest cost first to the SM with the least cost *in that stage* (LPT), ties
    to the SM with the least total so far: every SM streams about the same bytes per stage (a stage's
    consumers wait for its slowest SM), and the step's totals stay even. Queues keep global order."""
    n = program.layout.num_sms
    owner: dict[int, int] = {}
    total = [0.0] * n
    stage: list[Instruction] = []

    def flush() -> None:
        heap = [(0.0, total[sm], sm) for sm in range(n)]
        heapq.heapify(heap)
        for ins in sorted(stage, key=lambda i: -i.cost):
            in_stage, _, sm = heapq.heappop(heap)
            owner[ins.index] = sm
            total[sm] += ins.cost
            heapq.heappush(heap, (in_stage + ins.cost, total[sm], sm))
        stage.clear()

    for ins in program.instructions:
        if stage and _stage_key(stage[-1]) != _stage_key(ins):
            flush()
        stage.append(ins)
    flush()
    queues: list[list[Instruction]] = [[] for _ in range(n)]
    for ins in program.instructions:
        queues[owner[ins.index]].append(ins)
    return queues


POLICIES: dict[str, Callable[[StepProgram], list[list[Instruction]]]] = {
    "round-robin": round_robin,
    "balanced": balanced,
}


def assign(program: StepProgram, policy: str = "balanced") -> list[list[Instruction]]:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown (known: {sorted(POLICIES)})")
    return POLICIES[policy](program)


def simulate(queues: list[list[Instruction]], num_counters: int) -> list[Instruction]:
    """Run the queues against counters without data: returns the order instructions completed in;
    raises RuntimeError naming the stuck queue heads if no SM can make progress (a deadlock)."""
    counters = [0] * num_counters
    heads = [0] * len(queues)
    done: list[Instruction] = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for sm, q in enumerate(queues):
            while heads[sm] < len(q):
                ins = q[heads[sm]]
                if ins.wait_id >= 0 and counters[ins.wait_id] < ins.wait_count:
                    break
                if ins.signal_id >= 0:
                    counters[ins.signal_id] += 1
                heads[sm] += 1
                remaining -= 1
                done.append(ins)
                progressed = True
        if not progressed:
            stuck = [(sm, q[heads[sm]]) for sm, q in enumerate(queues) if heads[sm] < len(q)]
            detail = ", ".join(f"SM {sm}: #{i.index} {i.opcode.name} waits counter {i.wait_id} "
                               f">= {i.wait_count} (is {counters[i.wait_id]})" for sm, i in stuck[:4])
            raise RuntimeError(f"schedule deadlocks: {detail}")
    return done
