#!/usr/bin/env python3
"""Mutation runs: inject known bugs one at a time and see which tests catch each.

Each mutation is a list of exact textual patches (old -> new; the old text must occur exactly once in
its file). The script copies the repository to a temporary directory (the original is never touched),
applies one mutation to that copy, and runs its probes there: each probe is one

    python -m pytest -x -q -p no:cacheprovider <tests>

with the copy as the working directory and first on PYTHONPATH, so the mutated sources are what
`import megakernel` resolves to (checked twice: `megakernel.__file__` and the patched modules in a
separate interpreter before the tests, and every `megakernel*` module loaded by the pytest process itself,
through a small guard plugin, after them).

Most mutations have two rows: the VM/reference path (megakernel/instructions, megakernel/schedule: what
the CPU tests exercise) and, where the bug has a device twin, the GPU kernel (megakernel/kernel/,
row marked "kernel"), caught only by GPU tests; those run only with --gpu.

Before any mutation, the same probes run on an unmutated copy (the baseline): a probe that fails there
cannot tell anything about a mutation, so the run stops.

Usage:
    python tools/mutations.py                      # every mutation, CPU rows; table on stdout
    python tools/mutations.py --only rope_position_plus_one --only missing_wait
    python tools/mutations.py --gpu                # also the kernel rows (needs a CUDA device)
    python tools/mutations.py --tests tests/unit/test_vm.py -k "tiny-llama"    # one probe for all rows
    python tools/mutations.py --markdown mutations.md --json mutations.json --jobs 2
    python tools/mutations.py --list

Without --gpu, each kernel mutant is still compiled for sm_90a (no GPU needed) and its cubin compared with
the original's, so a kernel row is known to be a real change of the device code (--no-compile skips that).
Hypothesis runs under the profile "mutation" (the suite's derandomized "ci" profile without shrinking).

Exit status: 0 when every mutation that ran was caught, 1 when one was missed or errored, 2 when the
baseline fails or a mutation no longer applies to the sources.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Never copied: version control, caches, build outputs, the GPU host's bundles (hundreds of MB).
COPY_IGNORE = (".git", ".gpu", ".whl", ".venv", ".hypothesis", ".pytest_cache", ".benchmarks", "__pycache__",
               "*.egg-info", "build", "dist", "*.cubin", "*.ptx", "profiles")

PYTEST_BASE = ("-x", "-q", "-p", "no:cacheprovider")

# ---- probes: the test selections a mutation is run against ----------------------------------------------------

STAGES = "tests/unit/test_stages.py"
VM = "tests/unit/test_vm.py"
SCHEDULE = "tests/unit/test_schedule.py"
E2E = "tests/e2e/test_generation_parity.py"


@dataclass(frozen=True)
class Probe:
    label: str
    args: tuple[str, ...]       # pytest arguments after PYTEST_BASE: paths / node ids / -k / -m
    gpu: bool = False

    def describe(self) -> str:
        return " ".join(self.args)


def stage_probe(test: str) -> Probe:
    return Probe(f"stages:{test}", (f"{STAGES}::{test}",))


VM_PROBE = Probe("vm", (f"{VM}::test_vm_decoder_equals_reference_decoder",))
FRAGMENT_PROBE = Probe("fragment-pack", ("tests/unit/test_fragment_pack.py",))
SCHEDULE_PROBE = Probe("schedule", (SCHEDULE, "-k", "tiny_presets_fully or race_free"))
E2E_CPU_PROBE = Probe("e2e-vm", (E2E, "-k", "test_vm_matches_transformers_generate and tiny"))
GPU_STAGES_PROBE = Probe("gpu-stages", (f"{STAGES}::test_stages_on_gpu_match_reference",), gpu=True)
GPU_E2E_PROBE = Probe("gpu-e2e", (E2E, "-m", "gpu"), gpu=True)
GPU_WIDE_STAGES_PROBE = Probe("gpu-stages-wide", (f"{STAGES}::test_stages_on_gpu_match_reference_past_split_batch",
                                                  f"{STAGES}::test_stages_on_gpu_match_reference_with_a_second_row_"
                                                  "group_per_warp"), gpu=True)
GPU_ALIAS_PROBE = Probe("gpu-aliasing", ("tests/unit/test_error_paths.py", "-k", "aliasing"), gpu=True)

CPU_PROBES_ATTENTION = (stage_probe("test_attention_partial_and_reduce_stages"), VM_PROBE, E2E_CPU_PROBE)
GPU_PROBES = (GPU_STAGES_PROBE, GPU_E2E_PROBE)


# ---- mutations ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Patch:
    path: str                   # relative to the repository root
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str                    # what the injected bug is, in words
    patches: tuple[Patch, ...]
    probes: tuple[Probe, ...]
    kernel: bool = False        # a GPU kernel row: only GPU tests can catch it

    @property
    def needs_gpu(self) -> bool:
        return self.kernel


ATTN = "megakernel/instructions/attention.py"
LAYOUT = "megakernel/instructions/layout.py"
MATVEC = "megakernel/instructions/matvec_stages.py"
CONTEXT = "megakernel/instructions/context.py"
ARGMAX = "megakernel/instructions/argmax.py"
DAG = "megakernel/schedule/dag.py"
SPLIT_K = "megakernel/instructions/split_k.py"
K_INTERP = "megakernel/kernel/interpreter.py"
K_MATVEC = "megakernel/kernel/matvec.py"
K_WIDE = "megakernel/kernel/matvec_wide.py"
K_ATTN = "megakernel/kernel/attention.py"
K_TOKENS = "megakernel/kernel/tokens.py"
K_PTX = "megakernel/kernel/ptx.py"
K_SOFTMAX = "megakernel/kernel/softmax_pass.py"
KERNEL_MODULES = (K_INTERP, K_MATVEC, K_WIDE, K_ATTN, K_TOKENS, K_PTX, "megakernel/kernel/stream.py",
                  "megakernel/kernel/staging.py", K_SOFTMAX)
VM_MODULE = "megakernel/schedule/vm.py"
ENGINE_OPTIONS = "tests/unit/test_engine_options.py"


def _pair(name: str, bug: str, vm: tuple[Patch, ...], cpu_probes: tuple[Probe, ...],
          kernel: tuple[Patch, ...] | None, kernel_bug: str | None = None) -> list[Mutation]:
    out = [Mutation(name, bug, vm, cpu_probes)]
    if kernel:
        out.append(Mutation(f"{name}.kernel", kernel_bug or bug, kernel, GPU_PROBES, kernel=True))
    return out


MUTATIONS: tuple[Mutation, ...] = tuple(
    _pair("rope_position_plus_one",
          "RoPE of the new token's q and k taken at position pos + 1 (cache slot and attention range unchanged)",
          (Patch(ATTN, "cos, sin = w.rope_cos[pos], w.rope_sin[pos]",
                 "cos, sin = w.rope_cos[pos + 1], w.rope_sin[pos + 1]"),),
          CPU_PROBES_ATTENTION,
          (Patch(K_SOFTMAX, "f[E + e] = ld_f32(p.rope_cos + (Int64(pos) * half + Int64(fi)) * 4)",
                 "f[E + e] = ld_f32(p.rope_cos + (Int64(pos + 1) * half + Int64(fi)) * 4)"),
           Patch(K_SOFTMAX, "f[2 * E + e] = ld_f32(p.rope_sin + (Int64(pos) * half + Int64(fi)) * 4)",
                 "f[2 * E + e] = ld_f32(p.rope_sin + (Int64(pos + 1) * half + Int64(fi)) * 4)")))
    + _pair("o_proj_residual_dropped",
            "O_PROJ writes h = Wo . attn without adding the residual x",
            (Patch(MATVEC, "b.h[l, :, lo:hi] = b.x[l, :, lo:hi] + y", "b.h[l, :, lo:hi] = y"),),
            (stage_probe("test_o_proj_stage"), VM_PROBE, E2E_CPU_PROBE),
            (Patch(K_MATVEC, "res_addr = p.x + (l64 * (B * H) + Int64(a0)) * xh\n            has_res = Boolean(True)",
                   "res_addr = p.x + (l64 * (B * H) + Int64(a0)) * xh\n            has_res = Boolean(False)"),))
    + _pair("gqa_kv_head_interleaved",
            "GQA mapping: query head h attends with kv head h % num_kv_heads instead of h // group",
            (Patch(ATTN, "q = row[kvh * g * d:(kvh + 1) * g * d].view(g, d)",
                   "q = row[:c.q_size].view(g, c.num_kv_heads, d)[:, kvh]"),),
            CPU_PROBES_ATTENTION,
            (Patch(K_ATTN, "off = (kvh * G + hh) * D", "off = (hh * self.Hkv + kvh) * D"),))
    + _pair("softmax_scale_1_over_d",
            "attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
            (Patch(ATTN, "scores = (q @ keys.T) / math.sqrt(d)", "scores = (q @ keys.T) / d"),),
            CPU_PROBES_ATTENTION,
            (Patch(K_INTERP, "self.scale_log2 = LOG2E / math.sqrt(self.D)", "self.scale_log2 = LOG2E / self.D"),))
    + _pair("missing_wait",
            "DAG builder: ATTN_PARTIAL no longer waits for its layer's QKV stage",
            (Patch(DAG, "wait_id=qkv_done, wait_count=n,",
                   "wait_id=NO_COUNTER, wait_count=0,"),),
            (Probe("schedule", (SCHEDULE, "-k", "tiny_presets_fully")), VM_PROBE, E2E_CPU_PROBE),
            (Patch(K_INTERP, "if tidx == 0 and wait_id >= 0 and not polled:",
                   "if tidx == 0 and wait_id >= 0 and not polled and op != OP_ATTN_PARTIAL:"),),
            kernel_bug="device: ATTN_PARTIAL skips its counter wait (the DAG still lists it)")
    + _pair("kv_length_plus_one",
            "attention range: the splits cover cached positions [0, pos] instead of [0, pos), so slot pos, which "
            "this step has not written yet, is read from the cache besides the new token's k, v",
            (Patch(ATTN, "return lo, min(lo + chunk, pos)", "return lo, min(lo + chunk, pos + 1)"),),
            CPU_PROBES_ATTENTION,
            (Patch(K_ATTN, "hi = lo + chunk\n        if hi > pos:\n            hi = pos",
                   "hi = lo + chunk\n        if hi > pos + 1:\n            hi = pos + 1"),))
    + _pair("rmsnorm_eps_ignored",
            "RMSNorm computes x * rsqrt(mean(x^2)) * w, without eps",
            (Patch(CONTEXT, "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)",
                   "torch.rsqrt(x.pow(2).mean(-1, keepdim=True))"),),
            (stage_probe("test_qkv_stage"), stage_probe("test_gate_up_stage"), stage_probe("test_lm_head_stage"),
             stage_probe("test_attention_partial_and_reduce_stages"), VM_PROBE, E2E_CPU_PROBE),
            (Patch(K_INTERP, "self.eps = float(c.rms_norm_eps)", "self.eps = 0.0"),))
    + _pair("split_merge_unnormalized",
            "the split merge (ATTN_REDUCE, or O_PROJ's folded merge) weights the splits by exp(lse_s - max lse) "
            "without dividing by their sum",
            (Patch(ATTN, "return (torch.softmax(lse, dim=-1)[..., None] * o).sum(dim=-2)",
                   "return (torch.exp(lse - lse.amax(-1, keepdim=True))[..., None] * o).sum(dim=-2)"),),
            (stage_probe("test_attn_reduce_stage_with_empty_splits"), stage_probe("test_o_proj_stage"),
             stage_probe("test_attention_partial_and_reduce_stages"), VM_PROBE, E2E_CPU_PROBE),
            (Patch(K_ATTN, "            out = acc_o / tot", "            out = acc_o"),
             Patch(K_ATTN, "            out[e] = out[e] / tot", "            out[e] = out[e]")))
    + _pair("argmax_tie_to_highest",
            "ARGMAX breaks a tie between LM-head tiles toward the highest vocabulary index",
            (Patch(ARGMAX, "torch.where(vals == top, idx, torch.iinfo(torch.int32).max).min(dim=1).values",
                   "torch.where(vals == top, idx, -1).max(dim=1).values"),),
            (stage_probe("test_argmax_stage"), VM_PROBE, E2E_CPU_PROBE),
            # ptx.max_index: the one rule of every (max, index) merge on the device
            (Patch(K_PTX, "if ov > v or (ov == v and oi < i):", "if ov > v or (ov == v and oi > i):"),),
            "the device's (max, index) merges (ARGMAX's scan of a lane's tiles and its warp reduction, the LM head's "
            "merges of its warps' maxima: ptx.max_index) break ties toward the highest index")
    + _pair("fragment_halves_swapped",
            "fragment_pack nests a lane's 8-column halves and 16-column halves the other way round, so its registers "
            "hold columns 2t+16, 2t+17 where 2t+8, 2t+9 belong",
            (Patch(LAYOUT, "return v.permute(*range(n), n, n + 2, n + 1, n + 5, n + 3, n + 4, n + 6)",
                   "return v.permute(*range(n), n, n + 2, n + 1, n + 5, n + 4, n + 3, n + 6)"),),
            (FRAGMENT_PROBE, VM_PROBE),
            (Patch(K_MATVEC, "d = mma_bf16_16816(a[q], a[q + 1], a[q + 2], a[q + 3], bx[b], bx[b + 1],",
                   "d = mma_bf16_16816(a[q], a[q + 2], a[q + 1], a[q + 3], bx[b], bx[b + 1],"),),
            "the pair MMA's A registers in the wrong order: a lane's columns 2t+16, 2t+17 where 2t+8, 2t+9 belong")
    + [Mutation("split_k_reduce_drops_a_range",
                "the partials of a split stage summed without the last K range (split_k.sum_ranges: MV_REDUCE's, and "
                "the attention's for QKV, at batch 16-64)",
                (Patch(SPLIT_K, "    for e in range(1, num_ranges):", "    for e in range(1, num_ranges - 1):"),),
                (Probe("vm-split-k", (VM, "-k", "split_over_k or large_batch")),)),
       Mutation("aliasing_shared_append_allowed",
                "the aliasing rule (aliased_appends) lets two sequences append to one KV slot (only reads are checked)",
                (Patch(LAYOUT, "            if o != b and writes[o] == writes[b]:", "            if False:"),),
                (Probe("vm-aliasing", (VM, "-k", "alias or scratch")),)),
       Mutation("aliasing_shared_append_allowed.kernel",
                "the kernel's aliasing scan (scan_aliasing) lets two sequences append to one KV slot (only reads "
                "are checked)",
                (Patch(K_ATTN, "if entries[u] == s_alias[3 * NB + b] and (t < pt or (t == pt and o != b)):",
                       "if entries[u] == s_alias[3 * NB + b] and t < pt:"),),
                (GPU_ALIAS_PROBE,), kernel=True),
       Mutation("wide_gate_up_stored_without_rows.kernel",
                "past batch 8, a consumer warp that owns no rows of a small GATE_UP tile still stores its (zero) "
                "outputs, over the next tiles' outputs",
                (Patch(K_WIDE, "if b < B and nr0 - j * GS > 0:", "if b < B:"),),
                (GPU_WIDE_STAGES_PROBE,), kernel=True),
       Mutation("wide_prestaged_copy_without_norm.kernel",
                "past batch 8, O_PROJ's and DOWN's epilogue writes the next stage's pre-staged input without that "
                "stage's norm weight, so GATE_UP and QKV multiply an unnormalised input",
                (Patch(K_WIDE, "st_bf16(wout + Int64(wide_x_byte(b, a0 + r, B)), v * gv[2 * j + blk])",
                       "st_bf16(wout + Int64(wide_x_byte(b, a0 + r, B)), v)"),),
                (GPU_WIDE_STAGES_PROBE,), kernel=True),
       Mutation("attention_copy_of_the_next_head.kernel",
                "past batch 8, the attention writes O_PROJ's pre-staged input one head further on, so O_PROJ "
                "multiplies each head's weights by the previous head's output (the first head's by the last's)",
                (Patch(K_ATTN, "Int64(wide_x_byte(b, k, self.B)), v)",
                       "Int64(wide_x_byte(b, (k + self.D) % self.Q, self.B)), v)"),),
                (GPU_WIDE_STAGES_PROBE,), kernel=True),
       Mutation("wide_second_group_reads_the_first.kernel",
                "past batch 8, a warpgroup multiplies the set of its second row groups into the accumulators of its "
                "first, so rows past the chunk's first 128 get nothing and the first 128 another set's sums",
                (Patch(K_WIDE, "if S // 2 == j:", "if j == 0:"),),
                (GPU_WIDE_STAGES_PROBE,), kernel=True),
       # the weight ring (megakernel/kernel/stream.py): device-only, no VM twin
       Mutation("ring_phase_flipped.kernel",
                "consumers wait for the weight slot's full barrier with the parity of its previous use, so they read "
                "a slot before its bulk copy has landed",
                (Patch(K_MATVEC, "self.wait_full(full + mb, phase, p.error)",
                       "self.wait_full(full + mb, phase ^ 1, p.error)"),),
                GPU_PROBES, kernel=True),
       Mutation("ring_slot_freed_before_read.kernel",
                "a warp that reads a weight slot frees its part (arrives on the slot's empty barrier) as soon as the "
                "slot has landed, before reading it, so the producer may refill the slot under its readers",
                (Patch(K_MATVEC, "self.wait_full(full + mb, phase, p.error)\n",
                       "self.wait_full(full + mb, phase, p.error)\n"
                       "                            mbarrier_arrive(empty + mb)\n"),
                 Patch(K_MATVEC, "                            # empty barrier counts 32 arrivals a warp: "
                                 "stream.RELEASE_LANES)\n"
                                 "                            mbarrier_arrive(empty + mb)\n",
                       "                            # empty barrier counts 32 arrivals a warp: "
                       "stream.RELEASE_LANES)\n")),
                GPU_PROBES, kernel=True)]
)

BY_NAME = {m.name: m for m in MUTATIONS}


class MutationRotError(RuntimeError):
    """A patch's old text does not occur exactly once: the sources moved on, the mutation must follow."""


def occurrences(root: Path, patch: Patch) -> int:
    return (root / patch.path).read_text().count(patch.old)


def apply_mutation(root: Path, mutation: Mutation) -> None:
    """Apply every patch of `mutation` to the tree at `root` (a copy), checking each old text occurs once
    and that the mutated file still compiles."""
    texts: dict[str, str] = {}
    for p in mutation.patches:
        text = texts.get(p.path) or (root / p.path).read_text()
        n = text.count(p.old)
        if n != 1:
            raise MutationRotError(f"{mutation.name}: {p.path}: old text occurs {n} times (expected once): {p.old!r}")
        texts[p.path] = text.replace(p.old, p.new)
    for path, text in texts.items():
        compile(text, str(root / path), "exec")
        (root / path).write_text(text)


def location(root: Path, patch: Patch) -> str:
    text = (root / patch.path).read_text()
    i = text.find(patch.old)
    return f"{patch.path}:{text.count(chr(10), 0, i) + 1}" if i >= 0 else f"{patch.path}:?"


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


# ---- copies and runs ---------------------------------------------------------------------------------------------

GUARD_PLUGIN = '''\
"""pytest plugin used by tools/mutations.py: records where megakernel was imported from, and registers the
hypothesis profile "mutation" (the suite's "ci" profile without the shrink phase: a mutation run needs to
know that an example fails, not the smallest one, and shrinking costs far more than finding)."""
import json, os, sys

try:
    from hypothesis import HealthCheck, Phase, settings
except ImportError:
    pass
else:
    settings.register_profile("mutation", derandomize=True, max_examples=10, database=None, deadline=None,
                              phases=(Phase.explicit, Phase.reuse, Phase.generate), print_blob=False,
                              suppress_health_check=[HealthCheck.too_slow])


def pytest_unconfigure(config):
    root = os.path.realpath(os.environ["MUTATION_COPY_ROOT"])
    loaded = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
              if n == "megakernel" or n.startswith("megakernel.")}
    foreign = sorted(n for n, f in loaded.items() if f and not os.path.realpath(f).startswith(root + os.sep))
    with open(os.environ["MUTATION_GUARD_REPORT"], "w") as fh:
        json.dump({"megakernel": loaded.get("megakernel"), "modules": len(loaded), "foreign": foreign}, fh)
'''


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*COPY_IGNORE), symlinks=True)
    return dst


def run_env(copy: Path, guard_dir: Path, report: Path, hypothesis_profile: str) -> dict[str, str]:
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(guard_dir)] + ([rest] if rest else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"      # no stale .pyc can stand in for a patched source
    env["COLUMNS"] = "10000"                  # pytest's short summary keeps each failure's whole first line
    env["MUTATION_COPY_ROOT"] = str(copy)
    env["MUTATION_GUARD_REPORT"] = str(report)
    if hypothesis_profile:
        env["HYPOTHESIS_PROFILE"] = hypothesis_profile
    return env


def verify_imports(copy: Path, env: dict[str, str], mutation: Mutation | None) -> str | None:
    """None when `import megakernel` (and each patched module) resolves inside `copy` and holds the mutated
    text; otherwise what went wrong."""
    modules = [] if mutation is None or mutation.kernel else [(module_name(p.path), p.new) for p in mutation.patches]
    code = textwrap.dedent(f"""
        import importlib, json, megakernel
        out = {{"megakernel": megakernel.__file__, "modules": {{}}}}
        for name, new in {modules!r}:
            mod = importlib.import_module(name)
            out["modules"][name] = [mod.__file__, new in open(mod.__file__).read()]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if proc.returncode:
        return f"import check failed: {proc.stderr.strip().splitlines()[-1:]}"
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    root = os.path.realpath(copy) + os.sep
    if not os.path.realpath(info["megakernel"]).startswith(root):
        return f"megakernel resolves to {info['megakernel']}, not the copy {copy}"
    for name, (path, mutated) in info["modules"].items():
        if not os.path.realpath(path).startswith(root):
            return f"{name} resolves to {path}, not the copy"
        if not mutated:
            return f"{name} at {path} does not hold the mutated text"
    return None


SUMMARY_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
FAILED_RE = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")


@dataclass
class ProbeResult:
    label: str
    command: str
    outcome: str                 # "caught", "passed", "nothing ran", "error", "timeout", "not run"
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)     # (node id, first message line)
    counts: dict[str, int] = field(default_factory=dict)
    detail: str = ""


def run_probe(copy: Path, guard_dir: Path, probe: Probe, hypothesis_profile: str, timeout: float) -> ProbeResult:
    report = copy / f".mutation-guard-{abs(hash(probe)) % 10**8}.json"
    report.unlink(missing_ok=True)
    env = run_env(copy, guard_dir, report, hypothesis_profile)
    cmd = [sys.executable, "-m", "pytest", *PYTEST_BASE, "-p", "mutation_guard", *probe.args]
    shown = "python -m pytest " + " ".join(PYTEST_BASE) + " " + " ".join(probe.args)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ProbeResult(probe.label, shown, "timeout", time.monotonic() - t0, detail=f"over {timeout:.0f} s")
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    counts: dict[str, int] = {}
    for line in reversed(lines):
        found = SUMMARY_RE.findall(line)
        if found and (" in " in line or line.startswith("=")):
            for n, what in found:
                counts["errors" if what == "error" else what] = int(n)
            break
    failures = []
    for line in lines:
        m = FAILED_RE.match(line.strip())
        if m:
            failures.append((m.group(2), (m.group(3) or m.group(1)).strip()))
    result = ProbeResult(probe.label, shown, "", seconds, failures, counts)
    guard = None
    if report.exists():
        guard = json.loads(report.read_text())
        report.unlink()
    if guard is not None and guard["foreign"]:
        result.outcome = "error"
        result.detail = f"modules imported from outside the copy: {guard['foreign'][:5]}"
    elif proc.returncode == 1 and failures:
        result.outcome = "caught"
    elif proc.returncode == 0:
        result.outcome = "passed" if counts.get("passed", 0) + counts.get("xpassed", 0) else "nothing ran"
        if result.outcome == "nothing ran":
            skipped = [ln.strip() for ln in lines if ln.strip().startswith("SKIPPED")]
            result.detail = skipped[0] if skipped else "every test skipped or deselected"
    elif proc.returncode == 5:
        result.outcome = "nothing ran"
        result.detail = "no tests collected"
    else:
        result.outcome = "error"
        tail = [ln for ln in lines if ln.strip()][-3:]
        result.detail = f"pytest exit {proc.returncode}: " + " | ".join(tail)
    if guard is None and result.outcome in ("caught", "passed"):
        result.outcome = "error"
        result.detail = "the guard plugin wrote no report: cannot tell which megakernel the tests imported"
    return result


@dataclass
class MutationResult:
    name: str
    bug: str
    where: str
    kernel: bool
    status: str = ""                 # "caught", "missed", "not run", "error"
    result: str = ""                 # the table's wording: "caught (2 of 3 probes)", "MISSED", ...
    caught_by: list[str] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    compile: str = ""                # kernel rows run without --gpu: what compiling the mutant showed
    seconds: float = 0.0


def _short_failure(node: str, message: str) -> str:
    node = node.removeprefix("tests/")
    kind = message.split(":", 1)[0] if message else ""
    return f"`{node}`" + (f" ({kind})" if kind and " " not in kind else "")


# Compiles the decode kernel of the copy it runs in (sm_90a, no GPU needed) for two small shapes and prints
# the cubins' digests: a kernel mutant that compiles to the original's code would be no mutant at all.
COMPILE_CHECK = '''\
import hashlib, json, os, sys
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from megakernel.instructions.layout import StepLayout, default_kv_splits
from megakernel.instructions.record import serialize
from megakernel.kernel import interpreter
from megakernel.kernel.compile import KernelKey, compile_decode_kernel
from megakernel.model.presets import get_preset
from megakernel.schedule import assign, build_program
out = {"kernel": interpreter.__file__, "cubins": {}}
for name in ("tiny-llama", "tiny-qwen3"):
    config = get_preset(name)
    layout = StepLayout(config=config, batch=2, kv_splits=default_kv_splits(config, 2, 132), block_size=16,
                        max_blocks_per_seq=4, num_sms=132)
    program = build_program(layout)
    table, _ = serialize(assign(program, "balanced"))
    key = KernelKey(layout=layout, lm_tiles=program.lm_tiles, num_counters=program.num_counters,
                    max_queue_len=table.shape[1], kv_strides=None, options=interpreter.KernelOptions())
    out["cubins"][name] = hashlib.sha1(compile_decode_kernel(key, keep_artifacts=True).__cubin__).hexdigest()
print(json.dumps(out))
'''


def compile_kernel(copy: Path, guard_dir: Path, timeout: float) -> dict:
    """{"kernel": path of the compiled interpreter.py, "cubins": {shape: sha1}} or {"error": text}."""
    env = run_env(copy, guard_dir, copy / ".unused.json", "")
    env["CUTE_DSL_ARCH"] = "sm_90a"
    with tempfile.TemporaryDirectory(prefix="cute-dsl-") as dump:
        env["CUTE_DSL_DUMP_DIR"] = dump
        try:
            proc = subprocess.run([sys.executable, "-c", COMPILE_CHECK], cwd=copy, env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"compiling took over {timeout:.0f} s"}
    if proc.returncode:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-2:]
        return {"error": "does not compile: " + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_mutation(mutation: Mutation, snapshot: Path, work: Path, guard_dir: Path, args,
                 probes: tuple[Probe, ...], original_cubins: dict | None) -> MutationResult:
    where = ", ".join(sorted({location(snapshot, p) for p in mutation.patches}))
    res = MutationResult(mutation.name, mutation.bug, where, mutation.kernel)
    compile_only = mutation.kernel and not args.gpu
    if compile_only and original_cubins is None:
        res.status, res.result = "not run", "not run here (needs GPU)"
        return res
    t0 = time.monotonic()
    copy = copy_tree(snapshot, work / mutation.name)
    try:
        apply_mutation(copy, mutation)
        if compile_only:
            got = compile_kernel(copy, guard_dir, args.timeout)
            res.status, res.result = "not run", "not run here (needs GPU)"
            if "error" in got:
                res.status, res.result = "error", f"error: kernel mutant {got['error']}"
            elif not os.path.realpath(got["kernel"]).startswith(os.path.realpath(copy) + os.sep):
                res.status, res.result = "error", f"error: compiled {got['kernel']}, not the copy's kernel"
            else:
                differs = [n for n, h in got["cubins"].items() if h != original_cubins.get(n)]
                if differs:
                    res.compile = f"compiles for sm_90a; cubin differs from the original ({', '.join(differs)})"
                else:
                    res.status = "error"
                    res.result = "error: the mutant compiles to the original's cubin (no code change)"
            return res
        env = run_env(copy, guard_dir, copy / ".unused.json", args.hypothesis_profile)
        problem = verify_imports(copy, env, mutation)
        if problem:
            res.status, res.result = "error", f"error: {problem}"
            return res
        for probe in probes:
            pr = run_probe(copy, guard_dir, probe, args.hypothesis_profile, args.timeout)
            res.probes.append(pr)
            if pr.outcome == "caught":
                res.caught_by += [_short_failure(n, m) for n, m in pr.failures]
            if pr.outcome == "caught" and args.first:
                break
        outcomes = [p.outcome for p in res.probes]
        if "caught" in outcomes:
            res.status = "caught"
            res.result = f"caught ({outcomes.count('caught')} of {len(outcomes)} probes)"
        elif set(outcomes) <= {"passed"}:
            res.status, res.result = "missed", "MISSED"
        elif "error" in outcomes or "timeout" in outcomes:
            bad = next(p for p in res.probes if p.outcome in ("error", "timeout"))
            res.status, res.result = "error", f"{bad.outcome}: {bad.label}: {bad.detail}"
        else:
            res.status = "not run"
            res.result = "no test ran (" + "; ".join(p.detail for p in res.probes if p.detail) + ")"
        return res
    finally:
        res.seconds = time.monotonic() - t0
        if not args.keep:
            shutil.rmtree(copy, ignore_errors=True)


def probes_for(mutation: Mutation, args) -> tuple[Probe, ...]:
    if args.tests:
        extra = ("-k", args.keyword) if args.keyword else ()
        return (Probe("tests", tuple(args.tests) + extra, gpu=mutation.kernel),)
    return mutation.probes


# ---- report ------------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: list[MutationResult], baseline: list[ProbeResult], seconds: float, args) -> str:
    lines = ["| mutation | where | caught by | result |", "|---|---|---|---|"]
    for r in results:
        name = f"`{r.name}`" + (" (kernel)" if r.kernel else "")
        caught = "<br>".join(r.caught_by) if r.caught_by else "-"
        result = r.result + (f"; {r.compile}" if r.compile else "")
        lines.append(f"| {name}: {_cell(r.bug)} | {_cell(r.where)} | {_cell(caught)} | {_cell(result)} |")
    lines += ["", "Probes (each `python -m pytest " + " ".join(PYTEST_BASE) + " <tests>` in the mutated copy; "
              "`-x` stops a probe at its first failure):", ""]
    for r in results:
        if not r.probes:
            continue
        lines.append(f"- `{r.name}` ({r.seconds:.0f} s)")
        for p in r.probes:
            what = f"{p.outcome}"
            if p.failures:
                node, msg = p.failures[0]
                what += f": `{node}`: {_cell(msg[:300])}"
            elif p.detail:
                what += f": {_cell(p.detail[:200])}"
            lines.append(f"  - {p.label} ({p.seconds:.0f} s): {what}")
    if baseline:
        lines += ["", "Baseline (unmutated copy): " + ", ".join(
            f"{p.label} {p.outcome} ({sum(v for k, v in p.counts.items() if k == 'passed')} passed, {p.seconds:.0f} s)"
            for p in baseline)]
    lines += ["", f"Total {seconds:.0f} s, hypothesis profile `{args.hypothesis_profile}`, "
              f"{'GPU rows run' if args.gpu else 'kernel rows need --gpu'}."]
    return "\n".join(lines) + "\n"


# ---- main --------------------------------------------------------------------------------------------------------

def select(only: list[str] | None) -> list[Mutation]:
    if not only:
        return list(MUTATIONS)
    out = []
    for name in only:
        matched = [m for m in MUTATIONS if m.name == name or m.name == f"{name}.kernel"]
        if not matched:
            raise SystemExit(f"unknown mutation {name!r}; known: {', '.join(BY_NAME)}")
        out += [m for m in matched if m not in out]
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run this mutation (and its kernel row); repeatable")
    ap.add_argument("--gpu", action="store_true", help="also run the kernel rows (GPU tests; needs a CUDA device)")
    ap.add_argument("--kernel-only", action="store_true",
                    help="with --gpu: only the kernel rows (the CPU rows' result is in the README; this fits the "
                         "GPU host's 10-minute calls with --jobs 3)")
    ap.add_argument("--tests", nargs="+", metavar="TEST",
                    help="pytest paths / node ids to run for every selected mutation instead of its own probes")
    ap.add_argument("-k", "--keyword", help="a pytest -k expression applied with --tests")
    ap.add_argument("--markdown", metavar="PATH", help="also write the report (table and probes) here")
    ap.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    ap.add_argument("--repo", type=Path, default=REPO, help="repository to copy (default: this script's)")
    ap.add_argument("--jobs", type=int, default=1, help="mutations run side by side (each in its own copy)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per probe")
    ap.add_argument("--hypothesis-profile", default="mutation",
                    help="HYPOTHESIS_PROFILE for the runs (default mutation: the suite's derandomized 'ci' "
                         "profile, 10 examples, without shrinking)")
    ap.add_argument("--first", action="store_true", help="stop a mutation at the first probe that catches it")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    ap.add_argument("--no-compile", action="store_true",
                    help="without --gpu, do not compile the kernel mutants for sm_90a (by default each is compiled "
                         "and its cubin compared with the original's, so a kernel row is at least a real mutant)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (their path is printed)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:34s} {m.bug}")
        return 0
    selected = select(args.only)
    if args.kernel_only:
        if not args.gpu:
            print("--kernel-only runs the kernel rows, which need --gpu", file=sys.stderr)
            return 2
        selected = [m for m in selected if m.kernel]
    repo = args.repo.resolve()
    for m in selected:
        for p in m.patches:
            n = occurrences(repo, p)
            if n != 1:
                print(f"{m.name}: {p.path}: old text occurs {n} times (expected once): {p.old!r}", file=sys.stderr)
                return 2
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="megakernel-mutations-"))
    try:
        guard_dir = tmp / "guard"
        guard_dir.mkdir()
        (guard_dir / "mutation_guard.py").write_text(GUARD_PLUGIN)
        snapshot = copy_tree(repo, tmp / "snapshot")      # one consistent snapshot for every run
        runnable = [m for m in selected if args.gpu or not m.kernel]
        plan = {m.name: probes_for(m, args) for m in runnable}

        baseline: list[ProbeResult] = []
        if not args.no_baseline and runnable:
            base = copy_tree(snapshot, tmp / "baseline")
            problem = verify_imports(base, run_env(base, guard_dir, base / ".unused.json", args.hypothesis_profile),
                                     None)
            if problem:
                print(f"baseline: {problem}", file=sys.stderr)
                return 2
            unique = list(dict.fromkeys(p for probes in plan.values() for p in probes))
            for probe in unique:
                pr = run_probe(base, guard_dir, probe, args.hypothesis_profile, args.timeout)
                baseline.append(pr)
                print(f"baseline {probe.label}: {pr.outcome} ({pr.seconds:.0f} s)", file=sys.stderr, flush=True)
            bad = [p for p in baseline if p.outcome != "passed"]
            if bad:
                for p in bad:
                    first = f"{p.failures[0][0]}: {p.failures[0][1]}" if p.failures else p.detail
                    print(f"baseline probe {p.label} {p.outcome}: {first}", file=sys.stderr)
                print("the unmutated sources fail these probes: fix that first", file=sys.stderr)
                return 2

        original_cubins = None
        if not args.gpu and not args.no_compile and any(m.kernel for m in selected):
            got = compile_kernel(snapshot, guard_dir, args.timeout)
            if "error" in got:
                print(f"the unmutated kernel {got['error']}", file=sys.stderr)
                return 2
            original_cubins = got["cubins"]

        def one(m: Mutation) -> MutationResult:
            r = run_mutation(m, snapshot, tmp, guard_dir, args, plan.get(m.name, ()), original_cubins)
            # each row as it ends, with what every probe gave (a run cut short keeps these lines)
            probes = ", ".join(f"{p.label} {p.outcome}" for p in r.probes)
            print(f"{m.name}: {r.result} ({r.seconds:.0f} s){': ' + probes if probes else ''}", file=sys.stderr,
                  flush=True)
            return r

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(one, selected))
        seconds = time.monotonic() - t0
        report = markdown(results, baseline, seconds, args)
        print(report)
        if args.markdown:
            Path(args.markdown).write_text(report)
        if args.json:
            Path(args.json).write_text(json.dumps({"seconds": seconds, "results": [asdict(r) for r in results],
                                                   "baseline": [asdict(p) for p in baseline]}, indent=1))
        # with --gpu a kernel row that ran no test (no CUDA device: every GPU test skipped) is a failure too
        ok = all(r.status == "caught" or (r.status == "not run" and not (args.gpu and r.kernel)) for r in results)
        return 0 if ok else 1
    except MutationRotError as e:
        print(str(e), file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copies kept under {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
