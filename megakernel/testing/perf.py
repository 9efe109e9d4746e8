"""Per-GPU ratio thresholds for perf tests, as the pytest plugin offers them (fixture `perf_thresholds`).

A thresholds file is TOML: one table per GPU name (what torch.cuda.get_device_name gives), then a metric,
then a case name, then a key (a batch size, say), each a ratio measured within one run that a test must
reach or beat (a fraction of a bandwidth floor, a speedup over a baseline), never an absolute time:

    ["NVIDIA H200".floor_fraction]
    "llama-3.2-1b" = { 1 = 0.58, 4 = 0.37 }

A GPU, metric, case or key missing from the file enforces nothing for it: the test reports its numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping


def load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:                     # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


@dataclass(frozen=True)
class PerfThresholds:
    """The thresholds file (or none: `path` None, nothing enforced)."""

    path: Path | None = None
    tables: dict = field(default_factory=dict)    # GPU name -> metric -> case -> key -> minimum ratio

    @classmethod
    def load(cls, path: str | Path) -> "PerfThresholds":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"perf thresholds file {path} does not exist")
        return cls(path=path, tables=load_toml(path))

    def table(self, gpu: str) -> dict | None:
        """The GPU's metrics, or None where the file does not list it."""
        return self.tables.get(gpu)

    def limit(self, gpu: str, metric: str, case: str, key) -> float | None:
        return ((self.table(gpu) or {}).get(metric, {}).get(case, {}).get(str(key)))

    def failures(self, gpu: str, metrics: Mapping[str, float], case: str, key) -> list[str]:
        """'metric value < limit' for every metric of `metrics` under its threshold for (gpu, case, key)."""
        out = []
        for metric, value in metrics.items():
            limit = self.limit(gpu, metric, case, key)
            if limit is not None and value < limit:
                out.append(f"{metric} {value:.3f} < {limit}")
        return out

    def check(self, gpu: str, metrics: Mapping[str, float], case: str, key, what: str = "") -> None:
        """AssertionError naming every ratio under its threshold (with all the metrics, to reproduce)."""
        failures = self.failures(gpu, metrics, case, key)
        summary = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        where = f" in {self.path}" if self.path else ""
        assert not failures, f"{what or case} on {gpu}: {'; '.join(failures)} (thresholds{where}; {summary})"


def nvtx_range(message: str, domain: str = "megakernel"):
    """An NVTX range around a timed region (a no-op without the nvtx package: ranges only annotate profiles)."""
    try:
        import nvtx
    except ImportError:
        return contextlib.nullcontext()
    return nvtx.annotate(message, domain=domain)
