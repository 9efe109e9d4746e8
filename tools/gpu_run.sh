#!/usr/bin/env bash
# One call on the GPU host: stage the CuTe DSL bundle, run the GPU test suite and the benchmarks,
# and write every log under $OUT. Usage: bash tools/gpu_run.sh [tests|tests-par|bench|fuzz|sanitizer|sweep|sweep-batch|vllm|smoke|all] [extra args]
set -uo pipefail
source tools/gpu_env.sh
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cutlass, torch; print('cutlass-dsl', cutlass.__version__ if hasattr(cutlass,'__version__') else '?', 'torch', torch.__version__)" || exit 1
case "$what" in
  smoke) python3 tools/gpu_smoke.py "$@" 2>&1 | tee "$OUT/smoke.log" ;;
  tests) python3 -m pytest -m "gpu and not perf" -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" ;;
  tests-par)
    # (vLLM parity, ~4 min a model, has its own stage below: vllm; compute-sanitizer too: sanitizer)
    # (-v: a test per line as it ends, so a run cut at the call's limit still shows what passed and what failed)
    sel=(-m "gpu and not perf and not vllm and not sanitizer" -v -p no:cacheprovider -o junit_family=xunit1)
    python3 -m pytest "${sel[@]}" tests/unit/test_stages.py --junitxml="$OUT/junit_stages.xml" "$@" > "$OUT/tests_stages.log" 2>&1 &
    python3 -m pytest "${sel[@]}" tests/e2e --junitxml="$OUT/junit_e2e.xml" "$@" > "$OUT/tests_e2e.log" 2>&1 &
    python3 -m pytest "${sel[@]}" tests/unit --ignore=tests/unit/test_stages.py --junitxml="$OUT/junit_rest.xml" "$@" \
        > "$OUT/tests_rest.log" 2>&1 &
    wait
    for f in "$OUT"/tests_stages.log "$OUT"/tests_e2e.log "$OUT"/tests_rest.log; do
      echo "== $f: $(grep -c ' PASSED' "$f") passed, $(grep -c ' FAILED' "$f") failed, $(grep -c ' SKIPPED' "$f") skipped"
      grep -E ' (FAILED|ERROR)' "$f"; tail -n 5 "$f"; done ;;
  bench)
    # the benchmark JSON keeps each case's ratios (extra_info: floor_fraction, speedups); one line per case here
    python3 -m pytest -m perf -q -p no:cacheprovider --benchmark-json="$OUT/perf.json" "$@" 2>&1 | tee "$OUT/perf.log"
    python3 - "$OUT/perf.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    print(f"{b['name']:52s} {e['ms_per_step']:8.3f} ms  {100 * e['floor_fraction']:5.1f}% of the floor  "
          + "  ".join(f"{k[8:]} x{v:.2f}" for k, v in e.items() if k.startswith("speedup_")))
PY
    ;;
  fuzz)
    # the fuzz hypothesis profile (random seeds) over the GPU stage property tests, sized to end within a call:
    # MEGAKERNEL_FUZZ_EXAMPLES examples per test (default 12; each new shape compiles a kernel). Every test's
    # output, its hypothesis statistics (examples run) included, goes to the log as it runs.
    MEGAKERNEL_FUZZ_EXAMPLES=${MEGAKERNEL_FUZZ_EXAMPLES:-12} HYPOTHESIS_PROFILE=fuzz python3 -m pytest -s -v \
        -p no:cacheprovider -m "gpu and not perf" tests/unit/test_stages.py -k match_reference \
        --hypothesis-show-statistics "$@" 2>&1 | grep -v Warn | tee "$OUT/fuzz.log" ;;
  sanitizer) python3 tools/sanitize.py "$@" 2>&1 | tee "$OUT/sanitizer.log" ;;
  vllm)
    # after `source tools/vllm_bundle.sh stage` (docs/vllm.md); one preset's parity per call (~4 min):
    # bash tools/gpu_run.sh vllm llama-3.2-1b, then bash tools/gpu_run.sh vllm qwen3-0.6b (each also runs
    # tests/e2e/test_vllm_error_path.py: a kernel error inside vLLM's serving loop, ~2 min);
    # bash tools/gpu_run.sh vllm llama-3.2-1b 32: the case past batch 8 (max_num_seqs 32);
    # bash tools/gpu_run.sh vllm llama-3.2-1b tp2: tensor_parallel_size=2 on both paths (a host of 2 GPUs)
    preset=${1:-llama-3.2-1b}; shift || true
    case_id="$preset-b8"
    case "${1:-}" in 8|32) case_id="$preset-b$1"; shift ;; tp2) case_id="$preset-tp2"; shift ;; esac
    { python3 -m pytest -m vllm -q -p no:cacheprovider -rs tests/unit/test_vllm_plugin.py "$@"
      python3 -m pytest -m vllm -q -p no:cacheprovider -rs tests/e2e/test_vllm_parity.py -k "$case_id" "$@"
      python3 -m pytest -m vllm -q -p no:cacheprovider -rs tests/e2e/test_vllm_error_path.py "$@"
    } 2>&1 | tee "$OUT/vllm_tests_$preset.log" ;;
  sweep)
    # the layout variants the perf log compares; each sweep checks its variants' logits against the first,
    # then traces the first (per stage: wait, work, and when the producer warp issued the weight slots)
    S="python3 tools/gpu_sweep.py"
    { $S llama-3.2-1b 1 default: noembed:fold_embed=0 reduce:fuse=0
      $S qwen3-0.6b 1 default: --no-trace
      $S llama-3.1-8b 1 default: --no-trace
      $S llama-3.2-1b 8 default: --no-trace
      $S llama-2-7b 1 default: --no-trace
    } 2>&1 | grep -v Warn | tee "$OUT/sweep.log" ;;
  sweep-batch)
    # batch 4-8: column slabs for the inputs that are not staged whole; traced at llama-3.1-8b batch 8
    S="python3 tools/gpu_sweep.py"
    { $S llama-3.1-8b 8 default: reduce:fuse=0 --trace=default
      $S llama-3.1-8b 4 default: --no-trace
      $S llama-3.2-1b 8 default: reduce:fuse=0 --no-trace
    } 2>&1 | grep -v Warn | tee "$OUT/sweep_batch.log" ;;
  all)
    python3 -m pytest -m "gpu and not perf" -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
    python3 -m pytest -m perf -q -p no:cacheprovider 2>&1 | tee "$OUT/perf.log" ;;
  *) echo "unknown stage $what"; exit 2 ;;
esac
