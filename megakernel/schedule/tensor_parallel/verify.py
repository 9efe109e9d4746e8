"""Static checks of a tensor-parallel program across ranks and steps: schedule.verify's race check with every
rank's instructions in one graph, the exchange stores landing in every rank's buffers.

Nodes are (step, rank, instruction). A node follows everything it waits for: on its own rank for a local
counter, and on every rank for an exchange counter (the producers are every rank's signalling instructions),
transitively; and a rank's step follows all of that rank's previous step (one launch after the other on its
stream, while the other ranks are not held back). Regions are tagged with the rank whose memory they are in:
what a stage module reads and writes is its own rank's, what an exchange stage's peer_writes names is every
rank's. Two nodes touching the same region, at least one writing, neither ordered before the other, race.
Two steps suffice: a race between steps t and t+1 repeats between any later pair.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ...instructions import STAGE_MODULES
from ...instructions.record import NO_COUNTER
from ...instructions.tensor_parallel import EXCHANGE_OPCODES
from ..dag import producers
from ..verify import conflicting_pairs
from .dag import TPStepProgram


@dataclass(frozen=True)
class _Name:
    name: str


@dataclass(frozen=True)
class _Node:
    """One (step, rank, instruction) of the graph, named for race reports."""

    index: int
    opcode: _Name


def wait_problems(program: TPStepProgram, limit: int = 10) -> list[str]:
    """Waits whose target is not the number of signals their counter gets per step on a rank: the rank's own
    signallers, plus world_size for each exchange signaller. (Short, the consumer may start before the last
    producer's stores; long, it never starts.)"""
    problems = []
    signals = _signals_per_rank(program, producers(program))
    for ins in program.instructions:
        if ins.wait_id != NO_COUNTER and ins.wait_count != signals[ins.wait_id]:
            problems.append(f"#{ins.index} {ins.opcode.name} layer {ins.layer} waits for {ins.wait_count} signals on "
                            f"counter {ins.wait_id} ({program.counter_name(ins.wait_id)}), which gets "
                            f"{signals[ins.wait_id]} per step on each rank")
            if len(problems) >= limit:
                break
    return problems


def _signals_per_rank(program: TPStepProgram, prods: dict[int, list[int]]) -> Counter:
    """counter -> the signals it gets per step on each rank: one per own-rank signaller, world_size per
    exchange signaller (every rank's copy of it signals every rank)."""
    out: Counter = Counter()
    for counter, indices in prods.items():
        out[counter] = sum(program.world_size if program.instructions[p].opcode in EXCHANGE_OPCODES else 1
                           for p in indices)
    return out


def happens_before(program: TPStepProgram, steps: int = 2) -> list[int]:
    """bits[node]: bit m set where node m finishes before `node` starts, node = (step * W + rank) * N + index.
    A wait for fewer than all of a counter's signals orders nothing (any of them may be the late one), nor
    does a producer later in the global order (a schedule bug simulate_ranks reports)."""
    ins_list, W = program.instructions, program.world_size
    N = len(ins_list)
    prods = producers(program)
    signals = _signals_per_rank(program, prods)

    def node(step: int, rank: int, index: int) -> int:
        return (step * W + rank) * N + index

    bits = [0] * (steps * W * N)
    for step in range(steps):
        launched = [0] * W              # a rank's previous step and everything before it
        if step:
            for r in range(W):
                for i in range(N):
                    m = node(step - 1, r, i)
                    launched[r] |= bits[m] | (1 << m)
        cache: dict[tuple[int, int], int] = {}     # (rank, counter) -> its signallers and what they follow
        for i, ins in enumerate(ins_list):
            prod = prods.get(ins.wait_id, []) if ins.wait_id != NO_COUNTER else []
            orders = bool(prod) and ins.wait_count >= signals[ins.wait_id] and prod[-1] < i
            for r in range(W):
                acc = 0
                if orders:
                    key = (r, ins.wait_id)
                    if key not in cache:
                        found = 0
                        for p in prod:
                            for d in (range(W) if ins_list[p].opcode in EXCHANGE_OPCODES else (r,)):
                                m = node(step, d, p)
                                found |= bits[m] | (1 << m)
                        cache[key] = found
                    acc = cache[key]
                bits[node(step, r, i)] = acc | launched[r]
    return bits


def find_tp_races(program: TPStepProgram, steps: int = 2, limit: int = 10) -> list[str]:
    """Descriptions of wait targets that miss their signal count (wait_problems) and of unordered conflicting
    pairs across all ranks over `steps` consecutive steps; empty when the program is race-free."""
    problems = wait_problems(program, limit)
    if len(problems) >= limit:
        return problems
    ins_list, W = program.instructions, program.world_size
    N = len(ins_list)
    bits = happens_before(program, steps)
    layouts = [program.rank_layout(r) for r in range(W)]
    nodes = []
    for step in range(steps):
        for r in range(W):
            for ins in ins_list:
                nodes.append(_Node(len(nodes), _Name(f"step {step} rank {r} #{ins.index} {ins.opcode.name} "
                                                     f"layer {ins.layer}")))

    def accesses(n: _Node):
        r = (n.index // N) % W
        ins = ins_list[n.index % N]
        module, layout = STAGE_MODULES[ins.opcode], layouts[r]
        reads = [_at(reg, r) for reg in module.reads(ins, layout)]
        writes = [_at(reg, r) for reg in module.writes(ins, layout)]
        if hasattr(module, "peer_writes"):
            writes += [_at(reg, d) for reg in module.peer_writes(ins, layout) for d in range(W)]
        return reads, writes

    def ordered(a: int, b: int) -> bool:
        return bool((bits[a] >> b) & 1 or (bits[b] >> a) & 1)

    races = conflicting_pairs(nodes, accesses, ordered, limit - len(problems))
    # a node's number in the graph says nothing the name does not: report (step, rank, #index) only
    return problems + [re.sub(r"#\d+ (?=step )", "", race) for race in races]


def _at(region: tuple, rank: int) -> tuple:
    """A region of rank `rank`'s memory."""
    return (f"{region[0]}@rank{rank}",) + tuple(region[1:])
