"""tools/mutations.py: the suite catches injected bugs, and the mutations still apply to the current sources.

The script copies the repository to a temporary directory, patches one known bug into the copy and runs tests
there (the copy first on PYTHONPATH; the script checks that megakernel is imported from it). Two mutations run
here end to end: RoPE at position + 1 and ATTN_PARTIAL's missing wait on QKV, each against a short selection
of the stage and VM tests (the full table: `python tools/mutations.py`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "mutations.py"


def _load():
    spec = importlib.util.spec_from_file_location("megakernel_tools_mutations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


mutations = _load()
NAMES = [m.name for m in mutations.MUTATIONS]
REQUIRED = ("rope_position_plus_one", "o_proj_residual_dropped", "gqa_kv_head_interleaved",
            "softmax_scale_1_over_d", "missing_wait", "kv_length_plus_one")


def test_names_are_unique_and_the_required_bugs_are_there():
    assert len(NAMES) == len(set(NAMES)), f"duplicate mutation names in {NAMES}"
    missing = [n for n in REQUIRED if n not in NAMES]
    assert not missing, f"required mutations missing from tools/mutations.py: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_mutation_still_applies_to_the_current_sources(name):
    """Each patch's old text occurs exactly once in the file it names (so the script cannot silently stop
    mutating anything when the sources move on), the new text differs, and the mutated file still compiles."""
    m = mutations.BY_NAME[name]
    assert m.patches, f"{name}: no patches"
    texts: dict[str, str] = {}
    for p in m.patches:
        path = REPO / p.path
        assert path.is_file(), f"{name}: {p.path} does not exist"
        assert p.old != p.new, f"{name}: {p.path}: the patch changes nothing"
        original = path.read_text()
        n = original.count(p.old)
        assert n == 1, f"{name}: {p.path}: old text occurs {n} times in the current source, expected once: {p.old!r}"
        texts[p.path] = texts.get(p.path, original).replace(p.old, p.new)
    for rel, text in texts.items():
        compile(text, rel, "exec")
    # VM rows mutate what the CPU tests run (instructions, schedule); kernel rows only the device code
    if m.kernel:
        assert {p.path for p in m.patches} <= set(mutations.KERNEL_MODULES), f"{name}: a kernel row patches {texts.keys()}"
    else:
        assert all(p.path.startswith(("megakernel/instructions/", "megakernel/schedule/")) for p in m.patches), \
            f"{name}: a VM row patches {sorted(texts)}"


@pytest.mark.parametrize("name", NAMES)
def test_probes_name_existing_tests(name):
    """Every test file and test function a probe selects exists (a renamed test would leave the probe empty)."""
    m = mutations.BY_NAME[name]
    assert m.probes, f"{name}: no probes"
    if not m.kernel:
        assert any(not p.gpu for p in m.probes), f"{name}: the VM row has no CPU probe"
    for probe in m.probes:
        for arg in probe.args:
            if not arg.startswith("tests/"):
                continue
            file, _, func = arg.partition("::")
            assert (REPO / file).is_file(), f"{name}: probe {probe.label} names {file}, which does not exist"
            func = func.split("[")[0]
            if func:
                assert re.search(rf"^def {re.escape(func)}\(", (REPO / file).read_text(), re.MULTILINE), \
                    f"{name}: probe {probe.label} names {file}::{func}, which does not exist"


@pytest.mark.skipif("MUTATION_COPY_ROOT" in os.environ, reason="already inside a mutation run")
def test_rope_and_missing_wait_are_caught(tmp_path):
    out = tmp_path / "results.json"
    table = tmp_path / "table.md"
    status = mutations.main([
        "--only", "rope_position_plus_one", "--only", "missing_wait", "--no-compile", "--jobs", "2",
        "--tests", "tests/unit/test_stages.py::test_attention_partial_and_reduce_stages",
        "tests/unit/test_vm.py::test_vm_decoder_equals_reference_decoder",
        "-k", "test_attention_partial_and_reduce_stages or tiny-llama-balanced-round-robin-sms132",
        "--json", str(out), "--markdown", str(table), "--repo", str(REPO)])
    report = json.loads(out.read_text())
    results = {r["name"]: r for r in report["results"]}
    what = json.dumps(report, indent=1)[:4000]
    assert [p["outcome"] for p in report["baseline"]] == ["passed"], f"baseline: {what}"
    assert report["baseline"][0]["counts"].get("passed") == 2, f"baseline ran other tests than chosen: {what}"
    for name, test in (("rope_position_plus_one", "test_attention_partial_and_reduce_stages"),
                       ("missing_wait", "test_vm_decoder_equals_reference_decoder")):
        r = results[name]
        assert r["status"] == "caught", f"{name}: {r['result']}: {what}"
        failed = [node for p in r["probes"] for node, _ in p["failures"]]
        assert any(test in node for node in failed), f"{name}: caught by {failed}, expected {test}: {what}"
        assert r["caught_by"], f"{name}: {what}"
    for name in ("rope_position_plus_one.kernel", "missing_wait.kernel"):
        assert results[name]["result"] == "not run here (needs GPU)", f"{name}: {what}"
    assert status == 0, what
    text = table.read_text()
    assert text.startswith("| mutation | where | caught by | result |"), text[:200]
    assert "`rope_position_plus_one`" in text and "megakernel/instructions/attention.py:" in text, text[:2000]
