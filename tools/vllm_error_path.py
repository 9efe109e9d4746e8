"""A kernel error inside vLLM's serving loop, on the GPU host: noticed within a few steps, raised, and the
megakernel path switched off.

    python3 tools/vllm_error_path.py --preset llama-3.2-1b [--out DIR] [--models DIR]

One vllm.LLM with the plugin (hf_overrides, FULL_DECODE_ONLY CUDA graphs, the engine in this process) on a
checkpoint of seeded random weights in the preset's shape (tools/vllm_parity.make_model_dir):

    1. a greedy generation of 16 tokens: the decode steps run as CUDA-graph replays of megakernel launches;
    2. every engine's queue is then given an instruction whose wait can never be satisfied (its count raised
       past what any producer reaches), the failure an aborted launch leaves behind; the next generation's
       first decode replay times out inside the kernel (KernelOptions.timeout_ns, 2 s), the replays after it
       run no instruction and copy the error code to mapped host memory, and the adapter's per-step flag check
       (before every compute_logits, no device sync) raises the kernel's error;
    3. the queues restored, every engine's error word read (and reset), one more generation: recorded, not
       judged. The adapter is disabled, so eager steps run stock, but graphs captured before keep their
       megakernel launch, which runs again once check() has reset the error word.
What happened goes to $OUT/vllm_error_path_<preset>.json (the flag checks between the poisoning and the
error, the error text, the adapter's disabled reason, the seconds it took); tests/e2e/test_vllm_error_path.py
runs this and asserts on it. Exit status 0 when the error was raised with the kernel's message, the path was
switched off, and at most MAX_CHECKS flag checks ran in between.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, REPO)

import vllm_parity  # noqa: E402  (tools/vllm_parity.py: model directory, engine start)

KERNEL_MESSAGE = "timed out waiting on counter"   # MegakernelError's text for ERR_TIMEOUT
MAX_CHECKS = 6      # flag checks (one per compute_logits) from the poisoning to the raise: the prompt's prefill
                    # step, the failed replay, the replay that copies the code to the host, up to two steps of
                    # vLLM's host/device overlap (async scheduling), and the check that sees it


def error_chain(exc: BaseException) -> str:
    """The exception's traceback text with its causes and contexts (vLLM may wrap the model's error)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def poison(adapters) -> list:
    """Raise one wait count in every engine's queue past any producer's count; return what to restore."""
    from megakernel.instructions.record import W_WAIT_COUNT

    saved = []
    for adapter in adapters:
        for eng in adapter.engines.values():
            table = eng.queue_table
            waits = eng.counter_waits()      # (not a stage that polls a flagged input: it waits on no counter)
            sm, i = waits[len(waits) // 2]
            saved.append((table, sm, i, int(table[sm, i, W_WAIT_COUNT])))
            table[sm, i, W_WAIT_COUNT] = 1 << 20
    return saved


def run(args: argparse.Namespace) -> dict:
    import torch
    from vllm import SamplingParams

    from megakernel.integrations import vllm_model as vm
    from megakernel.instructions.record import W_WAIT_COUNT
    from megakernel.model import get_preset

    cfg = get_preset(args.preset)
    model_dir = vllm_parity.make_model_dir(args.preset, args.seed, args.models)
    ns = argparse.Namespace(max_model_len=1024, gpu_memory_utilization=0.5, plugin_cudagraph_mode="FULL_DECODE_ONLY",
                            plugin_eager=False)
    llm, startup, _ = vllm_parity.build_llm(model_dir, "plugin", cfg.architecture, ns)
    result: dict = {"preset": args.preset, "startup_s": round(startup, 1)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(args.seed)

    def prompt():
        return {"prompt_token_ids": torch.randint(0, cfg.vocab_size, (24,), generator=gen).tolist()}

    first = llm.generate([prompt()], params, use_tqdm=False)
    result["first_tokens"] = list(first[0].outputs[0].token_ids)
    result["before"] = vm.report()
    adapters = list(vm._ADAPTERS)
    result["adapters"] = len(adapters)
    result["engines"] = sorted(b for a in adapters for b in a.engines)
    checks = {"n": 0}
    for adapter in adapters:
        inner = adapter.check_flags

        def counted(_inner=inner):
            checks["n"] += 1
            return _inner()
        adapter.check_flags = counted          # the model class calls self.megakernel.check_flags()

    torch.cuda.synchronize()
    with torch.inference_mode():               # vLLM built the engines' buffers under inference mode
        saved = poison(adapters)
    torch.cuda.synchronize()                   # the tables are written before vLLM's stream replays a step
    t0 = time.perf_counter()
    try:
        out = llm.generate([prompt()], params, use_tqdm=False)
        result["raised"] = None
        result["second_tokens"] = list(out[0].outputs[0].token_ids)
    except Exception as exc:   # noqa: BLE001 (whatever vLLM wraps the kernel's error in)
        result["raised"] = error_chain(exc)[-4000:]
    result["seconds_to_raise"] = round(time.perf_counter() - t0, 2)
    result["checks_until_raise"] = checks["n"]
    torch.cuda.synchronize()
    with torch.inference_mode():
        for table, sm, i, count in saved:
            table[sm, i, W_WAIT_COUNT] = count
    torch.cuda.synchronize()
    result["disabled"] = [a.disabled for a in adapters]
    # an error word set by a launch after the raise and before the restore (read, and reset, here): tells a
    # stale error apart from a new one in the generation below
    errors = []
    for adapter in adapters:
        try:
            adapter.check_engines()
            errors.append(None)
        except Exception as exc:   # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:400])
    result["error_word_after_restore"] = errors
    try:
        out = llm.generate([prompt()], params, use_tqdm=False)
        result["after"] = {"tokens": list(out[0].outputs[0].token_ids), "checks": checks["n"]}
    except Exception as exc:   # noqa: BLE001
        result["after"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    result["ok"] = bool(result["raised"] and KERNEL_MESSAGE in result["raised"]
                        and all(d and KERNEL_MESSAGE in d for d in result["disabled"])
                        and 1 <= result["checks_until_raise"] <= MAX_CHECKS)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.2-1b", help="megakernel model preset (shape of the random model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder for the JSON report")
    p.add_argument("--models", default="/tmp/mk_vllm_models", help="folder for the random checkpoints (reused)")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    path = os.path.join(args.out, f"vllm_error_path_{args.preset}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"RESULT ok={result['ok']} checks_until_raise={result['checks_until_raise']} "
          f"seconds={result['seconds_to_raise']} disabled={result['disabled']} -> {path}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
