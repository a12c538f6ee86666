"""The prepared GPU check: what a paper client round costs on the lent card, in one command.

    python3 benchmarks/gpu_check.py OUT [--commit SHA]     # a GPU host: at most --budget-s (480 s)
    python3 benchmarks/gpu_check.py OUT --tiny              # the CPU dry run CI runs (one to two minutes)

It needs torch, transformers, peft, numpy, safetensors and pytest (the lent machines' image has
them; it has no Flower, vLLM, datasets or math-verify, and nothing here imports them: ``--tiny``
hides them, so the dry run proves it). It writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``
(the same figures as a table), rewritten after every part, and prints the table. Its parts, each
in its share of the budget under a deadline; a part that fails or overruns is recorded with its
error and the next one runs:

1. **tests**: the suite's ``-m gpu`` tests (the files that hold them, :func:`gpu_test_files`) in a
   pytest subprocess, every test's outcome, seconds and skip reason from its JUnit report.
2. **round**: one client round at the paper's architecture, with random weights built from the
   models' configurations (a Qwen3-0.6B-Base student with the paper's LoRA, a Qwen3-8B teacher;
   nothing is downloaded), bf16, the paper preset's settings (``configs/paper-0.6b-1x.toml``: 32
   rollouts, mini-/micro-batch 8/4, activation checkpointing, teacher batch 2) with HF rollouts,
   through the project's own ``train_round`` (rollouts, grading, the teacher pass, the scoring
   cache, local OPD) and ``score_round`` over the preset's 6 candidates. A random student never
   stops, so every response runs to the cap: the paper's 4,096 tokens, or the largest of 4,096,
   2,048, 1,024, ... that a warm-up round predicts to fit the part's share of the budget
   (:func:`choose_cap`; the record says which and why). Seconds per step, tokens/s, the model FLOP
   utilisation of the teacher pass and of local OPD against the card's dense bf16 peak
   (:func:`teacher_pass_flops`, :func:`local_opd_flops`, :data:`BF16_PEAK_TFLOPS`), and the peak
   GPU memory against preflight's memory plan for the same settings
   (:func:`fedopd.preflight.memory_estimate`).
3. **loss**: one forward and backward of the app's reverse-KL loss at the paper's widths (P
   positions x 151,936 vocabulary from hidden states of width 1,024), against full P x V logits,
   each in a fresh process (``benchmarks/client_round.py --loss-case``): peak memory and seconds,
   beside the CPU figure of docs/performance.md and liger-kernel's published 1.75 GiB at 4,096
   positions.

``--tiny`` runs the same code on the CPU with the Qwen3 shapes scaled down (2 layers, 64/128 wide),
a few short rollouts and small loss widths: it checks that the command runs, not what it measures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.abc
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python3 benchmarks/gpu_check.py` on a host where the project is not installed
    sys.path.insert(0, str(ROOT))
GIB = 1024**3
# What the lent machines' image lacks (docs/performance.md): --tiny hides these, so a CPU dry run
# fails where the check would fail there.
IMAGE_LACKS = ("flwr", "vllm", "datasets", "math_verify", "ray", "liger_kernel")
# Dense bf16 tensor-core peaks in TFLOP/s, from NVIDIA's data sheets (their figures "with
# sparsity" halved), by a substring of torch.cuda.get_device_name(); the first match wins.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),  # SXM
    ("A100", 312.0),
)
PAPER_CAP = 4096
LIGER_4096_GIB = 1.75  # liger-kernel's fused linear JSD at 4,096 positions (docs/performance.md)


# ---------------------------------------------------------------------------------------------
# Pure parts: FLOPs, the card's peak, the cap, the test report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """The shapes of a decoder-only transformer that its FLOPs depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config) -> Arch:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.num_hidden_layers, heads, kv, head_dim, config.intermediate_size, config.vocab_size)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matmuls: q and o (hidden x heads*head_dim), k and v (hidden x
        kv_heads*head_dim), the MLP's gate, up and down (hidden x ffn); norms are negligible."""
        q = self.hidden * self.heads * self.head_dim
        kv = self.hidden * self.kv_heads * self.head_dim
        return 2 * q + 2 * kv + 3 * self.hidden * self.ffn


def dense_flops(arch: Arch, tokens: int) -> float:
    """Forward FLOPs of the layers' matmuls over ``tokens`` tokens: 2 per weight and token."""
    return 2.0 * arch.layers * arch.layer_params * tokens


def attention_flops(arch: Arch, length: int) -> float:
    """Forward FLOPs of causal attention over one sequence of ``length``: query i attends to i
    positions, QK^T and AV cost 2 * heads*head_dim * i each, so 2 * heads*head_dim * S(S+1) per layer."""
    return 2.0 * arch.layers * arch.heads * arch.head_dim * length * (length + 1)


def teacher_pass_flops(teacher: Arch, sequences: int, length: int) -> float:
    """Model FLOPs of the teacher pass: a forward over every rollout (prompt and response) that
    stops at the final hidden states (the head runs inside the loss)."""
    return sequences * (dense_flops(teacher, length) + attention_flops(teacher, length))


def local_opd_flops(student: Arch, teacher: Arch, sequences: int, length: int, response_positions: int) -> float:
    """Model FLOPs of local OPD's epoch over the round's rollouts: the student's forward; its
    backward to the inputs only (LoRA freezes the base weights: one matmul per weight instead of
    two, the adapters' own products are negligible; attention's backward is twice its forward); the
    two heads at every response position (the student's forward and backward, the teacher's
    forward). Neither activation checkpointing's recomputation nor padding counts: model FLOPs."""
    student_fwd = sequences * (dense_flops(student, length) + attention_flops(student, length))
    student_bwd = sequences * (dense_flops(student, length) + 2 * attention_flops(student, length))
    heads = response_positions * 2.0 * student.vocab * (2 * student.hidden + teacher.hidden)
    return student_fwd + student_bwd + heads


def peak_tflops(device_name: str) -> float | None:
    """The card's dense bf16 peak (:data:`BF16_PEAK_TFLOPS`), or None for a card not listed."""
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in device_name), None)


def choose_cap(requested: int, warmup_cap: int, prompt_tokens: int, rollout_s: float, rest_s: float, allotted_s: float) -> tuple[int, float]:
    """The largest of ``requested``, ``requested``/2, ... (down to ``warmup_cap``) whose round is
    predicted to take at most ``allotted_s``, and that prediction.

    From a warm-up round at ``warmup_cap`` tokens: generation costs ``rollout_s / warmup_cap`` per
    token of the cap (every rollout of a random student runs to it), and the other steps
    (``rest_s``: teacher pass, scoring cache, local OPD, scores) scale with the sequence length
    ``prompt_tokens + cap``. A rough guide: attention's cost grows faster than linearly, and the
    warm-up's first calls pay kernel selection; the round runs under a deadline whatever it predicts.
    """
    caps = []
    cap = requested
    while cap > warmup_cap:
        caps.append(cap)
        cap //= 2
    caps.append(warmup_cap)

    def predicted(c: int) -> float:
        return rollout_s * c / warmup_cap + rest_s * (prompt_tokens + c) / (prompt_tokens + warmup_cap)

    chosen = next((c for c in caps if predicted(c) <= allotted_s), caps[-1])
    return chosen, predicted(chosen)


def cap_reason(cap: int, requested: int, predicted_s: float, left_s: float) -> str:
    """Why the round ran at ``cap`` (:func:`choose_cap`'s choice), for the report."""
    if cap == requested:
        return f"the requested cap (predicted {predicted_s:.0f} s of the {left_s:.0f} s left)"
    if predicted_s <= left_s:
        return f"the largest halving of {requested} predicted to fit the {left_s:.0f} s left (predicted {predicted_s:.0f} s)"
    return f"no cap was predicted to fit the {left_s:.0f} s left: the warm-up's (predicted {predicted_s:.0f} s)"


def gpu_test_files(tests_dir: Path) -> list[str]:
    """The test files that hold tests marked gpu (``pytest.mark.gpu`` or ``@on_bf16_devices``,
    tests/devices.py), as paths relative to the repository root."""
    marks = re.compile(r"^\s*@(?:pytest\.mark\.gpu\b|on_bf16_devices\b)", re.MULTILINE)
    return sorted(str(p.relative_to(tests_dir.parent)) for p in tests_dir.glob("test_*.py") if marks.search(p.read_text()))


def junit_cases(xml_text: str) -> list[dict[str, Any]]:
    """Each test case of a pytest JUnit report: its id, outcome (passed, failed, error, skipped),
    seconds and, where not passed, the reason's first line."""
    cases = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                reason = (child.get("message") or child.text or "").strip().splitlines()[0] if (child.get("message") or child.text) else ""
                break
        module = (case.get("classname") or "").replace(".", "/")
        cases.append(
            {"test": f"{module}.py::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time") or 0.0), "reason": reason[:300]}
        )
    return cases


# ---------------------------------------------------------------------------------------------
# The packages the image lacks, hidden for a dry run
# ---------------------------------------------------------------------------------------------


class _Hidden(importlib.abc.MetaPathFinder):
    """Wraps a finder so that the packages in ``names`` are not found (``find_spec`` gives None,
    ``import`` raises ModuleNotFoundError), as on a host where they are not installed."""

    def __init__(self, inner, names: frozenset[str]) -> None:
        self.inner, self.names = inner, names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def hide_packages(names: tuple[str, ...]) -> None:
    """Hide ``names`` from this process's imports (none may be imported yet)."""
    loaded = sorted(n for n in names if n in sys.modules)
    if loaded:
        raise RuntimeError(f"cannot hide packages already imported: {', '.join(loaded)}")
    sys.meta_path[:] = [_Hidden(f, frozenset(names)) for f in sys.meta_path]


SITECUSTOMIZE = """import sys
sys.path.insert(0, {root!r})
from benchmarks.gpu_check import hide_packages
hide_packages({names!r})
"""


def child_env(hidden: tuple[str, ...], workdir: Path) -> dict[str, str]:
    """The environment of the check's subprocesses: the repository importable, on the device the
    parent uses, and ``hidden`` hidden there too (a ``sitecustomize`` in ``workdir``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])), PYTHONUNBUFFERED="1")
    if hidden:
        (workdir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(ROOT), names=hidden))
        env["PYTHONPATH"] = os.pathsep.join([str(workdir), env["PYTHONPATH"]])
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL when the check's process ends, however it ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_child(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit status, or None when it ran past ``timeout_s``; stdout; stderr) of ``cmd`` in a
    process group of its own, which is killed whole on the deadline or when this process is
    stopped (SIGTERM, Ctrl-C), and dies with it: nothing it started outlives the check."""
    child = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_die_with_parent
    )
    try:
        out, err = child.communicate(timeout=max(timeout_s, 1))
        return child.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill_group(child)
        out, err = child.communicate()
        return None, out or "", err or ""
    finally:
        _kill_group(child)


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def verbose_cases(output: str) -> list[dict[str, Any]]:
    """The outcomes pytest ``-v`` printed (``tests/x.py::test_y[p] PASSED``), for a run cut off
    before its JUnit report; the test that was running when it was cut off is the last line
    that names a test without an outcome."""
    cases = []
    for line in output.splitlines():
        m = re.match(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", line.strip())
        if m:
            outcome = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error"}.get(m.group(2), m.group(2).lower())
            cases.append({"test": m.group(1), "outcome": outcome, "seconds": 0.0, "reason": ""})
    return cases


def running_test(output: str) -> str | None:
    """The test pytest ``-v`` had started and not finished when its output ends, if any."""
    last = [line.strip() for line in output.splitlines() if "::" in line]
    return last[-1].split(" ")[0] if last and not re.search(r" (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", last[-1]) else None


# ---------------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------------


def run_tests(env: dict[str, str], out: Path, timeout_s: float) -> dict[str, Any]:
    files = gpu_test_files(ROOT / "tests")
    report = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider", "-v", "-rs", f"--junitxml={report}", *files]
    t0 = time.perf_counter()
    returncode, stdout, stderr = run_child(cmd, env, timeout_s)
    cases = junit_cases(report.read_text()) if report.is_file() else verbose_cases(stdout)
    report.unlink(missing_ok=True)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    result = {
        "files": files,
        "returncode": returncode,
        "seconds": time.perf_counter() - t0,
        **counts,
        "cases": cases,
        "output_tail": (stdout + stderr)[-3000:],
    }
    if returncode is None:
        raise PartError(f"pytest ran past {timeout_s:.0f} s, in {running_test(stdout) or 'an unknown test'}", result)
    if not cases:
        raise PartError(f"no GPU test ran (pytest exit {returncode})", result)
    return result


class PartError(RuntimeError):
    """A part that failed with what it had measured (``partial``), which the report keeps."""

    def __init__(self, message: str, partial: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.partial = partial


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _one_round(models, theta, prompts, overrides: dict[str, Any], server_round: int):
    """One client round under the run config ``overrides`` and its score query: (the config, the
    round's output, the query's seconds, the scores)."""
    import torch

    from fedopd.config import parse_run_config
    from fedopd.engine.round import RoundPlan, score_round, train_round
    from fedopd.models.lora import increment

    cfg = parse_run_config(overrides)
    out = train_round(models, theta, prompts, RoundPlan.from_config(cfg, server_round, seed=0))
    _sync(torch)
    t0 = time.perf_counter()
    scores = score_round(models, theta, increment(out.arrays, theta), out.cache, cfg.strategy.candidates)
    _sync(torch)
    return cfg, out, time.perf_counter() - t0, scores


def run_round(args, env: dict[str, str], work: Path, allotted_s: float) -> dict[str, Any]:
    """The round part in a process of its own, ended at ``allotted_s`` seconds (its GPU memory goes
    with it): its record, or an error naming the deadline."""
    record = work / "round.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), str(args.out), "--round-worker", str(record), "--round-seconds", str(allotted_s)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--teacher-arch", args.teacher_arch]
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--rollouts", args.rollouts), ("--peak-tflops", args.peak_tflops)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += ["--tiny"] if args.tiny else []
    returncode, stdout, stderr = run_child(cmd, env, allotted_s)
    partial = json.loads(record.read_text()) if record.is_file() else None
    if returncode is None:
        stage = partial.get("stage", "?") if partial else "building the models"
        raise PartError(f"the round ran past its {allotted_s:.0f} s share, after {stage}", partial)
    if returncode != 0 or partial is None or partial.get("stage") != "done":
        raise PartError(f"the round's process exited {returncode}: {(stderr or stdout)[-1500:]}", partial)
    return partial


def measure_round(args, tiny: bool, allotted_s: float) -> dict[str, Any]:
    """One warm-up round and one measured round at the cap that fits ``allotted_s`` (in this process)."""
    import torch

    from benchmarks.client_round import paper_models, paper_prompts
    from fedopd.config.presets import load_preset
    from fedopd.engine.round import ClientModels
    from fedopd.preflight import memory_estimate, memory_need
    from fedopd.rollout import HFRolloutEngine

    cuda = torch.cuda.is_available()
    requested = args.max_new_tokens or (16 if tiny else PAPER_CAP)
    rollouts = args.rollouts or (8 if tiny else 32)
    warmup_cap = min(requested, 4 if tiny else 32)
    overrides = dict(load_preset(ROOT / "configs" / "paper-0.6b-1x.toml"))
    overrides.update({"rollout.backend": "hf", "rollout.per-round": rollouts, "data.max-prompt-tokens": args.prompt_tokens})
    if tiny:
        overrides.update({"train.mini-batch": 4, "train.micro-batch": 2, "cache.rollouts": 2, "model.dtype": "float32"})

    t0 = time.perf_counter()
    student_arch, teacher_arch = ("tiny-student", "tiny-teacher") if tiny else ("0.6b", args.teacher_arch)
    student, teacher = paper_models(teacher_arch, student_arch=student_arch)
    models = ClientModels(student, teacher, HFRolloutEngine(student))
    _sync(torch)
    build_s = time.perf_counter() - t0
    prompts = paper_prompts(2 * rollouts, args.prompt_tokens)
    theta = student.get_lora_arrays()

    # Warm-up (kernel selection, the allocator), then the cap that fits what is left of the share.
    _, warm, warm_score_s, _ = _one_round(models, theta, prompts, {**overrides, "rollout.max-new-tokens": warmup_cap}, 1)
    m = warm.metrics
    rest_s = m["total_s"] - m["rollout_s"] + warm_score_s
    if args.round_worker is not None:  # what a round cut off later still reports
        warmup = {"cap": warmup_cap, "rollout_s": m["rollout_s"], "rest_s": rest_s, "build_s": build_s}
        args.round_worker.write_text(json.dumps({"stage": "the warm-up round", "warmup": warmup}, default=float))
    left_s = allotted_s - (time.perf_counter() - t0) - 20  # 20 s for the report and the process's end
    cap, predicted_s = choose_cap(requested, warmup_cap, args.prompt_tokens, m["rollout_s"], rest_s, left_s)
    reason = cap_reason(cap, requested, predicted_s, left_s)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free_before, total = torch.cuda.mem_get_info()
        # what the card holds for this process beyond PyTorch's cache: the CUDA context and libraries
        context = (total - free_before) - torch.cuda.memory_reserved()
    cfg, out, score_s, scores = _one_round(models, theta, prompts, {**overrides, "rollout.max-new-tokens": cap}, 2)
    m = out.metrics
    if cuda:
        peak_allocated, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        free_after, _ = torch.cuda.mem_get_info()
    length = args.prompt_tokens + m["response_length"]
    s_arch, t_arch = Arch.of(student.causal_lm.config), Arch.of(teacher.causal_lm.config)
    teacher_flops = teacher_pass_flops(t_arch, rollouts, round(length))
    opd_flops = local_opd_flops(s_arch, t_arch, rollouts, round(length), int(m["tokens"]))
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    peak = (args.peak_tflops or peak_tflops(device_name)) if cuda else None

    def mfu(flops: float, seconds: float) -> float | None:
        return flops / seconds / (peak * 1e12) if peak and seconds > 0 else None

    counted = {"student": sum(p.numel() for p in student.causal_lm.parameters()), "teacher": sum(p.numel() for p in teacher.causal_lm.parameters())}
    parts = memory_estimate(cfg, student.causal_lm.config, teacher.causal_lm.config, counted["student"], counted["teacher"], 0.0, "hf")
    plan_gib, plan_phase = memory_need(parts)
    record = {
        "student": student.name,
        "teacher": teacher.name,
        "parameters": counted,
        "dtype": str(student.dtype).removeprefix("torch."),
        "attention": student.attn_implementation,
        "settings": {
            "rollouts": rollouts,
            "prompt_tokens": args.prompt_tokens,
            "cap": cap,
            "cap_requested": requested,
            "cap_reason": reason,
            "mini_batch": cfg.train.mini_batch,
            "micro_batch": cfg.train.micro_batch,
            "teacher_batch": cfg.model.teacher_batch,
            "gradient_checkpointing": cfg.train.gradient_checkpointing,
            "loss_chunk": cfg.train.loss_chunk,
            "candidates": list(cfg.strategy.candidates),
            "backend": "hf",
        },
        "build_s": build_s,
        "warmup": {"cap": warmup_cap, "rollout_s": warm.metrics["rollout_s"], "rest_s": rest_s},
        "predicted_s": predicted_s,
        "response_length": m["response_length"],
        "cap_hit_rate": m["cap_hit_rate"],
        "response_tokens": int(m["tokens"]),
        "seconds": {k: m[k] for k in ("rollout_s", "grade_s", "teacher_s", "cache_s", "opd_s")}
        | {"score_s": score_s, "round_s": m["total_s"] + score_s},
        "tokens_per_s": {
            "rollouts": m["response_length"] * rollouts / m["rollout_s"],
            "teacher_pass": length * rollouts / m["teacher_s"],
            "local_opd": length * rollouts / m["opd_s"],
        },
        "model_tflop": {"teacher_pass": teacher_flops / 1e12, "local_opd": opd_flops / 1e12},
        "peak_tflops": peak,
        "mfu": {"teacher_pass": mfu(teacher_flops, m["teacher_s"]), "local_opd": mfu(opd_flops, m["opd_s"])},
        "scores": {"J": [float(x) for x in scores[0]], "K": [float(x) for x in scores[1]]},
        "memory_plan": {"parts_gib": parts, "peak_gib": plan_gib, "peak_phase": plan_phase},
    }
    if cuda:
        record["memory"] = {
            "peak_allocated_gib": peak_allocated / GIB,
            "peak_reserved_gib": peak_reserved / GIB,
            "context_gib": context / GIB,
            "peak_with_context_gib": (peak_reserved + context) / GIB,
            "card_total_gib": total / GIB,
            "free_after_gib": free_after / GIB,
        }
    return record


def run_loss(env: dict[str, str], positions: list[int], vocab: int, hidden: int, chunk: int, timeout_s: float) -> dict[str, Any]:
    from benchmarks.client_round import _free_bytes, unchunked_need_bytes

    rows = []
    deadline = time.perf_counter() + timeout_s
    cases = ["app", "unchunked"]
    for p in positions:
        for case in cases:
            need = unchunked_need_bytes(p, vocab) if case == "unchunked" else 0
            free = _free_bytes()
            left = deadline - time.perf_counter()
            if need > 0.8 * free or left < 5:
                why = f"needs about {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free" if need > 0.8 * free else "out of the part's time"
                rows.append({"positions": p, "case": case, "skipped": why})
                continue
            cmd = [sys.executable, str(ROOT / "benchmarks" / "client_round.py"), "--loss-case", case]
            cmd += ["--positions", str(p), "--vocab", str(vocab), "--hidden", str(hidden), "--chunk", str(chunk)]
            returncode, stdout, stderr = run_child(cmd, env, left)
            if returncode is None:
                rows.append({"positions": p, "case": case, "skipped": "out of the part's time"})
                continue
            if returncode != 0:
                lines = stderr.strip().splitlines()
                rows.append({"positions": p, "case": case, "error": lines[-1][:300] if lines else f"exit {returncode}"})
                continue
            r = json.loads(stdout.strip().splitlines()[-1])
            rows.append({"positions": p, "case": case, "peak_gib": r["peak_bytes"] / GIB, "seconds": r["seconds"], "loss_per_token": r["loss"]})
    return {"vocab": vocab, "hidden": hidden, "chunk": chunk, "rows": rows, "liger_4096_gib": LIGER_4096_GIB}


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _f(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def markdown(result: dict[str, Any]) -> str:
    """The check's figures as a Markdown page (what docs/performance.md takes)."""
    env = result["environment"]
    lines = [
        f"# GPU check: {env['device']}",
        "",
        f"{result['date']}, commit {result['commit']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
        f"peft {env['peft']}; {'--tiny (a CPU dry run: shapes scaled down, figures meaningless)' if result['tiny'] else 'paper shapes'}; "
        f"{result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget.",
    ]
    if result.get("state", "complete") != "complete":
        lines += ["", f"**Cut off while {result['state']}**: the parts below are what it had measured."]
    for part, message in result["errors"].items():
        lines += ["", f"**{part} failed:** `{message}`"]
    tests = result.get("tests")
    if tests:
        lines += [
            "",
            "## GPU tests (`-m gpu`)",
            "",
            f"{tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, {tests['skipped']} skipped in {tests['seconds']:.0f} s "
            f"(pytest exit {tests['returncode']}), from {', '.join(tests['files'])}.",
            "",
            "| test | outcome | seconds | reason |",
            "|---|---|---:|---|",
        ]
        lines += [f"| `{c['test']}` | {c['outcome']} | {c['seconds']:.2f} | {c['reason'].replace('|', '/')} |" for c in tests["cases"]]
    r = result.get("round")
    if r and "warmup" in r and "settings" not in r:  # cut off after the warm-up
        w = r["warmup"]
        lines += ["", f"Round: only the warm-up finished (cap {w['cap']}: rollouts {w['rollout_s']:.2f} s, the rest {w['rest_s']:.2f} s)."]
    elif r:
        s, sec, tps, mfu = r["settings"], r["seconds"], r["tokens_per_s"], r["mfu"]
        lines += [
            "",
            "## One client round at the paper's architecture (random weights)",
            "",
            f"{r['student']} / {r['teacher']} ({r['parameters']['student'] / 1e6:.0f} M / {r['parameters']['teacher'] / 1e6:.0f} M parameters), "
            f"{r['dtype']}, {r['attention']} attention; {s['rollouts']} rollouts of {s['prompt_tokens']}-token prompts, cap {s['cap']} "
            f"({s['cap_reason']}; mean response {r['response_length']:.0f} tokens, cap hit {100 * r['cap_hit_rate']:.0f} %), "
            f"mini-/micro-batch {s['mini_batch']}/{s['micro_batch']}, teacher batch {s['teacher_batch']}, "
            f"checkpointing {s['gradient_checkpointing']}, HF rollouts; models built in {r['build_s']:.1f} s; second round (the first warms up at cap {r['warmup']['cap']}).",
            "",
            "| step | seconds | tokens/s | model TFLOP | MFU |",
            "|---|---:|---:|---:|---:|",
            f"| rollouts (HF generate) | {sec['rollout_s']:.2f} | {tps['rollouts']:.0f} | | |",
            f"| grading | {sec['grade_s']:.2f} | | | |",
            f"| teacher pass | {sec['teacher_s']:.2f} | {tps['teacher_pass']:.0f} | {r['model_tflop']['teacher_pass']:.1f} | {_f(mfu['teacher_pass'] and 100 * mfu['teacher_pass'], '.1f', ' %')} |",
            f"| scoring cache | {sec['cache_s']:.2f} | | | |",
            f"| local OPD | {sec['opd_s']:.2f} | {tps['local_opd']:.0f} | {r['model_tflop']['local_opd']:.1f} | {_f(mfu['local_opd'] and 100 * mfu['local_opd'], '.1f', ' %')} |",
            f"| score query ({len(s['candidates'])} candidates) | {sec['score_s']:.2f} | | | |",
            f"| round | {sec['round_s']:.2f} | | | |",
            "",
            f"MFU against a dense bf16 peak of {_f(r['peak_tflops'], '.0f', ' TFLOP/s')}; tokens/s of the teacher pass and local OPD count prompt and response tokens.",
            "",
            "| memory (GiB) | measured | preflight's plan |",
            "|---|---:|---:|",
        ]
        plan = r["memory_plan"]
        mem = r.get("memory")
        lines += [
            f"| peak allocated | {_f(mem and mem['peak_allocated_gib'])} | |",
            f"| peak reserved + CUDA context | {_f(mem and mem['peak_with_context_gib'])} | {plan['peak_gib']:.2f} (peak in {plan['peak_phase']}) |",
        ]
        lines += [f"| plan: {k} | | {v:.2f} |" for k, v in plan["parts_gib"].items() if v]
    loss = result.get("loss")
    if loss:
        lines += [
            "",
            f"## The reverse-KL loss, forward and backward (H = {loss['hidden']}, V = {loss['vocab']}, chunk {loss['chunk']})",
            "",
            "| positions | case | peak GiB | seconds | loss / token |",
            "|---:|---|---:|---:|---:|",
        ]
        for row in loss["rows"]:
            if "peak_gib" in row:
                lines.append(f"| {row['positions']} | {row['case']} | {row['peak_gib']:.3f} | {row['seconds']:.3f} | {row['loss_per_token']:.6f} |")
            else:
                lines.append(f"| {row['positions']} | {row['case']} | {row.get('skipped') or row.get('error')} | | |")
        lines += [
            "",
            f"For comparison: liger-kernel's fused linear JSD, {loss['liger_4096_gib']} GiB at 4,096 positions (bf16 logits); "
            "the app's loss at 1,024 positions (chunks of 256, bf16 inputs, a 4,096-wide teacher) peaked at 1.17 GiB on this project's 2-core CPU (docs/performance.md).",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def write_report(result: dict[str, Any], out: Path) -> None:
    """``gpu_check.json`` and ``gpu_check.md`` in ``out``, each replaced whole."""
    for name, text in (("gpu_check.json", json.dumps(result, indent=2, default=float) + "\n"), ("gpu_check.md", markdown(result))):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md (created)")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run: scaled-down shapes, hides what the image lacks")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole check's seconds (default 480: 8 minutes)")
    parser.add_argument("--parts", default="tests,round,loss", help="comma-separated: tests, round, loss")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"the cap to try first (default: the paper's {PAPER_CAP})")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts per round (default: the paper's 32)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 128)")
    parser.add_argument("--teacher-arch", default="8b", choices=("8b", "1.7b"), help="the teacher's shape")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak, where the card is not listed")
    parser.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse, where .git is there)")
    parser.add_argument("--round-worker", type=Path, default=None, help=argparse.SUPPRESS)  # the round's own process: its record here
    parser.add_argument("--round-seconds", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.round_worker is not None:
        args.prompt_tokens = args.prompt_tokens or (16 if args.tiny else 128)
        record = measure_round(args, args.tiny, args.round_seconds)
        args.round_worker.write_text(json.dumps({"stage": "done", **record}, indent=2, default=float))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"tests", "round", "loss"})
    if unknown:
        parser.error(f"--parts: {', '.join(unknown)} not known; allowed: tests, round, loss")
    args.prompt_tokens = args.prompt_tokens or (16 if args.tiny else 128)
    hidden = IMAGE_LACKS if args.tiny else ()
    if hidden:
        hide_packages(hidden)
    args.out = args.out.resolve()  # pytest and the round's process run in the repository's root
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)  # a stopped check ends its children (run_child) and keeps its report

    import torch
    import transformers

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("no CUDA device: the check measures a GPU; run with --tiny for the CPU dry run", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(args.commit),
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "hidden_packages": list(hidden),
        "environment": {
            "device": torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "peft": _version("peft"),
            "python": platform.python_version(),
            "optional": {name: _version(name.replace("_", "-")) for name in ("flwr", "vllm", "flash-attn", "liger-kernel")},
        },
        "errors": {},
        "elapsed_s": 0.0,
        "state": "starting",
    }
    write_report(result, args.out)
    # The budget's shares: the tests at most a third, the loss a fifth, the round what is left.
    shares = {"tests": 0.3, "loss": 0.2}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        env = child_env(hidden, Path(work))
        if args.tiny:
            env["FEDTOPS_DEVICE"] = "cpu"
        for part in parts:
            left = args.budget_s - (time.perf_counter() - start)
            reserved = sum(args.budget_s * shares[p] for p in parts[parts.index(part) + 1 :] if p in shares)
            print(f"gpu_check: {part} ({left:.0f} s left)", flush=True)
            result["state"] = f"running {part}"
            write_report(result, args.out)  # a check cut off in this part says so
            try:
                if part == "tests":
                    result["tests"] = run_tests(env, args.out, min(args.budget_s * shares["tests"], left))
                elif part == "round":
                    result["round"] = run_round(args, env, Path(work), max(left - reserved - 15, 30))
                else:
                    positions = [64, 256] if args.tiny else [1024, 4096, 16384]
                    vocab, width = (4096, 64) if args.tiny else (151936, 1024)
                    from fedopd.config import TrainSettings

                    result["loss"] = run_loss(env, positions, vocab, width, TrainSettings().loss_chunk, min(args.budget_s * shares["loss"], left))
            except Exception as e:  # a part that fails is recorded with what it measured; the next one runs
                result["errors"][part] = f"{type(e).__name__}: {e}"[:2000]
                if getattr(e, "partial", None):
                    result[part] = e.partial
            result["elapsed_s"] = time.perf_counter() - start
            write_report(result, args.out)  # after every part: a check cut off later keeps what it measured
    result["state"] = "complete"
    write_report(result, args.out)
    print(markdown(result))
    tests = result.get("tests")
    failed = bool(result["errors"]) or (tests is not None and (tests["returncode"] != 0 or tests["failed"] or tests["error"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
