"""tools/vllm_parity.py's profile stage (tools/vllm_bench.py --profile) on the CPU: the per-step summary
over synthetic trace events, the Chrome trace reading, cutting and merging, the RESULT line, and the
stage end to end (torch.profiler with CPU activity only) on a small stand-in for vllm.LLM whose engine
steps call the same methods vLLM's in-process engine does."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("tools_vllm_parity_profile", REPO / "tools" / "vllm_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load()
Ev = tool.TraceEvent


# ------------------------------------------------------------------------------------------------
# Synthetic timelines
# ------------------------------------------------------------------------------------------------

def timeline(steps: int = 10, period: float = 1000.0, graphs: bool = True, graph_ids: bool = True) -> list:
    """`steps` engine steps of `period` us. Each: a graph launch whose replay runs kernels `attn` (300 us)
    and `gemm` (200 us, overlapping a 50 us `side` kernel of another stream that is not in the graph),
    then an eager `sampler` kernel (100 us) and a 4 us memcpy; host ranges `schedule` (20 us) and
    `execute_model` (30 us) and a 5 us cudaStreamSynchronize. Step 0 also has a 2500 us prefill kernel
    that the summary must leave out."""
    ev = [Ev("prefill", 10.0, 2500.0, "kernel", 1)]
    for i in range(steps):
        t, c = i * period, 100 + 10 * i
        ev.append(Ev(tool.STEP_MARK, t, period - 10, "step"))
        ev.append(Ev(tool.HOST_MARK + "schedule", t + 1, 20.0, "range"))
        ev.append(Ev(tool.HOST_MARK + "execute_model", t + 21, 30.0, "range"))
        if graphs:
            ev.append(Ev("cudaGraphLaunch", t + 40, 8.0, "graph_launch", c))
        gc = c if graph_ids else 0
        ev.append(Ev("attn", t + 50, 300.0, "kernel", gc))
        ev.append(Ev("gemm", t + 350, 200.0, "kernel", gc))
        ev.append(Ev("side", t + 400, 50.0, "kernel", c + 1))
        ev.append(Ev("sampler", t + 600, 100.0, "kernel", c + 2))
        ev.append(Ev("Memcpy DtoH (Device -> Pinned)", t + 700, 4.0, "memcpy", c + 3))
        ev.append(Ev("cudaStreamSynchronize", t + 700, 5.0, "runtime", c + 4))
    return ev


def test_union_us_merges_overlaps_and_ignores_empty_intervals():
    assert tool.union_us([]) == 0
    assert tool.union_us([(0, 10), (5, 15), (20, 30), (22, 25), (40, 40), (50, 45)]) == 25
    assert tool.union_us([(0, 100), (10, 20), (30, 40)]) == 100


def test_step_period_ms_skips_the_first_steps():
    starts = [0.0, 0.5, 0.6] + [1.0 + 0.002 * i for i in range(11)]
    assert tool.step_period_ms(starts, skip=3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="need at least 5"):
        tool.step_period_ms(starts[:4], skip=3)


def test_profile_summary_per_step():
    s = tool.profile_summary(timeline(), skip=3)
    assert s["steps"] == 6                                  # steps 3..8; step 9's start closes the window
    assert s["wall_ms_per_step"] == pytest.approx(1.0)
    # attn + gemm back to back (side inside them), sampler, memcpy
    assert s["gpu_busy_ms_per_step"] == pytest.approx(0.604)
    assert s["gpu_idle_ms_per_step"] == pytest.approx(0.396)
    assert s["gpu_idle_fraction"] == pytest.approx(0.396)
    assert s["gpu_sum_ms_per_step"] == pytest.approx(0.654)
    assert s["gpu_in_graphs_ms_per_step"] == pytest.approx(0.5)
    assert s["gpu_outside_graphs_ms_per_step"] == pytest.approx(0.154)
    assert s["graph_launches_per_step"] == 1 and s["gpu_ops_per_step"] == 5 and s["gpu_ops_in_graphs_per_step"] == 2
    top = {r["name"]: r for r in s["top_gpu_ops"]}
    assert [r["name"] for r in s["top_gpu_ops"]][:3] == ["attn", "gemm", "sampler"]
    assert "prefill" not in top
    assert top["attn"] == {"name": "attn", "count": 6, "mean_us": 300.0, "us_per_step": 300.0, "in_graph": 1.0}
    assert top["sampler"]["in_graph"] == 0.0
    host = {r["name"]: r["us_per_step"] for r in s["host_ranges"]}
    assert host == {tool.HOST_MARK + "schedule": 20.0, tool.HOST_MARK + "execute_model": 30.0}
    api = {r["name"]: r["count"] for r in s["cuda_api_calls"]}
    assert api == {"cudaGraphLaunch": 6, "cudaStreamSynchronize": 6}
    assert "caveat" not in s


def test_profile_summary_counts_graph_nodes_without_a_correlation():
    ev = [e._replace(graph_node=7) if e.name in ("attn", "gemm") else e for e in timeline(graph_ids=False)]
    s = tool.profile_summary(ev, skip=3)
    assert s["gpu_in_graphs_ms_per_step"] == pytest.approx(0.5) and "caveat" not in s


def test_profile_summary_says_when_graph_kernels_were_not_recorded():
    s = tool.profile_summary(timeline(graph_ids=False), skip=3)
    assert s["gpu_in_graphs_ms_per_step"] == 0 and "lower bound" in s["caveat"]
    assert "caveat" not in tool.profile_summary(timeline(graphs=False, graph_ids=False), skip=3)


def test_profile_summary_needs_marked_steps():
    with pytest.raises(ValueError, match="4 engine steps"):
        tool.profile_summary(timeline(steps=4), skip=3)


# ------------------------------------------------------------------------------------------------
# Chrome traces
# ------------------------------------------------------------------------------------------------

def chrome_trace(steps: int = 10, period: float = 1000.0, t0: float = 5e9) -> dict:
    """A Kineto-shaped trace of `steps` engine steps (the categories and fields torch.profiler writes)."""
    ev = [{"ph": "M", "name": "process_name", "ts": t0, "pid": 11, "tid": 0, "args": {"name": "python"}},
          {"ph": "M", "name": "process_name", "ts": t0, "pid": 0, "tid": 0, "args": {"name": "GPU 0"}}]
    for i in range(steps):
        t, c = t0 + i * period, 500 + i
        ev += [
            {"ph": "X", "cat": "user_annotation", "name": tool.STEP_MARK, "pid": 11, "tid": 11, "ts": t,
             "dur": period - 10, "args": {"External id": i}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 11, "tid": 11, "ts": t + 2, "dur": 3},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 11, "tid": 11, "ts": t + 10,
             "dur": 6, "args": {"correlation": c, "cbid": 311}},
            {"ph": "X", "cat": "kernel", "name": "void fwd<128>(float*)", "pid": 0, "tid": 7, "ts": t + 20,
             "dur": 400, "args": {"correlation": c, "stream": 7, "device": 0}},
            {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": 11, "tid": 11, "ts": t + 450,
             "dur": 4, "args": {"correlation": c + 1000}},
            {"ph": "X", "cat": "kernel", "name": "argmax", "pid": 0, "tid": 7, "ts": t + 460, "dur": 40,
             "args": {"correlation": c + 1000}},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": t + 510,
             "dur": 2, "args": {"correlation": c + 2000}},
            {"ph": "X", "cat": "gpu_user_annotation", "name": tool.STEP_MARK, "pid": 0, "tid": 7, "ts": t + 20,
             "dur": 480},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": c, "pid": 11, "tid": 11, "ts": t + 10},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": c, "pid": 0, "tid": 7, "ts": t + 20, "bp": "e"},
        ]
    return {"schemaVersion": 1, "traceName": "x", "traceEvents": ev}


def test_trace_events_reads_kineto_categories():
    ev = tool.trace_events(chrome_trace(steps=1))
    kinds = {(e.name, e.kind) for e in ev}
    assert kinds == {(tool.STEP_MARK, "step"), ("cudaGraphLaunch", "graph_launch"), ("void fwd<128>(float*)", "kernel"),
                     ("cuLaunchKernel", "runtime"), ("argmax", "kernel"), ("Memset (Device)", "memset")}
    fwd = next(e for e in ev if e.kind == "kernel" and e.name.startswith("void"))
    assert fwd.correlation == 500 and fwd.dur_us == 400 and fwd.start_us == 5e9 + 20
    s = tool.profile_summary(tool.trace_events(chrome_trace()), skip=3)
    assert s["gpu_busy_ms_per_step"] == pytest.approx(0.442) and s["gpu_in_graphs_ms_per_step"] == pytest.approx(0.4)


def test_last_steps_keeps_metadata_and_the_last_steps():
    cut = tool.last_steps(chrome_trace(), 2)
    marks = [e for e in cut["traceEvents"] if e.get("cat") == "user_annotation"]
    assert [e["ts"] for e in marks] == [5e9 + 8000, 5e9 + 9000]
    assert sum(e["ph"] == "M" for e in cut["traceEvents"]) == 2
    assert min(e["ts"] for e in cut["traceEvents"] if e["ph"] != "M") >= 5e9 + 8000 - 10
    assert cut["schemaVersion"] == 1
    assert len(tool.last_steps(chrome_trace(steps=3), 8)["traceEvents"]) == len(chrome_trace(steps=3)["traceEvents"])


def test_merge_traces_puts_each_part_after_the_previous_one():
    a, b = tool.last_steps(chrome_trace(t0=9e9), 2), tool.last_steps(chrome_trace(t0=1e9), 2)
    merged = tool.merge_traces([("batch 1", a), ("batch 8", b)], gap_us=1000.0)
    ev = merged["traceEvents"]
    assert sum(e["ph"] == "M" for e in ev) == 2                 # same metadata once
    labels = {e["name"]: e["ts"] for e in ev if e["ph"] == "i"}
    end_a = max(e["ts"] + e.get("dur", 0) for e in a["traceEvents"] if e["ph"] != "M")
    start_b = labels["batch 8"]
    assert labels["batch 1"] == min(e["ts"] for e in a["traceEvents"] if e["ph"] != "M")
    assert start_b == pytest.approx(end_a + 1000.0)
    part_b = [e for e in ev if e["ph"] == "X" and e["ts"] >= start_b]
    assert len(part_b) == sum(e["ph"] == "X" for e in b["traceEvents"])
    assert merged["traceName"] == "x"


def test_write_trace_fits_the_size_cap(tmp_path):
    parts = [("batch 1", chrome_trace(steps=40)), ("batch 8", chrome_trace(steps=40))]
    out = tmp_path / "t.json.gz"
    got = tool.write_trace(parts, str(out), steps=8)
    assert got == {"trace": "t.json.gz", "trace_bytes": out.stat().st_size, "trace_steps_per_batch": 8}
    ev = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert sum(e.get("cat") == "user_annotation" for e in ev) == 16
    small = tool.write_trace(parts, str(out), steps=8, max_bytes=got["trace_bytes"] * 2 // 3)
    assert small["trace_steps_per_batch"] < 8 and small["trace_bytes"] <= got["trace_bytes"] * 2 // 3
    none = tool.write_trace(parts, str(tmp_path / "none.json.gz"), max_bytes=10)
    assert none["trace"] is None and not (tmp_path / "none.json.gz").exists()


# ------------------------------------------------------------------------------------------------
# The RESULT line
# ------------------------------------------------------------------------------------------------

def test_profile_line():
    row = dict(tool.profile_summary(timeline(), skip=3), wall_ms_per_step_unprofiled=0.9)
    result = {"profile": {"batches": {"1": row, "8": {"skipped": "12 s left of the worker's 200 s"}},
                          "trace": "vllm_profile_x_stock.json.gz"},
              "bench": {"1": {"ms_per_step": 0.81}}}
    line = tool.profile_line("stock", result)
    assert line.startswith("stock: batch 1: 0.900 ms/step (1.000 profiled, bench 0.810), GPU busy 0.604 "
                           "(kernels in graphs 0.500 + outside 0.154), GPU idle 0.296 ms (33%)"), line
    assert "1.0 graph launches and 5 GPU ops per step; top: attn 300 us, gemm 200 us, sampler 100 us" in line
    assert "| batch 8: skipped, 12 s left" in line and line.endswith("-> vllm_profile_x_stock.json.gz")
    failed = tool.profile_line("plugin", {"profile": {"batches": {"1": {"error": "RuntimeError: x"}}}})
    assert failed == "plugin: batch 1: FAILED RuntimeError: x"
    assert tool.profile_line("plugin", {"errors": ["profile: OSError: y", "parity: z"]}) == \
        "plugin: no profile (profile: OSError: y)"


# ------------------------------------------------------------------------------------------------
# The stage end to end on a stand-in for vllm.LLM (torch.profiler, CPU activity)
# ------------------------------------------------------------------------------------------------

class _Scheduler:
    def schedule(self, *args):
        return torch.ones(16).sum()

    def update_from_output(self, *args):
        return None


class _Executor:
    def execute_model(self, scheduler_output, non_block=False):
        return torch.randn(32, 32) @ torch.randn(32, 32)

    def sample_tokens(self, grammar_output, non_block=False):
        return None


class _OutputProcessor:
    def process_outputs(self, outputs):
        return outputs


class _Engine:
    """LLMEngine.step as vLLM 0.26 runs it in-process: the engine core's step, then output processing."""

    def __init__(self):
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=_Scheduler(),
                                                                       model_executor=_Executor()))
        self.output_processor = _OutputProcessor()

    def step(self):
        from vllm.v1.utils import record_function_or_nullcontext

        core = self.engine_core.engine_core
        out = core.scheduler.schedule()
        core.model_executor.execute_model(out, non_block=True)
        core.model_executor.sample_tokens(None, non_block=True)
        core.scheduler.update_from_output(out, None)
        with record_function_or_nullcontext("llm_engine step: process_outputs"):
            self.output_processor.process_outputs([])
        return []


class _LLM:
    def __init__(self, fail_batch: int | None = None):
        self.llm_engine, self.fail_batch, self.generated = _Engine(), fail_batch, []

    def generate(self, prompts, params, use_tqdm=True):
        if len(prompts) == self.fail_batch:
            raise RuntimeError(f"no room for {len(prompts)} requests")
        for _ in range(params.max_tokens + 1):
            self.llm_engine.step()
        self.generated.append((len(prompts), params.max_tokens))
        return []


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm.SamplingParams and vllm.v1.utils's profiling-scope switch, nothing else."""
    vllm, v1, utils = (types.ModuleType(n) for n in ("vllm", "vllm.v1", "vllm.v1.utils"))
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    utils._PROFILER_FUNC = contextlib.nullcontext
    utils.record_function_or_nullcontext = lambda name: utils._PROFILER_FUNC(name)
    vllm.v1, v1.utils = v1, utils
    for name, mod in (("vllm", vllm), ("vllm.v1", v1), ("vllm.v1.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    return utils


def _args(tmp_path, **over) -> Namespace:
    return Namespace(**dict(dict(preset="tiny-llama", worker="stock", seed=0, out=str(tmp_path), time_limit=None,
                                 profile=True, engine_process="inproc", plugin_max_batch=None,
                                 models=str(tmp_path)), **over))


def test_profile_stage_end_to_end(tmp_path, fake_vllm):
    llm = _LLM()
    into: dict = {}
    tool.profile_stage(llm, 1000, _args(tmp_path), into)
    assert llm.generated == [(1, tool.PROFILE_NEW_TOKENS)] * 2 + [(8, tool.PROFILE_NEW_TOKENS)] * 2
    for batch in ("1", "8"):
        row = into["batches"][batch]
        assert row["engine_steps"] == tool.PROFILE_NEW_TOKENS + 1
        assert row["steps"] == tool.PROFILE_NEW_TOKENS - tool.PROFILE_SKIP_STEPS
        assert row["wall_ms_per_step_unprofiled"] > 0 and row["wall_ms_per_step"] > 0
        assert row["gpu_busy_ms_per_step"] == 0 and row["top_gpu_ops"] == []    # CPU only here
        host = {r["name"]: r["count"] for r in row["host_ranges"]}
        for name in ("schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs"):
            assert host[tool.HOST_MARK + name] == row["steps"], (batch, name, host)
        assert host["llm_engine step: process_outputs"] == row["steps"]             # vLLM's own scopes on
    # every hook undone, vLLM's scopes off again
    core = llm.llm_engine.engine_core.engine_core
    assert "step" not in vars(llm.llm_engine) and "schedule" not in vars(core.scheduler)
    assert fake_vllm._PROFILER_FUNC is contextlib.nullcontext
    trace = tmp_path / "vllm_profile_tiny-llama_stock.json.gz"
    assert into["trace"] == trace.name and trace.stat().st_size == into["trace_bytes"] <= tool.PROFILE_TRACE_MAX_BYTES
    ev = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {e["name"] for e in ev if e["ph"] == "i" and e["name"].startswith("batch")} == {"batch 1", "batch 8"}
    assert sum(e.get("name") == tool.STEP_MARK for e in ev) == 2 * tool.PROFILE_TRACE_STEPS
    line = tool.profile_line("stock", {"profile": into})
    assert line.startswith("stock: batch 1: ") and "| batch 8: " in line, line


def test_profile_stage_skips_batches_when_time_is_short(tmp_path, fake_vllm):
    llm, into = _LLM(), {}
    tool.profile_stage(llm, 1000, _args(tmp_path, time_limit=5.0), into)
    assert llm.generated == [] and set(into["batches"]) == {"1", "8"}
    assert all("s left of the worker's 5 s" in r["skipped"] for r in into["batches"].values())
    assert "trace" not in into and not list(tmp_path.iterdir())


def test_worker_keeps_other_stages_when_profiling_fails(tmp_path, fake_vllm, monkeypatch):
    """A failing profile batch is an error of the profile stage only: the other batch's summary and
    trace, and what the earlier stages recorded, are in the worker's JSON."""
    monkeypatch.setattr(tool, "build_llm", lambda *a: (_LLM(fail_batch=8), 0.1, {}))
    js = tmp_path / "w.json"

    def extra(llm, result):
        result["bench"] = {"1": {"ms_per_step": 1.5}}

    args = _args(tmp_path, json=str(js), parity=False, model_dir=str(tmp_path))
    assert tool.worker_main(args, extra=extra) == 1
    res = json.loads(js.read_text())
    assert res["bench"] == {"1": {"ms_per_step": 1.5}}
    assert res["errors"] == ["profile: RuntimeError: batch 8: RuntimeError: no room for 8 requests"]
    assert "steps" in res["profile"]["batches"]["1"] and "no room" in res["profile"]["batches"]["8"]["error"]
    assert res["profile"]["trace"] == "vllm_profile_tiny-llama_stock.json.gz"
    line = tool.profile_line("stock", res)
    assert "bench 1.500" in line and "batch 8: FAILED RuntimeError: no room" in line


def test_worker_without_profile_flag_does_not_profile(tmp_path, fake_vllm, monkeypatch):
    llm = _LLM()
    monkeypatch.setattr(tool, "build_llm", lambda *a: (llm, 0.1, {}))
    js = tmp_path / "w.json"
    args = _args(tmp_path, json=str(js), parity=False, model_dir=str(tmp_path), profile=False)
    assert tool.worker_main(args) == 0
    res = json.loads(js.read_text())
    assert "profile" not in res and res["errors"] == [] and llm.generated == []


def test_worker_with_a_separate_engine_process_skips_the_profile(tmp_path, fake_vllm, monkeypatch):
    llm = _LLM()
    monkeypatch.setattr(tool, "build_llm", lambda *a: (llm, 0.1, {}))
    js = tmp_path / "w.json"
    args = _args(tmp_path, json=str(js), parity=False, model_dir=str(tmp_path), engine_process="separate")
    assert tool.worker_main(args) == 0
    res = json.loads(js.read_text())
    assert res["engine_process"] == "separate" and llm.generated == []
    assert res["profile"] == {"skipped": tool.PROFILE_NEEDS_INPROC}
    assert tool.profile_line("stock", res) == f"stock: profile skipped ({tool.PROFILE_NEEDS_INPROC})"


@pytest.mark.parametrize("engine_process", ["inproc", "separate"])
@pytest.mark.parametrize("path,max_batch", [("stock", None), ("stock", 2), ("plugin", None), ("plugin", 2)])
def test_worker_env(tmp_path, monkeypatch, engine_process, path, max_batch):
    monkeypatch.setenv("MEGAKERNEL_VLLM", "1")
    monkeypatch.setenv("MEGAKERNEL_VLLM_MAX_BATCH", "7")
    monkeypatch.setenv("PYTHONPATH", "/some/site")
    monkeypatch.setattr(tool, "entry_point_dir", lambda root: f"{root}/eps")
    env = tool.worker_env(_args(tmp_path, engine_process=engine_process, plugin_max_batch=max_batch), path)
    sep = engine_process == "separate"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == ("1" if sep else "0")
    assert ("VLLM_ALLOW_INSECURE_SERIALIZATION" in env) is sep
    assert env["PYTHONPATH"].split(os.pathsep) == [tool.REPO] + ([f"{tmp_path}/eps"] if sep else []) + ["/some/site"]
    # the stock path runs vLLM's own classes (the installed plugin would map them to its inert subclasses); the
    # plugin path is switched on by hf_overrides alone, never by a variable left in the caller's environment
    assert env.get("MEGAKERNEL_VLLM") == ("0" if path == "stock" else None) and env["HF_HUB_OFFLINE"] == "1"
    want = str(max_batch) if path == "plugin" and max_batch else None
    assert env.get("MEGAKERNEL_VLLM_MAX_BATCH") == want


def test_worker_env_with_tensor_parallel_ranks(tmp_path, monkeypatch):
    """With tensor_parallel_size > 1 the model lives in vLLM's worker processes even with the engine in-process:
    they load the plugin through its entry point, and its report comes back through collective_rpc."""
    monkeypatch.setenv("PYTHONPATH", "/some/site")
    monkeypatch.setattr(tool, "entry_point_dir", lambda root: f"{root}/eps")
    env = tool.worker_env(_args(tmp_path, tensor_parallel_size=2), "plugin")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [tool.REPO, f"{tmp_path}/eps", "/some/site"]


def test_entry_point_dir_exposes_the_plugin_when_not_installed(tmp_path, monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [])
    folder = tool.entry_point_dir(str(tmp_path))
    monkeypatch.undo()
    [dist] = list(metadata.distributions(path=[folder]))
    [ep] = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert (dist.metadata["Name"], ep.name, ep.value) == (
        "megakernel", "megakernel", "megakernel.integrations.vllm_plugin:register")
    assert ep.load().__module__ == "megakernel.integrations.vllm_plugin"


def test_entry_point_dir_is_not_needed_when_installed(tmp_path, monkeypatch):
    from importlib import metadata

    ep = metadata.EntryPoint("megakernel", "megakernel.integrations.vllm_plugin:register", "vllm.general_plugins")
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [ep])
    assert tool.entry_point_dir(str(tmp_path)) is None and not list(tmp_path.iterdir())


class _RpcLLM:
    def __init__(self, fail=False):
        self.fail = fail

    def collective_rpc(self, method):
        if self.fail:
            raise TimeoutError("engine gone")
        return [method(object())]


def test_megakernel_report_from_a_separate_engine_process():
    rep = tool.megakernel_report(_RpcLLM(), "separate")
    assert rep["engine_process"] == "separate" and rep["caller_pid"] == os.getpid() and "kernel_error" in rep
    bad = tool.megakernel_report(_RpcLLM(fail=True), "separate")
    assert bad == {"report_error": "collective_rpc: TimeoutError: engine gone"}
    assert tool.megakernel_report(None, "separate") == {"report_error": "the engine did not start"}
    assert "engine_process" not in tool.megakernel_report(None, "inproc")


def test_megakernel_report_of_tensor_parallel_ranks_has_every_rank():
    class TwoRanks(_RpcLLM):
        def collective_rpc(self, method):
            return [dict(method(object()), rank=r) for r in range(2)]

    rep = tool.megakernel_report(TwoRanks(), "inproc", tensor_parallel_size=2)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1] and rep["rank"] == 0 and rep["engine_process"] == "inproc"


@pytest.mark.parametrize("rank1,used,needle", [
    ({}, True, "on each of 2 tensor-parallel ranks"),
    ({"disabled": "rank 1: the GPU is sm_80"}, False, "rank 1: disabled: rank 1: the GPU is sm_80"),
    ({"kernel_error": "MegakernelError: rank 1 of 2: timed out"}, False, "rank 1: kernel error word"),
    ({"captured": [], "eager_steps": 0}, False, "rank 1: no decode step went through the megakernel"),
])
def test_the_verdict_needs_every_tensor_parallel_rank_on_the_megakernel(rank1, used, needle):
    ok = {"disabled": None, "kernel_error": None, "captured": [1, 8], "eager_steps": 2,
          "engines": [{"batch": 1}, {"batch": 8}], "fallbacks": {}}
    ranks = [ok, dict(ok, **rank1)]
    got, how = tool.megakernel_used({"megakernel": dict(ok, ranks=ranks)})
    assert got is used and needle in how, how


def _load_bench():
    sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location("tools_vllm_bench", REPO / "tools" / "vllm_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text,want", [("1,2,4,8,16,32,64", (1, 2, 4, 8, 16, 32, 64)), ("8", (8,)),
                                       ("4,2", None), ("1,1", None), ("0,4", None), ("a", None), ("", None)])
def test_vllm_bench_batches(text, want):
    """The one parser of batch-size lists (vllm_bench's --batches, both tools' --capture-sizes)."""
    if want is None:
        with pytest.raises(Exception, match="ascending list"):
            tool.parse_batches(text)
    else:
        assert tool.parse_batches(text) == want


@pytest.mark.parametrize("script", ["vllm_bench.py", "vllm_parity.py"])
def test_out_takes_a_folder_and_refuses_a_file_before_any_work(tmp_path, script):
    """--out names the folder a run writes its JSON, logs and traces into: a path that names a file (an existing
    file, or one ending in .json) exits 2 with usage before anything is built; a folder parses."""
    taken = tmp_path / "taken"
    taken.write_text("x")
    for bad in (str(tmp_path / "bench.json"), str(taken)):
        done = subprocess.run([sys.executable, str(REPO / "tools" / script), "--out", bad], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "--out takes the folder" in done.stderr, (bad, done.stderr[-2000:])
    assert tool.out_dir(str(tmp_path / "results")) == str(tmp_path / "results")


class _TokenLLM:
    """generate() returns n tokens per prompt, recording (batch, n), and advances `clock` (seconds) by 1 ms per
    token of each prompt: the bench's timings then follow the work, not this machine's load."""

    def __init__(self):
        self.calls = []
        self.clock = 0.0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((len(prompts), params.max_tokens))
        self.clock += 1e-3 * params.max_tokens * len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)]) for _ in prompts]


def test_vllm_bench_times_every_batch_it_is_given(fake_vllm, monkeypatch):
    bench = _load_bench()
    llm = _TokenLLM()
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: llm.clock))
    got = bench.bench(llm, 1000, 0, (1, 16, 64))
    assert list(got) == ["1", "16", "64"]
    per_batch = 1 + 2 * bench.REPEATS                       # the warm-up, then (257, 1) per repeat
    assert [b for b, _ in llm.calls] == [1] * per_batch + [16] * per_batch + [64] * per_batch
    for b, row in got.items():
        assert row["ms_per_step"] == pytest.approx(int(b))          # (257 - 1) tokens of b prompts at 1 ms each
        assert row["decode_tok_s"] == pytest.approx(int(b) * 1e3 / row["ms_per_step"])


def test_build_llm_passes_max_num_seqs_async_scheduling_and_the_plugin_switch(tmp_path, monkeypatch):
    made = []
    vllm, warmup_pkg, warmup = (types.ModuleType(n) for n in ("vllm", "vllm.model_executor",
                                                               "vllm.model_executor.warmup"))
    vllm.LLM = lambda **kw: made.append(kw) or SimpleNamespace()
    warmup.kernel_warmup = SimpleNamespace(_warmup_ll_bf16_router_gemm=None)
    warmup_pkg.warmup = warmup
    for name, mod in (("vllm", vllm), ("vllm.model_executor", warmup_pkg), ("vllm.model_executor.warmup", warmup)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(tool, "REPO", str(REPO))
    for extra, want in (({}, (8, None)), ({"max_num_seqs": 64, "async_scheduling": True}, (64, True))):
        args = Namespace(max_model_len=2048, gpu_memory_utilization=0.5, plugin_cudagraph_mode="FULL_DECODE_ONLY",
                         plugin_eager=False, **extra)
        tool.build_llm(str(tmp_path), "plugin", "LlamaForCausalLM", args)
        assert (made[-1]["max_num_seqs"], made[-1].get("async_scheduling")) == want, made[-1]
        assert made[-1]["hf_overrides"] == {"architectures": ["MegakernelLlamaForCausalLM"]}
        assert "additional_config" not in made[-1], made[-1]
    # switched on by vLLM's additional_config on the stock name instead (--plugin-switch additional_config)
    args = Namespace(max_model_len=2048, gpu_memory_utilization=0.5, plugin_cudagraph_mode="FULL_DECODE_ONLY",
                     plugin_eager=False, plugin_switch="additional_config")
    tool.build_llm(str(tmp_path), "plugin", "LlamaForCausalLM", args)
    assert made[-1]["additional_config"] == {"megakernel": True} and "hf_overrides" not in made[-1], made[-1]
    tool.build_llm(str(tmp_path), "stock", "LlamaForCausalLM", args)
    assert "additional_config" not in made[-1] and "hf_overrides" not in made[-1], made[-1]
    assert "compilation_config" not in made[-1], made[-1]        # stock: vLLM's default compilation
    # --capture-sizes: the same CUDA-graph sizes on both paths, beside the plugin's cudagraph mode
    args.capture_sizes = (1, 8, 64)
    tool.build_llm(str(tmp_path), "stock", "LlamaForCausalLM", args)
    assert made[-1]["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 64]}, made[-1]
    tool.build_llm(str(tmp_path), "plugin", "LlamaForCausalLM", args)
    assert made[-1]["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 64],
                                              "cudagraph_mode": "FULL_DECODE_ONLY"}, made[-1]
    assert "tensor_parallel_size" not in made[-1]
    # --tensor-parallel-size: both paths
    args.tensor_parallel_size = 2
    for path in ("stock", "plugin"):
        tool.build_llm(str(tmp_path), path, "LlamaForCausalLM", args)
        assert made[-1]["tensor_parallel_size"] == 2, (path, made[-1])


def test_capture_sizes_are_batch_size_lists():
    p = argparse.ArgumentParser()
    tool.add_common_args(p)
    assert p.parse_args(["--capture-sizes", "1,2,4,8,16,32,64"]).capture_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert p.parse_args([]).capture_sizes is None
    for bad in ("", "0,1", "a,2", "-4", "64,1"):
        with pytest.raises(SystemExit):
            p.parse_args(["--capture-sizes", bad])


def test_parity_workloads_add_a_wide_one_past_eight_sequences():
    """With max_num_seqs above 8 the parity tool adds a workload of max_num_seqs + 8 short requests (pure-decode
    steps past batch 8); the others stay as they were."""
    w8 = tool.parity_workloads(1000, 0)
    w32 = tool.parity_workloads(1000, 0, 32)
    assert set(w8) == {"batch1", "mixed"} and set(w32) == {"batch1", "mixed", "wide"}
    assert w32["batch1"] == w8["batch1"] and w32["mixed"] == w8["mixed"]
    prompts, new = w32["wide"]
    assert len(prompts) == len(new) == 40
    assert all(4 <= len(p["prompt_token_ids"]) <= 64 for p in prompts) and all(16 <= n <= 64 for n in new)
