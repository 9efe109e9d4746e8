"""Decode speed of stock vLLM and of the megakernel plugin path, batch 1 to 64 (GPU host).

    python3 tools/vllm_bench.py --preset llama-3.2-1b [--batches 1,2,4,8,16,32,64] [--async-scheduling]
        [--parity] [--profile] [--out DIR] [--engine-process separate|inproc] [--plugin-max-batch N]

The engine runs as vLLM runs it by default, in its own process (--engine-process separate), so
vLLM's asynchronous scheduling overlaps the host work of one step with the GPU work of the previous
one; --engine-process inproc (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs it in the worker, where every
step's host work is serial with its GPU work (--profile needs it). --plugin-max-batch sets
MEGAKERNEL_VLLM_MAX_BATCH for the plugin path (the largest decode batch sent to the megakernel: batches above it
run stock in the plugin's engine too, so its row there measures the plugin's overhead, not the kernel).
--async-scheduling turns on vLLM's async_scheduling on both paths; vLLM's max_num_seqs is the largest batch.
--tensor-parallel-size N runs both paths with vLLM's tensor_parallel_size N (the plugin path: one megakernel rank
per GPU, decode batches up to 8); the floor is then the read time of one GPU's 1/N of the weights.

Same model directory, processes and vLLM settings as tools/vllm_parity.py (stock: default
compilation, FULL_AND_PIECEWISE CUDA graphs; plugin: hf_overrides to the megakernel architecture,
FULL_DECODE_ONLY). Measured as in /work/shared/BASELINES.md: 32-token random prompts, greedy,
ignore_eos; per batch size, after one warm-up generation, three repetitions of
(wall time of llm.generate with 257 new tokens, the same with 1 new token);
ms per step = (t257 - t1) / 256, best of the three; decode tok/s = batch * 1000 / (ms per step).
The worker also measures the GPU's read bandwidth (a sum over 2 GiB of bf16) in the same process and
reports the fraction of the weight-read floor each path reaches.

--parity runs tools/vllm_parity.py's workloads in the same engines (one engine start per path
serves both tools) and writes $OUT/vllm_parity_<preset>.json as well. --profile profiles short
generations after the bench in the same engines (tools/vllm_parity.py's profile_stage: wall vs GPU
busy time per decode step, printed as `RESULT profile` lines; a trace per path in $OUT). Results:
$OUT/vllm_bench_<preset>.json; worker logs $OUT/vllm_<preset>_<path>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_parity as common  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 32
NEW_TOKENS = 257
REPEATS = 3


def read_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a pure device read (median of 10 sums over `nbytes` of bf16)."""
    import torch

    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    for _ in range(3):
        buf.sum()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        e0.record()
        buf.sum()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    del buf
    torch.cuda.empty_cache()
    return nbytes / (sorted(times)[len(times) // 2] * 1e-3)


def bench(llm, vocab: int, seed: int, batches: tuple[int, ...] = BATCHES) -> dict[str, Any]:
    from vllm import SamplingParams

    def timed(prompts, n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [n] * len(prompts):
            raise RuntimeError(f"asked for {n} tokens per prompt, got {got}")
        return dt

    out: dict[str, Any] = {}
    for batch in batches:
        prompts = common._prompts(vocab, [PROMPT_LEN] * batch, seed + 100 + batch)
        timed(prompts, NEW_TOKENS)   # warm-up: graphs, allocator, prefix cache
        reps = []
        for _ in range(REPEATS):
            t_long = timed(prompts, NEW_TOKENS)
            t_one = timed(prompts, 1)
            reps.append({"t257_s": t_long, "t1_s": t_one, "ms_per_step": (t_long - t_one) / (NEW_TOKENS - 1) * 1e3})
        best = min(r["ms_per_step"] for r in reps)
        out[str(batch)] = {"ms_per_step": best, "decode_tok_s": batch * 1e3 / best, "repeats": reps}
    return out


def worker_extra(args: argparse.Namespace):
    def extra(llm, result: dict) -> None:
        from megakernel.model import get_preset

        cfg = get_preset(args.preset)
        result["bench"] = bench(llm, cfg.vocab_size, args.seed, args.batches)
        try:
            bw = read_bandwidth()
        except Exception as exc:   # noqa: BLE001 (no room left on the GPU): report the timings anyway
            result["read_bandwidth_error"] = f"{type(exc).__name__}: {exc}"
            return
        # each of tensor_parallel_size GPUs reads its 1/N of the weights in parallel (the norms, replicated, are noise)
        floor_ms = cfg.weight_bytes() / (bw * common.tp_size(args)) * 1e3
        result["read_bandwidth_TBps"] = bw / 1e12
        result["floor_ms"] = floor_ms
        for row in result["bench"].values():
            row["fraction_of_floor"] = floor_ms / row["ms_per_step"]
    return extra


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p)
    p.add_argument("--parity", action="store_true", help="also run the parity workloads (tools/vllm_parity.py)")
    p.add_argument("--batches", type=common.parse_batches, default=BATCHES,
                   help="decode batch sizes to time, comma-separated (default %(default)s); vLLM's max_num_seqs "
                        "becomes the largest")
    p.add_argument("--near-tie-gap", type=float, default=common.NEAR_TIE_GAP,
                   help="--parity: a greedy token may differ where stock's top-2 logprob gap is below this "
                        "(default %(default)s)")
    p.add_argument("--logprob-atol", type=float, default=common.LOGPROB_ATOL,
                   help="--parity: largest difference allowed between the paths' logprobs of a token "
                        "(default %(default)s)")
    p.set_defaults(engine_process="separate")
    args = p.parse_args()
    args.max_num_seqs = max(args.max_num_seqs, max(args.batches))
    if args.profile and args.engine_process != "inproc" and not args.worker:
        print(f"warning: {common.PROFILE_NEEDS_INPROC}; the profile stage is skipped", flush=True)
    if args.worker:
        common.exit_now(common.worker_main(args, extra=worker_extra(args)))
    os.makedirs(args.out, exist_ok=True)
    model_dir = common.make_model_dir(args.preset, args.seed, args.models)
    extra = ["--batches", ",".join(map(str, args.batches))] + (["--parity"] if args.parity else [])
    results = common.run_workers(os.path.abspath(__file__), args, model_dir, extra)

    report: dict[str, Any] = {"preset": args.preset, "seed": args.seed, "method": {
        "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "repeats": REPEATS,
        "engine_process": args.engine_process, "plugin_max_batch": args.plugin_max_batch,
        "async_scheduling": args.async_scheduling, "max_num_seqs": args.max_num_seqs, "batches": list(args.batches),
        "tensor_parallel_size": args.tensor_parallel_size,
        "capture_sizes": list(args.capture_sizes or []) or "vLLM's default",
        "ms_per_step": "(t257 - t1) / 256, best of repeats"}, "paths": {}}
    for path, r in results.items():
        report["paths"][path] = {k: v for k, v in r.items() if k != "parity"}
    report["megakernel_used"], report["megakernel"] = common.megakernel_used(results.get("plugin", {}))
    s, m = results.get("stock", {}).get("bench"), results.get("plugin", {}).get("bench")
    if s and m:
        report["speedup_plugin_over_stock"] = {b: s[b]["ms_per_step"] / m[b]["ms_per_step"] for b in s if b in m}
    out = os.path.join(args.out, f"vllm_bench_{args.preset}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    ok = bool(s and m)
    for path in ("stock", "plugin"):
        b = results.get(path, {}).get("bench")
        if b:
            line = ", ".join(f"batch {k}: {v['ms_per_step']:.3f} ms/step {v['decode_tok_s']:.0f} tok/s "
                             f"({v.get('fraction_of_floor', float('nan')) * 100:.0f}% of floor)"
                             for k, v in b.items())
            print(f"RESULT bench {args.preset} {path}: {line}", flush=True)
        else:
            r = results.get(path, {})
            print(f"RESULT bench {args.preset} {path}: FAILED {r.get('error')} {r.get('errors')}", flush=True)
    if "speedup_plugin_over_stock" in report:
        print(f"RESULT bench {args.preset} speedup: {json.dumps(report['speedup_plugin_over_stock'])} -> {out}",
              flush=True)
    used, how = common.megakernel_used(results.get("plugin", {}))
    print(f"RESULT megakernel {args.preset}: {'used' if used else 'NOT USED'}: {how}", flush=True)
    ok = ok and used

    if args.parity and all("parity" in results.get(k, {}) for k in common.PATHS):
        par = {"preset": args.preset, "seed": args.seed, "megakernel_used": used, "megakernel": how,
               "parity": common.compare(results["stock"]["parity"], results["plugin"]["parity"],
                                        args.near_tie_gap, args.logprob_atol)}
        ppath = os.path.join(args.out, f"vllm_parity_{args.preset}.json")
        with open(ppath, "w") as f:
            json.dump(par, f, indent=1)
        summary = {k: {kk: vv for kk, vv in w.items() if kk != "per_request"}
                   for k, w in par["parity"]["workloads"].items()}
        verdict = ("FAIL" if not par["parity"]["ok"] else "PASS" if used else
                   "VACUOUS (the megakernel did not run)")
        print(f"RESULT parity {args.preset}: {verdict} {json.dumps(summary)} -> {ppath}", flush=True)
        ok = ok and par["parity"]["ok"]
    elif args.parity:
        missing = [k for k in common.PATHS if "parity" not in results.get(k, {})]
        print(f"RESULT parity {args.preset}: INCOMPLETE (no result for {', '.join(missing)})", flush=True)
        ok = False
    if args.profile:   # informative: the exit status stays that of the verdicts above
        common.print_profiles(args.preset, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
