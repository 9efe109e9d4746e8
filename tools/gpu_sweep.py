"""Time kernel variants on one set of weights, then trace the first variant: per-stage wait and work
times. Usage: gpu_sweep.py MODEL BATCH 'name:key=val,key=val' ... [--no-trace] [--trace=NAME,...] [--rounds=N]
[--context=N] [--cache=N] (the trace is of the first variant, or of each variant named; the timed steps start at
position --context, 32 by default, each replay one position further, over a cache of random history, and the floor
counts the KV bytes at --context; --cache sets the positions each sequence's cache holds, at least what the timed
steps need: a serving engine's caches hold max_model_len positions whatever the context)

Any KernelOptions field is a variant key (`nocopy:diag_no_copy=1` times the step without weight copies: the
dependency chain and the consumers alone; `nostage:diag_no_stage=1` without the consumers' input staging, past
batch 8 without the bulk copies of the pre-staged input's windows). Every variant is built first (one packed copy of the weights shared by all), its logits checked
against the first variant's, and one step captured in a CUDA graph; then the graphs are timed in
interleaved rounds (each round replays every variant STEPS times), so that clock or thermal drift
during the sweep falls on all variants alike. Per variant: the median of all its replays, and the
spread of its round medians (what a difference between two variants must exceed to mean anything).
The trace's lines per stage: the mean wait and work, the layer span, "hop" (from the end stamp of the last producer
of the counter an instruction waited on to its ready stamp: the release's travel, the poll and the barrier after
it), "tail" (a layer's last instruction's end after its median one's; "p90" beside it, the 90th percentile's: a
tail far past it is a few late tiles), and a matvec's stream and epilogue (thread
0's epilogue body, then the signal's barrier and release), the weight ring's waits (the producer's for a free slot and
on its in-flight cap, consumer warp 0's for a slot to land) and consumer thread 0's time in the input's staging, all
its windows summed (past batch 8: the waits for the windows' bulk copies); under a matvec stage's line, "last to
end": the same for each layer's instruction that ended last (the one the next stage waits for), with its rows."""
import collections, os, statistics, sys
import torch
from megakernel.instructions.layout import pack_weights
from megakernel.instructions.opcodes import Opcode
from megakernel.integrations.floor import floor_ms
from megakernel.kernel.interpreter import KernelOptions
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine, split_engine_options
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import int_flag, positional  # noqa: E402

# the sweep's short names for engine keywords (megakernel.runtime.engine.LAYOUT_OPTIONS)
ALIASES = {"fuse": "fuse_attn_reduce",   # fuse=0: keep the ATTN_REDUCE stage
           "slabs": "slab_staging"}      # slabs=1: stage wide inputs in column slabs

def parse(spec):
    """'name:key=val,...' -> (name, KernelOptions keywords, engine keywords), parsed and checked as
    `megakernel bench --kernel-options` does, with the short names in ALIASES."""
    name, _, kv = spec.partition(":")
    items = []
    for item in filter(None, kv.split(",")):
        k, sep, v = item.partition("=")
        items.append(f"{ALIASES.get(k, k)}{sep}{v}")
    opts, eng = split_engine_options(",".join(items))
    return name, opts, eng

def read_bw(nbytes=2 << 30):
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(12):
        e0.record(); buf.sum(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return nbytes / (sorted(ts)[6] * 1e-3)

def prepare(eng, start=32, seed=None):
    """A step at position `start` over a history of random keys/values (where the cache would hold the
    prompt's), token 1, counters reset; `seed` fixes the history (variants of one model must agree)."""
    if seed is not None:
        torch.manual_seed(seed)
    eng.k_cache.normal_(0, 1); eng.v_cache.normal_(0, 1)
    eng.reset_sync(); eng.bufs.tokens.fill_(1); eng.bufs.positions.fill_(start)

ROUNDS, STEPS = 5, 20
CONTEXT = 32          # the timed step's position unless --context says otherwise
HEADROOM = 64         # cache positions past the context beyond the timed replays (each advances the position)

BLOCK = 16          # the engines' KV cache block size (MegakernelEngine's default)

def cache_positions(context, rounds, cache=0):
    """Positions the engines' caches hold: every timed replay's (each advances the position by one, from
    `context`), plus HEADROOM for the warm-up and trace steps, at least 512 and `cache`, in whole cache blocks
    (the engine rounds its cache up to them, and the one packed copy of the weights must cover the rounded
    count)."""
    n = max(512, cache, context + rounds * STEPS + HEADROOM)
    return -(-n // BLOCK) * BLOCK

def capture(eng, start=32):
    """A CUDA graph of one step from position `start` (each replay decodes the next position: the kernel advances
    positions in place, so the timed steps are at positions start .. start + rounds * STEPS)."""
    prepare(eng, start)
    for _ in range(2): eng.launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eng.launch()
    eng.bufs.positions.fill_(start); torch.cuda.synchronize()
    return g

def replay_ms(g):
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1)

def interleaved(timers, rounds=ROUNDS, steps=STEPS):
    """timers: name -> a function that times one replay (ms). Returns name -> (median of all replays,
    lowest and highest round median), the rounds interleaved over the variants."""
    samples = {name: [] for name in timers}
    round_medians = {name: [] for name in timers}
    for _ in range(rounds):
        for name, one in timers.items():
            ts = [one() for _ in range(steps)]
            samples[name] += ts
            round_medians[name].append(statistics.median(ts))
    return {name: (statistics.median(samples[name]), min(round_medians[name]), max(round_medians[name]))
            for name in timers}

def one_step_logits(eng, start=32):
    """Logits of one step from a fixed cache history and inputs: variants of one model must agree."""
    prepare(eng, start, seed=0)
    eng.launch(); torch.cuda.synchronize(); eng.check()
    return eng.logits.clone()

def hop_waits(recs, instructions):
    """instruction index -> ready - the end stamp of the last instruction that signalled the counter it waited
    on: the hop from the last producer's release to the consumer's barrier after its poll. Instructions whose
    counter was complete before they began are left out (they did not wait for the hop). A trace holds one
    step, so each counter has one set of producers."""
    last_end = {}
    for r in recs:
        sig = instructions[r["index"]].signal_id
        if sig >= 0:
            last_end[sig] = max(last_end.get(sig, r["end"]), r["end"])
    hops = {}
    for r in recs:
        w = instructions[r["index"]].wait_id
        if w >= 0 and w in last_end and r["begin"] < last_end[w]:
            hops[r["index"]] = r["ready"] - last_end[w]
    return hops

def mean_us(rs, later, earlier):
    """The mean over records rs of stamp `later` minus stamp `earlier`, in microseconds."""
    return statistics.mean(r[later] - r[earlier] for r in rs) / 1e3


def stream_breakdown(op, rs):
    """A stage's records, its matvec phases as means (the weight stream, staging, slots, epilogue, ring waits), or
    MV_REDUCE's and the wide ATTN_PARTIAL's phases; "" for other stages."""
    # the weight stream (core 2): how long before the counter was ready its last slot had been issued
    # (positive: the weights were on their way through the hop), and how long issuing took
    stream = ""
    st = [r for r in rs if "stream_end" in r]
    if st:
        stream = (f"  issued {mean_us(st, 'ready', 'stream_end'):7.2f} us before ready, "
                  f"issuing took {mean_us(st, 'stream_end', 'stream_begin'):6.2f} us")
    # MV_REDUCE and ATTN_PARTIAL (past batch 8) stamp their phases in a matvec's staging and last-slot fields
    ph = [r for r in rs if "staged" in r and "streamed" in r]
    if ph and not st and (op.startswith("MV_REDUCE") or op == "ATTN_PARTIAL"):
        a, b, c = mean_us(ph, "staged", "ready"), mean_us(ph, "streamed", "staged"), mean_us(ph, "end", "streamed")
        names = (("ready to start", "loads, sums, stores", "barrier, signal") if op.startswith("MV_REDUCE")
                 else ("phase A (q, k, v)", "phase B (softmax pass)", "phase C, signal"))
        stream = f"  ({names[0]} {a:5.2f} us, {names[1]} {b:5.2f} us, {names[2]} {c:5.2f} us)"
    else:
        sg = [r for r in rs if "staged" in r]
        if sg:
            stream += f"  (ready->staged {mean_us(sg, 'staged', 'ready'):5.2f} us)"
        sd = [r for r in rs if "streamed" in r]
        if sd:
            stream += (f"  (ready->last slot {mean_us(sd, 'streamed', 'ready'):6.2f} us, "
                       f"epilogue {mean_us(sd, 'end', 'streamed'):5.2f} us")
            ep = [r for r in sd if "epilogue_done" in r]
            if ep:
                # thread 0 past its epilogue, then the signal's barrier and release
                stream += (f": body {mean_us(ep, 'epilogue_done', 'streamed'):5.2f}, "
                           f"barrier + release {mean_us(ep, 'end', 'epilogue_done'):5.2f} us")
            stream += ")"
        ld = [r for r in rs if "landed_last" in r]
        if ld:
            stream += (f"  (ready->slots landed {mean_us(ld, 'landed_first', 'ready'):5.2f} .. "
                       f"{mean_us(ld, 'landed_last', 'ready'):5.2f} us")
            rl = [r for r in ld if "reached_last" in r]
            if rl:
                # when the last slot's reader reached its wait: long before it passed, the slot was late; just
                # before, the reader was
                stream += f", the last one's reader at its wait {mean_us(rl, 'reached_last', 'ready'):5.2f} us"
            stream += ")"
        # the weight ring's waits: the producer's for a free slot (the consumers behind the stream) and on the
        # in-flight cap (the copies' latency), consumer warp 0's for its slots to land (the stream behind)
        # and consumer thread 0's time in the input's staging, every window of it (past SPLIT_BATCH: the waits for
        # the windows' bulk copies)
        wr = [r for r in rs if "wait_free" in r and "wait_landed" in r]
        if wr:
            free, cap, landed, staging = (statistics.mean(r[k] for r in wr) / 1e3
                                          for k in ("wait_free", "wait_in_flight", "wait_landed", "staging"))
            stream += (f"  (ring waits: free slot {free:6.2f}, in flight {cap:6.2f}, landed {landed:6.2f} us;"
                       f" input staging {staging:6.2f} us)")
    return stream


def end_spread(groups):
    """(tail, p90) of a per-layer stage in us, means over its layers' groups of records: the last instruction's end
    after the median one's (what the stage's waiters wait for beyond a typical SM), and the 90th percentile's end
    after the median's. A tail far past the p90 is a few late tiles (a wait on them could start without them); a
    tail near it, ends spread over all of them."""
    tails, p90s = [], []
    for g in groups:
        ends = [r["end"] for r in g]
        med = statistics.median(ends)
        tails.append(max(ends) - med)
        p90s.append(statistics.quantiles(ends, n=10, method="inclusive")[8] - med)
    return statistics.mean(tails) / 1e3, statistics.mean(p90s) / 1e3


def layer_groups(rs, layers):
    """A per-layer stage's records, one group per layer: `layers` groups of equal size in order of ready stamp."""
    rs = sorted(rs, key=lambda r: r["ready"])
    per = len(rs) // layers
    return [rs[i:i + per] for i in range(0, len(rs), per)]


def trace(eng, start=32):
    prepare(eng, start)
    for _ in range(3): eng.launch()
    torch.cuda.synchronize(); eng.check()
    recs = eng.trace_records()
    span = max(r["end"] for r in recs) - min(r["begin"] for r in recs)
    by = collections.defaultdict(list)
    for r in recs:
        # MV_REDUCE by the stage it closes (its a2), each its own line
        op = r["opcode"]
        if op == "MV_REDUCE":
            op += "/" + Opcode(eng.program.instructions[r["index"]].a2).name
        by[op].append(r)
    print(f"  trace: step span {span/1e3:.1f} us")
    hops = hop_waits(recs, eng.program.instructions)
    layers = eng.layout.config.num_layers
    for op, rs in by.items():
        # a per-layer stage (its instructions in start order, one group per layer): from its first
        # instruction's start to its last one's end, the mean over layers: the stage's share of the chain
        phase, groups = "", []
        if len(rs) % layers == 0 and len(rs) > layers:
            groups = layer_groups(rs, layers)
            spans = [max(r["end"] for r in g) - min(r["ready"] for r in g) for g in groups]
            tail, p90 = end_spread(groups)
            phase = f"  layer span {statistics.mean(spans)/1e3:6.2f} us, tail {tail:5.2f} us (p90 {p90:5.2f})"
        stream = stream_breakdown(op, rs)
        hv = [hops[r["index"]] for r in rs if r["index"] in hops]
        hop = f"  hop {statistics.mean(hv)/1e3:5.2f} us" if hv else ""
        print(f"    {op:17s} n={len(rs):5d} wait {mean_us(rs, 'ready', 'begin'):7.2f} us  "
              f"work {mean_us(rs, 'end', 'ready'):7.2f} us{phase}{hop}{stream}")
        if groups and any("streamed" in r for r in rs):
            # the same for each layer's last instruction to end: the tile the next stage waits for (the means
            # above are of every tile), with its rows against the typical tile's
            crit = [max(g, key=lambda r: r["end"]) for g in groups]
            rows = statistics.mean(eng.program.instructions[r["index"]].a1 for r in crit)
            typical = statistics.median(eng.program.instructions[r["index"]].a1 for r in rs)
            print(f"      last to end      wait {mean_us(crit, 'ready', 'begin'):7.2f} us  "
                  f"work {mean_us(crit, 'end', 'ready'):7.2f} us  rows {rows:.0f} "
                  f"(median tile {typical:.0f}){stream_breakdown(op, crit)}")

def main():
    usage = ("gpu_sweep.py MODEL BATCH [name:key=val,...] ... [--no-trace] [--trace=NAME,...] [--rounds=N] "
             "[--context=N] [--cache=N]")
    args = positional(__doc__, usage, 2, ints=(1,), flags=("--no-trace", "--trace", "--rounds", "--context", "--cache"))
    model, B = args[0], int(args[1])
    specs = args[2:] or ["default:"]
    context, rounds = int_flag("--context", CONTEXT, usage), int_flag("--rounds", ROUNDS, usage)
    max_seq = cache_positions(context, rounds, int_flag("--cache", 0, usage))
    cfg = get_preset(model)
    w = random_weights(cfg, seed=3, device="cuda")
    bw = read_bw()
    floor = floor_ms(cfg, B, bw, context_len=context)
    print(f"{model} B={B} context {context} (caches of {max_seq} positions): read bw {bw/1e12:.2f} TB/s, "
          f"floor {floor:.3f} ms")
    packed = pack_weights(w, max_seq).to("cuda")   # one copy for every variant (the 8B shape: 16 GB)
    to_trace = []
    traced = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--trace=")), None)
    ref_logits = None
    built = {}
    for spec in specs:
        name, opts, eng_kw = parse(spec)
        eng = MegakernelEngine(w, B, max_seq, options=KernelOptions(**opts), packed_weights=packed, **eng_kw)
        logits = one_step_logits(eng, context)
        if ref_logits is None:
            ref_logits, ref_name, agree = logits, name, "reference"
        else:   # same weights, cache and inputs: a variant computes the same step (float32 sums in another order)
            err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            agree = f"rel err {err:.1e} vs {ref_name}" + ("" if err < 1e-3 else "  MISMATCH")
        built[name] = (eng, capture(eng, context), agree)
        if (traced is None and not to_trace) or (traced and name in traced):
            to_trace.append((name, opts, eng_kw))
    times = interleaved({name: (lambda g=g: replay_ms(g)) for name, (_, g, _) in built.items()}, rounds)
    for name, (eng, _, agree) in built.items():
        eng.check()
        ms, lo, hi = times[name]
        print(f"  {name:20s} {ms:.3f} ms/step (rounds {lo:.3f}-{hi:.3f})  {floor/ms*100:5.1f}% of floor  "
              f"(kv_splits {eng.layout.kv_splits})  {agree}", flush=True)
    del built
    if "--no-trace" not in sys.argv:
        for name, opts, eng_kw in to_trace:
            print(f"  {name}:")
            trace(MegakernelEngine(w, B, max_seq, options=KernelOptions(trace=True, **opts), packed_weights=packed,
                                   **eng_kw), context)


if __name__ == "__main__":
    main()
