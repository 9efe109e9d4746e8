"""vLLM with the megakernel plugin against stock vLLM, on the GPU host (markers `gpu`, `hopper`, `vllm`,
`slow`: skipped with the reason where a piece is missing).

tools/vllm_parity.py runs both paths on one model directory (a preset-shaped checkpoint of seeded random
weights, as save_pretrained writes it), each vLLM engine in its own process: stock (default compilation)
and the plugin switched on by vLLM's `additional_config` (llama-3.2-1b) or by `hf_overrides` (qwen3-0.6b)
(FULL_DECODE_ONLY CUDA graphs), with
MEGAKERNEL_VLLM_MAX_BATCH=8 (`--plugin-max-batch 8`) so that decode batches of every size, not only
those the plugin sends to the megakernel by default, are checked. Two workloads, greedy with
the top-5 logprobs of every step: one 32-token prompt for 128 tokens (batch 1), and 12 prompts of
different lengths through max_num_seqs=8 (prefill chunks and decodes of 1-8 requests interleaved, one
shared paged cache). Past batch 8 (llama-3.2-1b, max_num_seqs=32, MEGAKERNEL_VLLM_MAX_BATCH=32) a third,
"wide": 40 prompts of 4-64 tokens, so pure-decode steps of up to 32 requests run on the engines of 16 and
32 rows. The judgement (tools/vllm_parity.compare, unit-tested in tests/unit/test_vllm_tools.py)
is check_logprobs_close's: same tokens until the first step where stock's top-2 gap is below 0.1, there
each token in the other's top 5, and sampled logprobs within 0.1 while they agree.

One model per call of the GPU host (about four minutes each): `bash tools/gpu_run.sh vllm llama-3.2-1b`,
then `bash tools/gpu_run.sh vllm qwen3-0.6b`, and `bash tools/gpu_run.sh vllm llama-3.2-1b 32` for the case
past batch 8 (after staging the vLLM bundle, docs/vllm.md).

On a host with two GPUs, the same comparison with vLLM's tensor_parallel_size=2 on both paths
(`--tensor-parallel-size 2`; llama-3.2-1b, decode batches up to 8): on the plugin path every rank (one vLLM
worker process per GPU) runs its decode steps as one megakernel launch over its shard, the partial sums exchanged
by the kernels through CUDA IPC mappings of the peer's buffers (runtime.tensor_parallel.TensorParallelRank), and
every rank must report its decode steps on the megakernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "vllm_parity.py")
BUDGET_S = 540          # the tool splits it between the two paths; the host allows 600 s per call

# (workload, requests, fewest steps that must be compared: the comparison may stop at a near-tie, but a
# run that compares almost nothing proves nothing)
WORKLOADS = {"batch1": (1, 8), "mixed": (12, 96)}
WIDE_WORKLOADS = dict(WORKLOADS, wide=(40, 160))


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs (vLLM's tensor_parallel_size=2: one rank per GPU)")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("preset,switch,max_batch,tp", [("llama-3.2-1b", "additional_config", 8, 1),
                                                       ("qwen3-0.6b", "hf_overrides", 8, 1),
                                                       ("llama-3.2-1b", "additional_config", 32, 1),
                                                       pytest.param("llama-3.2-1b", "additional_config", 8, 2,
                                                                    marks=TWO_GPUS)],
                         ids=["llama-3.2-1b-b8", "qwen3-0.6b-b8", "llama-3.2-1b-b32", "llama-3.2-1b-tp2"])
def test_plugin_path_matches_stock_vllm(preset, switch, max_batch, tp, tmp_path):
    """The plugin switched on by vLLM's additional_config (llama-3.2-1b: the stock architecture name, which the
    plugin maps to its classes) or by hf_overrides (qwen3-0.6b); up to batch 8, and on llama-3.2-1b up to 32
    (max_num_seqs 32: the engines past batch 8 and the wide workload), and with tensor_parallel_size=2 on both paths
    (every rank's decode steps on its megakernel rank, batches up to 8)."""
    out = tmp_path / "out"
    cmd = [sys.executable, TOOL, "--preset", preset, "--out", str(out), "--models", str(tmp_path / "models"),
           "--budget", str(BUDGET_S), "--plugin-max-batch", str(max_batch), "--plugin-switch", switch]
    if max_batch > 8:
        cmd += ["--max-num-seqs", str(max_batch)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BUDGET_S + 45)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
    report_path = out / f"vllm_parity_{preset}.json"
    assert report_path.exists(), f"{preset}: no parity report (exit {proc.returncode}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert report.get("megakernel_used") is True, \
        f"{preset}: the plugin path did not run decode steps through the megakernel: {report.get('megakernel')}"
    if tp > 1:
        assert f"on each of {tp} tensor-parallel ranks" in report["megakernel"], report["megakernel"]
    # (vLLM's CUDA-graph sizes between the buckets, 24 at max_num_seqs 32, get engines of their own)
    engines = re.search(r"engines \[([0-9, ]*)\]", report["megakernel"])
    assert engines and set(buckets) <= {int(n) for n in engines.group(1).split(",") if n.strip()}, \
        f"{preset}: not every batch bucket up to {max_batch} ran on the megakernel: {report['megakernel']}"
    workloads = report.get("parity", {}).get("workloads", {})
    for name, (requests, min_steps) in (WIDE_WORKLOADS if max_batch > 8 else WORKLOADS).items():
        w = workloads.get(name)
        assert w is not None, f"{preset}: workload {name} missing from the report:\n{tail}"
        bad = [r for r in w.get("per_request", []) if not r["ok"]]
        assert w["ok"] and not bad, f"{preset} {name}: requests out of parity: {bad[:3]}"
        assert w["requests"] == requests, f"{preset} {name}: {w['requests']} requests compared, {requests} sent"
        assert w["steps_compared"] >= min_steps, \
            f"{preset} {name}: only {w['steps_compared']} steps compared before the first near-tie"
    assert report["parity"]["ok"] and proc.returncode == 0, f"{preset}: exit {proc.returncode}:\n{tail}"
