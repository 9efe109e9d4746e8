"""Static checks of a step program: every instruction waits (directly or through a chain) for every
instruction that writes what it reads, and no two unordered instructions touch the same data with
at least one write (a race either way: read-after-write or write-after-read)."""

from __future__ import annotations

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
    by_key: dict[tuple, list[tuple[int, tuple, bool]]] = {}
    for ins in program.instructions:
        mod = STAGE_MODULES[ins.opcode]
        for region in mod.reads(ins, layout):
            by_key.setdefault(region[:2], []).append((ins.index, region, False))
        for region in mod.writes(ins, layout):
            by_key.setdefault(region[:2], []).append((ins.index, region, True))
    instrs = program.instructions
    for accesses in by_key.values():
        writes = [a for a in accesses if a[2]]
        for wi, wreg, _ in writes:
            for oi, oreg, owrite in accesses:
                if oi == wi or not _overlap(wreg, oreg) or (owrite and oi < wi):
                    continue
                if wi in closure[oi] or oi in closure[wi]:
                    continue
                kind = "write/write" if owrite else "read-after-write"
                problems.append(f"{kind} race on {wreg[0]}[layer {wreg[1]}] between "
                                f"#{wi} {instrs[wi].opcode.name} and #{oi} {instrs[oi].opcode.name}")
                if len(problems) >= limit:
                    return problems
    return problems
