"""tools/gpu_sweep.py's CPU parts: the variant spec parser, the interleaved timing rounds and the trace's
reading of a stage's end times."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("tools_gpu_sweep", REPO / "tools" / "gpu_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_splits_kernel_options_from_engine_arguments(sweep):
    assert sweep.parse("default:") == ("default", {}, {})
    name, opts, eng = sweep.parse("x:fold_embed=1,timeout_ns=5000,kv_splits=2,slabs=0,policy=balanced,fuse=0")
    assert name == "x" and opts == {"timeout_ns": 5000}
    assert eng == {"fold_embed": True, "kv_splits": 2, "slab_staging": False, "policy": "balanced",
                   "fuse_attn_reduce": False}


def test_interleaved_rounds_visit_every_variant_in_turn(sweep):
    calls = []
    clock = {"a": iter([1.0, 3.0, 2.0, 9.0, 9.0, 9.0]), "b": iter([5.0, 4.0, 6.0, 7.0, 5.5, 5.0])}

    def timer(name):
        def one():
            calls.append(name)
            return next(clock[name])
        return one

    got = sweep.interleaved({"a": timer("a"), "b": timer("b")}, rounds=3, steps=2)
    assert calls == ["a", "a", "b", "b"] * 3
    # a: rounds [1, 3] [2, 9] [9, 9] -> round medians 2, 5.5, 9; all six samples (1 2 3 9 9 9): median 6
    assert got["a"] == (6.0, 2.0, 9.0)
    # b: rounds [5, 4] [6, 7] [5.5, 5] -> 4.5, 6.5, 5.25; median of all 5.25
    assert got["b"] == (5.25, 4.5, 6.5)


def test_end_spread_tells_a_few_late_tiles_from_ends_spread_over_all(sweep):
    """A stage's tail (last end after the median's) against its 90th percentile's: one late tile of 21 leaves the
    p90 at the pack while the tail is its lateness; ends spread evenly put both near each other. Means over layers,
    in us from ns stamps."""
    import random

    rng = random.Random(5)
    pack = [{"end": 10_000 + rng.randrange(100)} for _ in range(20)]
    straggler = [pack + [{"end": 11_500}], pack + [{"end": 12_500}]]
    tail, p90 = sweep.end_spread(straggler)
    med = sorted(r["end"] for r in straggler[0])[10]
    assert tail == pytest.approx((11_500 + 12_500) / 2 / 1e3 - med / 1e3) and p90 < 0.1 < 1.0 < tail
    even = [[{"end": 10_000 + 100 * i} for i in range(21)]]
    tail, p90 = sweep.end_spread(even)
    assert tail == pytest.approx(1.0) and p90 == pytest.approx(0.8)


def test_cache_positions_cover_the_timed_steps_and_the_asked_cache_in_whole_blocks(sweep):
    """--cache: a serving engine's long cache with a short context; never fewer positions than the replays need."""
    need = 32 + 5 * sweep.STEPS + sweep.HEADROOM
    assert sweep.cache_positions(32, 5) == max(512, -(-need // sweep.BLOCK) * sweep.BLOCK)
    assert sweep.cache_positions(32, 5, cache=4096) == 4096
    assert sweep.cache_positions(32, 5, cache=4001) == 4001 // sweep.BLOCK * sweep.BLOCK + sweep.BLOCK
    assert sweep.cache_positions(8192, 5, cache=1024) >= 8192 + 5 * sweep.STEPS
    assert all(sweep.cache_positions(c, r, k) % sweep.BLOCK == 0 for c in (1, 33, 900) for r in (1, 3)
               for k in (0, 100, 777))


def test_help_and_missing_arguments_stop_before_any_gpu_work(sweep, monkeypatch, capsys):
    """--help prints the usage; a missing MODEL or BATCH, a bad value or an unknown flag exits with the usage
    line, before any weights are made or the GPU is touched."""
    monkeypatch.setattr(sweep, "random_weights", lambda *a, **k: pytest.fail("weights made"))
    monkeypatch.setattr(sweep.sys, "argv", ["gpu_sweep.py", "--help"])
    with pytest.raises(SystemExit) as done:
        sweep.main()
    assert done.value.code == 0 and "Usage: gpu_sweep.py MODEL BATCH" in capsys.readouterr().out
    for argv in (["gpu_sweep.py"], ["gpu_sweep.py", "llama-3.2-1b"], ["gpu_sweep.py", "llama-3.2-1b", "x:timeout_ns=2"],
                 ["gpu_sweep.py", "--no-trace", "llama-3.2-1b"], ["gpu_sweep.py", "llama-3.2-1b", "1", "--context=8k"],
                 ["gpu_sweep.py", "llama-3.2-1b", "1", "--rounds=0"],
                 # an unknown flag (a misspelt one would otherwise be ignored)
                 ["gpu_sweep.py", "llama-3.2-1b", "1", "--calibrate"],
                 ["gpu_sweep.py", "llama-3.2-1b", "1", "--notrace"]):
        monkeypatch.setattr(sweep.sys, "argv", argv)
        with pytest.raises(SystemExit, match="usage: gpu_sweep.py MODEL BATCH"):
            sweep.main()


@pytest.mark.parametrize("context,rounds", [(32, 5), (8192, 5), (8192, 1), (4000, 12)])
def test_the_cache_holds_every_timed_replay(sweep, context, rounds):
    """Each replay of the captured step decodes one position further (the kernel advances positions): the
    cache holds the last timed replay's position and the trace's three steps after it (at 8192 tokens the
    sweep once sized it for 64 replays and timed 100)."""
    last = context + rounds * sweep.STEPS - 1
    n = sweep.cache_positions(context, rounds)
    assert last + 3 < n
    # whole cache blocks: the engine rounds max_seq_len up to them, and the weights are packed once for n
    # positions (at 8192 tokens an unrounded n left the rounded engine 11 positions short)
    assert n % sweep.BLOCK == 0


def test_hop_waits_measure_from_the_last_producers_end_to_each_waiting_consumers_ready(sweep):
    from types import SimpleNamespace as I
    # instructions 0-2 signal counter 5 (ends 100, 400, 250); 3 and 4 wait on it (3 began before the last end:
    # a hop of 460 - 400; 4 began after it and is left out); 5 waits on counter 6, signalled by 3 alone
    ins = [I(wait_id=-1, signal_id=5), I(wait_id=-1, signal_id=5), I(wait_id=-1, signal_id=5),
           I(wait_id=5, signal_id=6), I(wait_id=5, signal_id=-1), I(wait_id=6, signal_id=-1)]
    recs = [dict(index=0, opcode="QKV", begin=0, ready=0, end=100),
            dict(index=1, opcode="QKV", begin=0, ready=0, end=400),
            dict(index=2, opcode="QKV", begin=0, ready=0, end=250),
            dict(index=3, opcode="ATTN_PARTIAL", begin=50, ready=460, end=900),
            dict(index=4, opcode="ATTN_PARTIAL", begin=420, ready=430, end=950),
            dict(index=5, opcode="O_PROJ", begin=300, ready=1_000, end=2_000)]
    assert sweep.hop_waits(recs, ins) == {3: 60, 5: 100}


def test_layer_groups_hold_each_layers_records_whatever_their_order(sweep):
    """One group per layer by ready stamp, so each layer's last record to end (the trace's "last to end") is its
    group's latest end, whatever its position in the group."""
    import random
    rng = random.Random(5)
    layers, per = 4, 6
    recs, want = [], []
    for layer in range(layers):
        group = [{"ready": 1000 * layer + rng.randrange(100), "end": 1000 * layer + 200 + rng.randrange(500),
                  "index": layer * per + i} for i in range(per)]
        want.append(max(group, key=lambda r: r["end"])["index"])
        recs += group
    rng.shuffle(recs)
    groups = sweep.layer_groups(recs, layers)
    assert [sorted(r["index"] for r in g) for g in groups] == [list(range(i * per, i * per + per))
                                                               for i in range(layers)]
    assert [max(g, key=lambda r: r["end"])["index"] for g in groups] == want


def test_stream_breakdown_reports_a_matvecs_phases_as_means(sweep):
    """The trace's matvec phases, relative to each record's ready stamp, averaged over the records given (every
    tile of a stage, or each layer's last to end)."""
    def rec(ready, **rel):
        return {"ready": ready, **{k: ready + v for k, v in rel.items()}}
    rs = [rec(10_000, stream_begin=-9_000, stream_end=-3_000, staged=600, streamed=2_000, epilogue_done=2_500,
              end=3_500, landed_first=900, reached_last=1_700, landed_last=1_900),
          rec(50_000, stream_begin=-7_000, stream_end=-1_000, staged=1_000, streamed=4_000, epilogue_done=4_500,
              end=5_500, landed_first=1_100, reached_last=1_300, landed_last=3_900)]
    for r in rs:
        r.update(wait_free=2_000, wait_in_flight=400, wait_landed=100, staging=2_500)
    text = sweep.stream_breakdown("DOWN", rs)
    assert "issued    2.00 us before ready, issuing took   6.00 us" in text
    assert "(ready->staged  0.80 us)" in text
    assert "(ready->last slot   3.00 us, epilogue  1.50 us: body  0.50, barrier + release  1.00 us)" in text
    assert "(ready->slots landed  1.00 ..  2.90 us, the last one's reader at its wait  1.50 us)" in text
    assert "(ring waits: free slot   2.00, in flight   0.40, landed   0.10 us; input staging   2.50 us)" in text
    assert sweep.stream_breakdown("EMBED", [{"ready": 0, "end": 5}]) == ""
