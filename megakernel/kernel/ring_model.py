"""A model of the weight ring's protocol on the CPU: one CTA's producer warp and consumer warps over the
ring's full and empty mbarriers, with the waits' parity semantics as the hardware has them, under random
timings. It checks what the device code (megakernel.kernel.stream, .matvec) relies on and cannot check itself:

  - a wait passes on the phase it means: a consumer's wait for use u of a ring slot (parity u % 2) passes with
    exactly u + 1 phases of the slot's full barrier completed, never u - 1 (the same parity: it would read the
    slot before its copy landed); the producer's wait to refill a slot for use u passes with exactly u phases
    of its empty barrier completed (every reader of use u - 1 gone), never u - 2;
  - no deadlock: the producer's in-order refills, the in-flight cap (a smaller one while the consumers cross a
    hop: stream.HOP_IN_FLIGHT) and the consumers' visiting order never wait on each other in a cycle;
  - every part of every slot is read once, by the warp the rule names.

Past SPLIT_BATCH (megakernel.kernel.matvec_wide) every consumer warp waits for every slot and a warpgroup keeps a
set of four slots until the set's last has landed (`wide_programs`, `simulate_wide_ring`): the same checks, and a
ring too shallow for a set is the deadlock the model must see.

`reader_warp` is the rule itself, over the reader warps up to SPLIT_BATCH (`ring_readers`: the most consumer warps
that divide the ring's parts), which the device code calls (or, where ring_slot * parts + part stays below 2 x
readers, as on every layout the engine builds, computes as that sum less readers at most). Pure Python (no CuTe
DSL), so the suite runs it on the real presets' slot sequences (tests/unit/test_ring_model.py), as the schedule's
VM runs its queues.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass


def reader_warp(ring_slot, part, parts: int, warps: int):
    """The consumer warp that reads part `part` of ring slot `ring_slot` in every use of that slot: fixed per
    (ring slot, part), so a warp's wait for use u follows its own read of use u - 1 (the parity argument
    above). Works on ints and on the kernel's Int32 values alike."""
    return (ring_slot * parts + part) % warps


def ring_readers(ring_slots: int, parts: int, warps: int) -> int:
    """The consumer warps that read the ring up to SPLIT_BATCH: the most, up to `warps`, that divide the ring's
    parts (ring_slots x parts), so that any run of n consecutive ring parts (a tile's slots, which follow one
    another round the ring) gives no warp more than ceil(n / readers) of them. With all 15 warps, 12 ring slots and
    2 parts (qwen3-0.6b 1) the 24 parts wrap onto warps 0-8 twice and 9-14 once: 5 of 12 six-slot tiles gave a
    warp two items in series, where 12 readers give each one (H100, 2026-12-07: qwen3-0.6b 1 -2.1%, llama-3.2-1b
    1 -0.3%, llama-3.1-8b 1 -0.2%, logits bit for bit; profiles/RESULTS.md). At batch 2-8 (one part, at most 12
    slots) they are the first ring_slots warps, as before the rule."""
    return max(d for d in range(1, warps + 1) if (ring_slots * parts) % d == 0)


class RingProtocolError(AssertionError):
    """A wait passed on the wrong phase, a part was read twice or never, or the CTA deadlocked."""


@dataclass
class RingRun:
    """What a simulated run did: slots issued, parts read, the most slots in flight (issued, not landed) at once,
    and how many reads found their slot not landed yet and waited."""

    slots: int = 0
    reads: int = 0
    max_in_flight: int = 0
    waited: int = 0
    hop_issued: int = 0       # slots issued while the consumers crossed a hop (under hop_in_flight)


class _Barrier:
    """An mbarrier: `count` arrivals complete a phase; `completed` phases so far."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        """mbarrier.try_wait.parity: true once the phase of that parity has completed, i.e. while the
        current (incomplete) phase has the other parity."""
        return self.completed % 2 != parity


@dataclass(frozen=True)
class _Step:
    """One item of a consumer warp's program: wait for `slot` to land (its use's phase), then, if `read`, read for
    a random time; then arrive on the empty barrier of each slot in `release`."""

    slot: int
    release: tuple[int, ...]
    read: tuple[int, int] | None       # (slot, part) read, counted; None: pass the slot on without reading


def simulate_ring(chunks: list[int], ring_slots: int, parts: int, warps: int, max_in_flight: int,
                  seed: int = 0, reader=None, land_ns: tuple[int, int] = (500, 2000),
                  read_ns: tuple[int, int] = (100, 1500), hop_in_flight: int | None = None,
                  hop_ns: tuple[int, int] = (300, 3000)) -> RingRun:
    """Run one CTA's ring over `chunks` (the slot counts of the queue's matvec chunks in order: the consumer
    warps meet at a barrier after each, as the epilogue of a chunk makes them) with random landing and reading
    times; RingProtocolError on any violation (see the module docstring). `reader(slot_number, part)` -> warp
    replaces the rule (reader_warp of the slot's ring slot) to test another. With `hop_in_flight`, every chunk's
    barrier starts a hop (the epilogue, the signal, the wait and the next input's staging: hop_ns) in which no
    consumer reads and the producer keeps at most that many slots on its way instead of max_in_flight (every
    chunk, where the device holds only after a tile's last one: a superset of its hops)."""
    if reader is None:
        def reader(k, p):
            return reader_warp(k % ring_slots, p, parts, warps)
    # each warp's program, in the device code's order: chunk by chunk, slot by slot, part by part, the parts
    # the rule gives it; a barrier of all consumer warps after every chunk
    programs: list[list[_Step | None]] = [[] for _ in range(warps)]
    k0 = 0
    for n in chunks:
        for k in range(k0, k0 + n):
            for p in range(parts):
                programs[reader(k, p)].append(_Step(k, (k,), (k, p)))
        for prog in programs:
            prog.append(None)                       # the chunk's barrier
        k0 += n
    return _run_ring(programs, sum(chunks), ring_slots, parts, parts, max_in_flight, seed, land_ns, read_ns,
                     hop_in_flight, hop_ns)


def wide_programs(chunks: list[tuple[int, int]], warps: int) -> list[list[_Step | None]]:
    """The consumer warps' programs past SPLIT_BATCH (megakernel.kernel.matvec_wide), over `chunks` of (slabs, row
    groups): slab by slab, each slab's row groups one slot each. Every warp waits for every slot; row groups go in
    sets of 4 (set S = rg // 4, warpgroup S % 2 of the two, 4 warps each): the other warpgroup's warps pass a slot on
    at once, the set's own warps keep theirs until the set's last slot has landed (its fourth, or the slab's last
    row group), multiply the set and then release all of its slots; a barrier of all warps after every chunk."""
    programs: list[list[_Step | None]] = [[] for _ in range(warps)]
    k = 0
    for slabs, groups in chunks:
        for _ in range(slabs):
            for rg in range(groups):
                last = rg % 4 == 3 or rg == groups - 1
                first = k - rg % 4
                for w in range(warps):
                    if (rg // 4) % 2 != w // 4:
                        programs[w].append(_Step(k, (k,), None))
                    elif last:
                        programs[w].append(_Step(k, tuple(range(first, k + 1)), (k, w % 4)))
                    else:
                        programs[w].append(_Step(k, (), None))
                k += 1
        for prog in programs:
            prog.append(None)
    return programs


def simulate_wide_ring(chunks: list[tuple[int, int]], ring_slots: int, warps: int, max_in_flight: int,
                       seed: int = 0, land_ns: tuple[int, int] = (500, 2000), read_ns: tuple[int, int] = (100, 1500),
                       hop_in_flight: int | None = None, hop_ns: tuple[int, int] = (300, 3000)) -> RingRun:
    """simulate_ring for the consumers past SPLIT_BATCH (wide_programs): each slot's empty barrier counts one
    arrival of every warp; `reads` counts the sets multiplied, one per (set's last slot, warp of its warpgroup)."""
    total = sum(slabs * groups for slabs, groups in chunks)
    return _run_ring(wide_programs(chunks, warps), total, ring_slots, warps, 4, max_in_flight, seed, land_ns,
                     read_ns, hop_in_flight, hop_ns)


def _run_ring(programs: list[list[_Step | None]], total: int, ring_slots: int, arrivals: int, parts: int,
              max_in_flight: int, seed: int, land_ns: tuple[int, int], read_ns: tuple[int, int],
              hop_in_flight: int | None, hop_ns: tuple[int, int]) -> RingRun:
    """The event loop shared by both: `programs` per consumer warp, `arrivals` per empty barrier's phase, `parts`
    the read ids' range per slot (each read (slot, part) done at most once)."""
    rng = random.Random(seed)
    warps = len(programs)
    full = [_Barrier(1) for _ in range(ring_slots)]
    empty = [_Barrier(arrivals) for _ in range(ring_slots)]
    released = [0] * total
    read = [[0] * parts for _ in range(total)]
    run = RingRun(slots=total)
    now = 0
    events: list[tuple[int, int, str, int]] = []    # (time, seq, kind, who)
    seq = 0

    def later(dt: int, kind: str, who: int):
        nonlocal seq
        heapq.heappush(events, (now + dt, seq, kind, who))
        seq += 1

    issued, landed = 0, set()
    pc = [0] * warps                                # each warp's position in its program
    busy = [False] * warps                          # a warp reading a slot part
    at_barrier = [False] * warps
    blocked = [False] * warps                       # a warp's current read found its slot not landed
    hop = False                                     # the consumers are crossing a hop (hop_in_flight)
    cap_wait = None                                 # (slot the producer's cap wait is on, read during a hop)

    def release(step: _Step):
        for j in step.release:
            released[j] += 1
            empty[j % ring_slots].arrive()

    def producer_step() -> bool:
        """Issue the next slot if its waits pass; True if it did."""
        nonlocal issued, cap_wait
        if issued >= total:
            return False
        k = issued
        r, u = k % ring_slots, k // ring_slots
        if not empty[r].passes((u % 2) ^ 1):
            return False
        if empty[r].completed != u:
            raise RingProtocolError(f"producer refilled ring slot {r} for use {u} with {empty[r].completed} "
                                    f"phases of its empty barrier complete (its readers of use {u - 1} not all gone)")
        if cap_wait is None:
            # the device reads the hold once per slot, past the empty wait, then blocks on that slot's full barrier
            cap_wait = (k - (hop_in_flight if hop else max_in_flight), hop)
        kf, during_hop = cap_wait
        if kf >= 0 and kf not in landed:
            return False                            # (the device waits on slot kf's full barrier)
        cap_wait = None
        issued += 1
        run.hop_issued += during_hop
        run.max_in_flight = max(run.max_in_flight, issued - len(landed))
        later(rng.randint(*land_ns), "land", k)
        return True

    def warp_step(w: int) -> bool:
        """Advance warp w if it can; True if it did."""
        nonlocal hop
        if busy[w] or hop or pc[w] >= len(programs[w]):
            return False
        item = programs[w][pc[w]]
        if item is None:                            # the chunk's barrier: all warps meet
            at_barrier[w] = True
            if all(at_barrier[v] or pc[v] >= len(programs[v]) for v in range(warps)):
                for v in range(warps):
                    if at_barrier[v]:
                        at_barrier[v] = False
                        pc[v] += 1
                if hop_in_flight is not None:
                    hop = True
                    later(rng.randint(*hop_ns), "staged", 0)
                return True
            return False
        k = item.slot
        r, u = k % ring_slots, k // ring_slots
        if not full[r].passes(u % 2):
            blocked[w] = True
            return False
        if full[r].completed != u + 1:
            raise RingProtocolError(f"warp {w} passed its wait for use {u} of ring slot {r} (slot {k}) with "
                                    f"{full[r].completed} phases of the full barrier complete")
        run.waited += blocked[w]
        blocked[w] = False
        if item.read is None:                       # passed on (or kept for its set) at once
            release(item)
            pc[w] += 1
            return True
        busy[w] = True
        read[k][item.read[1]] += 1
        later(rng.randint(*read_ns), "read", w)
        return True

    while True:
        progressed = True
        while progressed:
            progressed = producer_step()
            for w in rng.sample(range(warps), warps):
                progressed = warp_step(w) or progressed
        if not events:
            break
        now, _, kind, who = heapq.heappop(events)
        if kind == "staged":
            hop = False
        elif kind == "land":
            landed.add(who)
            full[who % ring_slots].arrive()
        else:
            busy[who] = False
            release(programs[who][pc[who]])
            pc[who] += 1
            run.reads += 1
    stuck = [w for w in range(warps) if pc[w] < len(programs[w])]
    if issued < total or stuck:
        raise RingProtocolError(f"deadlock: {issued} of {total} slots issued, warps {stuck} stopped at "
                                f"{[programs[w][pc[w]] for w in stuck]}")
    for k in range(total):
        if released[k] != arrivals:
            raise RingProtocolError(f"slot {k} released {released[k]} times, not {arrivals}")
        for p in range(parts):
            if read[k][p] > 1:
                raise RingProtocolError(f"part {p} of slot {k} read {read[k][p]} times")
    return run
