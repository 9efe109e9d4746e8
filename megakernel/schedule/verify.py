"""Static checks of a step program: every instruction waits (directly or through a chain) for every
instruction that writes what it reads, and no two unordered instructions touch the same data with
at least one write (a race either way: read-after-write or write-after-read)."""

from __future__ import annotations

import heapq

from ..instructions import STAGE_MODULES
from .dag import StepProgram, dependency_closure, producers


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and a[2] < b[3] and b[2] < a[3]


def find_races(program: StepProgram, limit: int = 10) -> list[str]:
    """Descriptions of unordered conflicting pairs (empty when the program is race-free)."""
    layout = program.layout
    problems: list[str] = []
    # A wait counts on the whole producing stage: a target short of the producer count lets the
    # consumer start before the last producer's stores (the closure below would still list it).
    prod = producers(program)
    for ins in program.instructions:
        if ins.wait_id >= 0 and ins.wait_count != len(prod.get(ins.wait_id, [])):
            problems.append(f"#{ins.index} {ins.opcode.name} waits for {ins.wait_count} signals on counter "
                            f"{ins.wait_id}, which {len(prod.get(ins.wait_id, []))} instructions signal")
            if len(problems) >= limit:
                return problems
    closure = dependency_closure(program)
    mods = {ins.index: STAGE_MODULES[ins.opcode] for ins in program.instructions}
    problems += conflicting_pairs(program.instructions,
                                  lambda ins: (mods[ins.index].reads(ins, layout), mods[ins.index].writes(ins, layout)),
                                  lambda a, b: a in closure[b] or b in closure[a], limit - len(problems))
    return problems


def conflicting_pairs(instructions, accesses, ordered, limit: int = 10) -> list[str]:
    """Pairs of instructions touching overlapping regions, at least one writing, that `ordered(a, b)`
    (by instruction index) does not order. `accesses(ins)` -> (read regions, written regions); a
    region is (buffer, layer, lo, hi). Overlapping regions are found by a sweep over each (buffer,
    layer) in order of `lo` (the cost is the overlapping pairs, not all pairs: the full-size programs
    have tens of thousands of instructions); the problems come out in the order of the plain double loop
    (per region group: by the writer's access, then the other's)."""
    problems: list[str] = []
    for group in region_groups(instructions, accesses):
        found: list[tuple[int, int]] = []          # (writer's position in the group, the other's)
        active: list[tuple[int, int]] = []         # heap of (hi, position) of regions begun, not yet ended
        for pos in sorted(range(len(group)), key=lambda k: group[k][1][2]):
            reg = group[pos][1]
            while active and active[0][0] <= reg[2]:
                heapq.heappop(active)
            for _, q in active:
                if not _overlap(group[q][1], reg):
                    continue
                for w, o in ((q, pos), (pos, q)):
                    wi, _, wwrite = group[w]
                    oi, _, owrite = group[o]
                    if wwrite and oi != wi and not (owrite and oi < wi):
                        found.append((w, o))
            heapq.heappush(active, (reg[3], pos))
        for w, o in sorted(found):
            wi, wreg, _ = group[w]
            oi, _, owrite = group[o]
            if ordered(wi, oi):
                continue
            problems.append(race(instructions, wi, wreg, oi, owrite))
            if len(problems) >= limit:
                return problems
    return problems


def region_groups(instructions, accesses) -> list[list[tuple[int, tuple, bool]]]:
    """Every access as (instruction index, region, is a write), grouped by (buffer, layer), in instruction
    order and within an instruction its reads, then its writes."""
    by_key: dict[tuple, list[tuple[int, tuple, bool]]] = {}
    for ins in instructions:
        reads, writes = accesses(ins)
        for region in reads:
            by_key.setdefault(region[:2], []).append((ins.index, region, False))
        for region in writes:
            by_key.setdefault(region[:2], []).append((ins.index, region, True))
    return list(by_key.values())


def race(instructions, wi: int, wreg: tuple, oi: int, owrite: bool) -> str:
    """The report of writer #wi (region wreg) racing with #oi (a writer too where owrite)."""
    kind = "write/write" if owrite else "read-after-write"
    return (f"{kind} race on {wreg[0]}[layer {wreg[1]}] between "
            f"#{wi} {instructions[wi].opcode.name} and #{oi} {instructions[oi].opcode.name}")
