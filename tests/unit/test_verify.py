"""schedule.verify.conflicting_pairs, the race finder every family's check uses, against the plain
double loop over every (writer, other access) pair it replaced: on random instructions and regions
(empty regions, shared bounds, several regions per instruction, random orderings) it reports the same
problems in the same order, with any limit. Both take the accesses grouped by region_groups and word a
report with race: what differs is the pairing."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from megakernel.instructions.opcodes import Opcode
from megakernel.schedule.verify import _overlap, conflicting_pairs, race, region_groups


def double_loop(instructions, accesses, ordered, limit):
    """Every (writer, other access) pair of each region group, in the order the sweep promises."""
    problems = []
    for group in region_groups(instructions, accesses):
        for wi, wreg, _ in (a for a in group if a[2]):
            for oi, oreg, owrite in group:
                if oi == wi or not _overlap(wreg, oreg) or (owrite and oi < wi) or ordered(wi, oi):
                    continue
                problems.append(race(instructions, wi, wreg, oi, owrite))
                if len(problems) >= limit:
                    return problems
    return problems


region = st.tuples(st.sampled_from(["x", "h"]), st.integers(0, 1), st.integers(0, 12), st.integers(0, 6)).map(
    lambda r: (r[0], r[1], r[2], r[2] + r[3]))
access = st.tuples(st.lists(region, max_size=3), st.lists(region, max_size=3))


@given(acc=st.lists(access, min_size=1, max_size=12), edges=st.sets(st.tuples(st.integers(0, 11), st.integers(0, 11))),
       limit=st.integers(1, 30))
def test_sweep_reports_what_the_double_loop_reports(acc, edges, limit):
    instructions = [SimpleNamespace(index=i, opcode=Opcode.QKV if i % 2 else Opcode.DOWN) for i in range(len(acc))]

    def accesses(ins):
        return acc[ins.index]

    def ordered(a, b):
        return (a, b) in edges or (b, a) in edges

    assert conflicting_pairs(instructions, accesses, ordered, limit) == \
        double_loop(instructions, accesses, ordered, limit)
