"""Time kernel variants on one set of weights (CUDA-graph replays, median), then trace the first
variant: per-stage wait and work times. Usage: gpu_sweep.py MODEL BATCH 'name:key=val,key=val' ..."""
import collections, sys
import torch
from megakernel.kernel.decode import KernelOptions
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine

def parse(spec):
    name, _, kv = spec.partition(":")
    opts, eng = {}, {}
    for item in filter(None, kv.split(",")):
        k, v = item.split("=")
        if k == "fuse":                      # fuse=0: keep the ATTN_REDUCE stage
            eng["fuse_attn_reduce"] = bool(int(v))
            continue
        if k == "slabs":                     # slabs=1: stage wide inputs in column slabs
            eng["slab_staging"] = bool(int(v))
            continue
        if k == "fold_embed":                # fold_embed=1: layer 0's QKV reads the embedding itself
            eng["fold_embed"] = bool(int(v))
            continue
        (eng if k in ("kv_splits", "policy") else opts)[k] = v if k == "policy" else int(v)
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

def time_graph(eng, start=32, steps=40):
    prepare(eng, start)
    for _ in range(2): eng.launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eng.launch()
    eng.bufs.positions.fill_(start); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(steps):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    eng.check()
    return sorted(ts)[len(ts) // 2]

def one_step_logits(eng, start=32):
    """Logits of one step from a fixed cache history and inputs: variants of one model must agree."""
    prepare(eng, start, seed=0)
    eng.launch(); torch.cuda.synchronize(); eng.check()
    return eng.logits.clone()

def trace(eng, start=32):
    prepare(eng, start)
    for _ in range(3): eng.launch()
    torch.cuda.synchronize(); eng.check()
    recs = eng.trace_records()
    span = max(r["end"] for r in recs) - min(r["begin"] for r in recs)
    by = collections.defaultdict(list)
    for r in recs: by[r["opcode"]].append(r)
    print(f"  trace: step span {span/1e3:.1f} us")
    for op, rs in by.items():
        wait = sum(r["ready"] - r["begin"] for r in rs) / len(rs)
        work = sum(r["end"] - r["ready"] for r in rs) / len(rs)
        print(f"    {op:13s} n={len(rs):5d} wait {wait/1e3:7.2f} us  work {work/1e3:7.2f} us")

def main():
    model, B = sys.argv[1], int(sys.argv[2])
    specs = [a for a in sys.argv[3:] if not a.startswith("--")] or ["default:"]
    cfg = get_preset(model)
    w = random_weights(cfg, seed=3, device="cuda")
    bw = read_bw()
    floor = cfg.weight_bytes() / bw * 1e3
    print(f"{model} B={B}: read bw {bw/1e12:.2f} TB/s, floor {floor:.3f} ms")
    first = None
    ref_logits = None
    for spec in specs:
        name, opts, eng_kw = parse(spec)
        eng = MegakernelEngine(w, B, 512, options=KernelOptions(**opts), **eng_kw)
        logits = one_step_logits(eng)
        if ref_logits is None:
            ref_logits, agree = logits, "reference"
        else:   # same weights, cache and inputs: a variant computes the same step (float32 sums in another order)
            err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            agree = f"rel err {err:.1e} vs {specs[0].partition(':')[0]}" + ("" if err < 1e-3 else "  MISMATCH")
        ms = time_graph(eng)
        print(f"  {name:20s} {ms:.3f} ms/step  {floor/ms*100:5.1f}% of floor  (kv_splits {eng.layout.kv_splits})  "
              f"{agree}", flush=True)
        if first is None:
            first = (opts, eng_kw)
        del eng
    if "--no-trace" not in sys.argv:
        opts, eng_kw = first
        trace(MegakernelEngine(w, B, 512, options=KernelOptions(trace=True, **opts), **eng_kw))


if __name__ == "__main__":
    main()
