"""Quick GPU check of the megakernel: one step on tiny presets vs the reference, then a preset-size
step, then timing of graph replays against a pure device read. Prints a short table.
Usage (GPU host): python3 tools/gpu_smoke.py [PRESET ...]  (default: tiny-llama tiny-qwen3; MK_BATCH=N
sets the batch, 1 by default)"""
import os, sys, time, math
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import positional  # noqa: E402
import torch
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.kv_cache import PagedKVCache, contiguous_block_table
from megakernel.runtime.engine import MegakernelEngine

def check(name, B=2, steps=6, max_seq=256, **kw):
    cfg = get_preset(name)
    w = random_weights(cfg, seed=3, device="cuda")
    t0 = time.time()
    eng = MegakernelEngine(w, B, max_seq, **kw)
    print(f"{name}: engine built in {time.time()-t0:.1f}s, instructions {len(eng.program.instructions)}", flush=True)
    ref = ReferenceDecoder(w)
    cache = PagedKVCache.allocate(cfg, num_blocks=eng.num_blocks, block_size=16, device="cuda")
    bt = contiguous_block_table(B, eng.layout.max_seq_len, 16, "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
    pos = torch.zeros(B, dtype=torch.long, device="cuda")
    # seed the earlier positions of longer sequences so both caches hold the same history
    worst = 0.0
    for s in range(steps):
        lr = ref.step(tokens, pos, cache, bt)
        eng.bufs.poison()
        out = eng.step(tokens, pos, bt).clone().long()
        lk = eng.logits.clone()
        err = ((lk - lr).norm() / lr.norm()).item()
        worst = max(worst, err)
        agree = torch.equal(out, lr.argmax(1))
        print(f"  step {s}: rel err {err:.2e} tokens agree {agree} nan {torch.isnan(lk).sum().item()}", flush=True)
        if s == 0:
            print("  ref top5", lr[0].topk(5).values.tolist(), "mk top5", lk[0].topk(5).values.tolist(), flush=True)
        tokens = lr.argmax(1); pos = pos + 1
    return eng, worst

def read_bw(nbytes=2 << 30):
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    for _ in range(3): buf.sum()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(10):
        e0.record(); buf.sum(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return nbytes / (sorted(ts)[len(ts)//2] * 1e-3)

def time_graph(eng, steps=50):
    # timing starts at position 32: the cache must hold a history there (NaN slots would give NaN logits,
    # which the kernel reports as an invalid token)
    eng.k_cache.normal_(0, 1); eng.v_cache.normal_(0, 1)
    eng.reset_sync()
    pos = torch.full((eng.layout.batch,), 32, dtype=torch.int32, device="cuda")
    eng.bufs.positions.copy_(pos); eng.bufs.tokens.fill_(1)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): eng.launch(s)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eng.launch()
    eng.bufs.positions.copy_(pos)
    torch.cuda.synchronize()
    ts = []
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    for i in range(steps):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    eng.check()
    return sorted(ts)[len(ts)//2]

if __name__ == "__main__":
    names = positional(__doc__, "gpu_smoke.py [PRESET ...]", 0) or ["tiny-llama", "tiny-qwen3"]
    bw = read_bw()
    print(f"read bandwidth {bw/1e12:.2f} TB/s")
    import os
    B = int(os.environ.get("MK_BATCH", "1"))
    for n in names:
        eng, worst = check(n, B=B)
        ms = time_graph(eng)
        fl = eng.layout.config.weight_bytes() / bw * 1e3
        print(f"RESULT {n} B={eng.layout.batch}: worst rel err {worst:.2e}; {ms:.3f} ms/step; floor {fl:.3f} ms; {fl/ms*100:.0f}% of floor", flush=True)
