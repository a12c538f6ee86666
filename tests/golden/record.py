"""Record what the default (sandbox) and tiny presets produce, to pin behaviour across refactors.

    python tests/golden/record.py        # writes tests/golden/<preset>/<platform>.json

Each file holds the sha256 of every saved adapter and the round records without timings, with the
CPU, its vector instructions as torch dispatches them, and the library versions they were made
with: fp32 kernels round differently on other CPUs and library versions, so
tests/test_golden_runs.py compares only against a file made on this platform. Record on a new
platform from a commit whose results are trusted (the one before the change to be checked).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TIMING = {
    "seconds",
    "eval_seconds",
    "score_seconds",
    "rollout_s",
    "grade_s",
    "cache_s",
    "opd_s",
    "total_s",
    "teacher_s",
    "train_s",
    "eval_s",
    "score_s",
    "worker-pid",
    "worker-model-loads",
    "worker-rss-mb",
    "server-rss-mb",
    "communication",
}  # message sizes include the run folder's path, which differs between runs


def platform_key() -> dict[str, str]:
    import torch
    import transformers

    cpu = (
        next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "unknown")
        if Path("/proc/cpuinfo").exists()
        else "unknown"
    )
    return {"cpu": cpu, "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "transformers": transformers.__version__}


def platform_slug(platform: dict[str, str]) -> str:
    """A file name for ``platform``: its values, lower case, non-alphanumerics as '-'."""
    text = "_".join(platform[k] for k in ("cpu", "capability", "torch", "transformers"))
    return re.sub(r"[^a-z0-9.+_]+", "-", text.lower()).strip("-")


def golden_path(preset: str, platform: dict[str, str]) -> Path:
    return HERE / preset / f"{platform_slug(platform)}.json"


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def preset_overrides(preset: str) -> dict:
    from fedopd.config.presets import load_preset

    return {} if preset == "sandbox" else load_preset(REPO / "configs" / f"{preset}.toml")


def fingerprint(run: Path) -> dict:
    """Adapter hashes by path and the round records without timings."""
    adapters = {str(p.parent.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("adapter_model.safetensors"))}
    records = [without_timings(json.loads(line)) for line in (run / "rounds.jsonl").read_text().splitlines()]
    return {"adapters": adapters, "records": records}


def run_preset(preset: str, output_dir: str) -> Path:
    """The preset's run, on one compute thread: fp32 matmuls round differently with other
    thread counts (oneDNN splits their reductions), and the suite's workers use one."""
    import torch

    from fedopd.config.presets import app_defaults
    from server_app.inprocess import run_in_process

    torch.set_num_threads(1)

    return run_in_process({**app_defaults(), **preset_overrides(preset), "output-dir": output_dir})


def main() -> int:
    sys.path.insert(0, str(REPO))
    for preset in ("sandbox", "tiny"):
        with tempfile.TemporaryDirectory() as tmp:
            run = run_preset(preset, tmp)
            out = {"platform": platform_key(), **fingerprint(run)}
        path = golden_path(preset, out["platform"])
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"{preset}: {len(out['adapters'])} adapters, {len(out['records'])} records -> {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
