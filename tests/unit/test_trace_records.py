"""Trace mode's records (MegakernelEngine.trace_records, decoded by megakernel.runtime.engine.decode_trace):
each stamp is the low 32 bits of globaltimer stored as int32, read as a signed distance from the step's earliest
instruction begin, across the counter's wrap and for stamps taken before that begin (the producer warp issues
weight slots before the consumers stamp their first instruction). CPU only: the buffer is written here."""

from __future__ import annotations

import random

import torch

from megakernel.instructions.opcodes import Opcode
from megakernel.kernel.stream import (TR_BEGIN, TR_CONSUMED, TR_END, TR_EPILOGUE, TR_ISSUED_FIRST, TR_ISSUED_LAST,
                                      TR_LANDED_FIRST, TR_LANDED_LAST, TR_OP, TR_READY, TR_REACHED_LAST, TR_SM,
                                      TR_STAGED, TR_STAGING, TR_WAIT_FREE, TR_WAIT_IN_FLIGHT, TR_WAIT_LANDED,
                                      TRACE_WORDS)
from megakernel.runtime.engine import decode_trace


def as_int32(ns: int) -> int:
    """globaltimer's low 32 bits, as st_i32 stores them (a two's-complement int32)."""
    lo = ns & 0xFFFFFFFF
    return lo - (1 << 32) if lo >= 1 << 31 else lo


def test_decode_trace_gives_signed_distances_from_the_earliest_begin_across_the_counter_wrap():
    rng = random.Random(7)
    # (the last starts put the counter's wrap, and int32's sign change, between two SMs' first begins)
    for start in (5_000, (1 << 32) - 3_000, (1 << 31) - 10_000, rng.randrange(1 << 40), (1 << 32) - 1_500,
                  (1 << 31) - 1_500):
        lengths = [2, 0, 1]
        t = torch.zeros(3, 2, TRACE_WORDS, dtype=torch.int32)
        smids = rng.sample(range(132), 3)        # the physical SM each CTA ran on, in its first record alone
        want = {}
        for sm, n in enumerate(lengths):
            t[sm, 0, TR_SM] = smids[sm]
            for i in range(n):
                begin = 1_000 * sm + 5_000 * i + rng.randrange(500)       # ns after the step's first begin
                rel = {"begin": begin, "ready": begin + 700, "end": begin + 9_000}
                op = Opcode.GATE_UP if i == 0 else Opcode.ATTN_PARTIAL
                if op == Opcode.GATE_UP:
                    # a matvec: the producer began issuing its slots before any consumer stamp of the step
                    rel.update(staged=begin + 1_200, streamed=begin + 8_000, landed_first=begin + 1_500,
                               reached_last=begin + 6_100, landed_last=begin + 7_900,
                               stream_begin=-4_000 - rng.randrange(900),
                               stream_end=begin + 7_000, epilogue_done=begin + 8_600)
                words = {"begin": TR_BEGIN, "ready": TR_READY, "end": TR_END, "staged": TR_STAGED,
                         "streamed": TR_CONSUMED, "landed_first": TR_LANDED_FIRST, "landed_last": TR_LANDED_LAST,
                         "reached_last": TR_REACHED_LAST,
                         "stream_begin": TR_ISSUED_FIRST, "stream_end": TR_ISSUED_LAST, "epilogue_done": TR_EPILOGUE}
                t[sm, i, TR_OP] = (10 * sm + i) * 256 + int(op)
                for name, ns in rel.items():
                    t[sm, i, words[name]] = as_int32(start + ns)
                want[(sm, i)] = dict(rel, sm=sm, smid=smids[sm], index=10 * sm + i, opcode=op.name)
                if op == Opcode.GATE_UP:
                    # the ring waits and the staging time are durations: read as they are, whatever the stamps'
                    # origin
                    waits = {"wait_free": rng.randrange(5_000), "wait_in_flight": rng.randrange(5_000),
                             "wait_landed": rng.randrange(5_000), "staging": rng.randrange(5_000)}
                    for name, word in (("wait_free", TR_WAIT_FREE), ("wait_in_flight", TR_WAIT_IN_FLIGHT),
                                       ("wait_landed", TR_WAIT_LANDED), ("staging", TR_STAGING)):
                        t[sm, i, word] = waits[name]
                    want[(sm, i)]["durations"] = waits
        # the earliest begin is SM 0's first instruction: distances are from it
        base = want[(0, 0)]["begin"]
        got = {(r["sm"], i): r for r in decode_trace(t, lengths) for i in [r["index"] % 10]}
        assert set(got) == set(want), (start, sorted(got))
        for key, w in want.items():
            durations = w.pop("durations", {})
            expect = {k: (v - base if isinstance(v, int) and k not in ("sm", "smid", "index") else v)
                      for k, v in w.items()}
            assert got[key] == dict(expect, **durations), (start, key, got[key], expect, durations)


def test_decode_trace_leaves_out_a_matvec_group_whose_last_word_is_unset():
    t = torch.zeros(1, 1, TRACE_WORDS, dtype=torch.int32)
    t[0, 0, TR_OP] = int(Opcode.ARGMAX)
    t[0, 0, TR_BEGIN], t[0, 0, TR_READY], t[0, 0, TR_END], t[0, 0, TR_SM] = 100, 250, 400, 17
    (rec,) = decode_trace(t, [1])
    assert rec == {"sm": 0, "smid": 17, "index": 0, "opcode": "ARGMAX", "begin": 0, "ready": 150, "end": 300}
