"""The checks of a DeepSeek (and Kimi Linear) step program that the schedule's tests and the VM decoders rely on:
its structure (check_program) and its races (find_races, the generic schedule.verify over each stage's reads and
writes)."""

from __future__ import annotations

import bisect

from ..instructions import STAGE_MODULES
from ..instructions.matvec_stages import per_batch
from ..instructions.opcodes import Opcode
from ..instructions.record import NO_COUNTER, Instruction
from .dag import StepProgram
from .deepseek import DeepseekStepLayout, DeepseekStepProgram
from .verify import conflicting_pairs


def check_program(program: DeepseekStepProgram) -> None:
    """Structural invariants of a step program (raises AssertionError naming the instruction):
    indices are the global order, every instruction but EMBED waits on a counter, every one signals
    one, and each wait target equals the number of instructions earlier in the order that signal it."""
    signalled: dict[int, int] = {}
    for i, ins in enumerate(program.instructions):
        assert ins.index == i, f"#{i} has index {ins.index}"
        assert ins.signal_id != NO_COUNTER, f"#{i} {ins.opcode.name} signals no counter"
        if ins.opcode != Opcode.EMBED:
            assert ins.wait_id != NO_COUNTER, f"#{i} {ins.opcode.name} waits on no counter"
            have = signalled.get(ins.wait_id, 0)
            assert have == ins.wait_count, (f"#{i} {ins.opcode.name} waits counter "
                                            f"{program.counter_names[ins.wait_id]} for {ins.wait_count}, "
                                            f"{have} signallers precede it")
        signalled[ins.signal_id] = signalled.get(ins.signal_id, 0) + 1
    total = {cid: cnt for cid, cnt in signalled.items()}
    for ins in program.instructions:
        if ins.wait_id != NO_COUNTER:
            assert total[ins.wait_id] == ins.wait_count, (
                f"#{ins.index} {ins.opcode.name} waits for {ins.wait_count} of counter "
                f"{program.counter_names[ins.wait_id]}, which {total[ins.wait_id]} instructions signal")


# ---- race check -----------------------------------------------------------------------------------

def stage_reads(ins: Instruction, layout: DeepseekStepLayout) -> list:
    """Regions an instruction reads. The dense matvec stages reused here (GATE_UP, DOWN, LM_HEAD)
    size their input from the dense config's fields, so their reads are stated here for DeepSeek;
    every other stage answers through its module."""
    c, nb = layout.config, layout.batch
    H, l = c.hidden_size, ins.layer
    if ins.opcode == Opcode.GATE_UP:
        return per_batch("h", l, 0, H, nb, H)
    if ins.opcode == Opcode.DOWN:
        F = c.intermediate_size
        return per_batch("act", l, 0, F, nb, F) + per_batch("h", l, ins.a0, ins.a0 + ins.a1, nb, H)
    if ins.opcode == Opcode.LM_HEAD:
        return per_batch("x", c.num_layers, 0, H, nb, H)
    return STAGE_MODULES[ins.opcode].reads(ins, layout)


def stage_writes(ins: Instruction, layout: DeepseekStepLayout) -> list:
    return STAGE_MODULES[ins.opcode].writes(ins, layout)


def _predecessor_bits(program: StepProgram) -> list[int]:
    """dependency_closure as bitsets (bit p of entry i: instruction p finishes before i starts), one
    union per counter rather than per instruction: fast enough for real shapes. Unlike
    dependency_closure it honours wait_count: a wait for fewer than all of a counter's signallers
    guarantees none of them in particular."""
    producers: dict[int, list[int]] = {}
    for ins in program.instructions:
        if ins.signal_id != NO_COUNTER:
            producers.setdefault(ins.signal_id, []).append(ins.index)
    bits: list[int] = []
    cache: dict[tuple[int, int, int], int] = {}
    for ins in program.instructions:
        # producers later in the global order are a schedule bug (simulate reports it); their
        # closures are unknown here, so they only ever shrink what counts as ordered
        prods = producers.get(ins.wait_id, [])
        earlier = prods[:bisect.bisect_left(prods, ins.index)]
        key = (ins.wait_id, len(earlier), ins.wait_count)
        if key not in cache:
            acc = 0
            if earlier and ins.wait_count >= len(prods):
                for p in earlier:          # all of them have signalled
                    acc |= bits[p] | (1 << p)
            elif earlier and ins.wait_count > 0 and len(earlier) == len(prods):
                # any wait_count of them may be the ones done: only what every one of them waited for
                acc = bits[earlier[0]]
                for p in earlier[1:]:
                    acc &= bits[p]
            cache[key] = acc
        bits.append(cache[key])
    return bits


def find_races(program: DeepseekStepProgram, limit: int = 10) -> list[str]:
    """Unordered conflicting pairs (schedule.verify.find_races over stage_reads / stage_writes): two
    instructions touching the same region, at least one writing it, neither waiting (transitively)
    for the other. Empty when the program is race-free."""
    layout = program.layout
    before = _predecessor_bits(program)

    def ordered(a: int, b: int) -> bool:
        return bool((before[a] >> b) & 1 or (before[b] >> a) & 1)

    return conflicting_pairs(program.instructions,
                             lambda ins: (stage_reads(ins, layout), stage_writes(ins, layout)), ordered, limit)
