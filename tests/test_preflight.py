"""python -m fedopd.preflight: a host checked in seconds, one clear line per problem."""

import subprocess
import sys
from pathlib import Path

import pytest
from model_fixtures import QWEN3_0_6B, QWEN3_8B, architecture_only

from fedopd.preflight import FAIL, OK, run_checks

REPO = Path(__file__).resolve().parent.parent


def _pair(model_copies, teacher="instruct-teacher", **more):
    return {"model.student": model_copies["base-student"], "model.teacher": model_copies[teacher], **more}


def _failures(report):
    return [r for r in report.rows if r.status == FAIL]


def test_a_base_student_with_an_instruct_teacher_passes(model_copies):
    report = run_checks(_pair(model_copies))
    assert not report.failed, report.table()
    rows = {r.check: r for r in report.rows}
    assert rows["stop tokens"].detail.startswith("['<|endoftext|>', '<|im_end|>'] = ids [0, 2]")
    assert rows["chat template"].status == OK and "'<|im_end|>', in the stop set" in rows["chat template"].detail
    assert rows["prompts"].detail.startswith("client 0: 256/256, client 1: 256/256, client 2: 256/256")


def test_a_mismatched_vocabulary_fails_with_one_line(model_copies):
    [row] = _failures(run_checks(_pair(model_copies, teacher="other-vocab-teacher")))
    assert row.check == "model pair" and "must share a vocabulary" in row.detail and "'7': 27 vs 28" in row.detail


def test_a_missing_model_folder_fails_with_one_line(model_copies, tmp_path):
    [row] = _failures(run_checks({**_pair(model_copies), "model.teacher": str(tmp_path / "no-such-model")}))
    assert row.check == "teacher model" and "is not an existing local folder" in row.detail


def test_a_prompt_set_that_the_length_filter_empties_fails_with_one_line(model_copies):
    [row] = _failures(run_checks(_pair(model_copies, **{"data.max-prompt-tokens": 10})))
    assert row.check == "prompts" and "no prompt of client 0 fits data.max-prompt-tokens = 10" in row.detail


@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_prompts_and_responses_past_the_models_positions_fail_whatever_the_engine(model_copies, backend):
    [row] = _failures(run_checks(_pair(model_copies, **{"data.max-prompt-tokens": 2048, "rollout.backend": backend})))
    assert row.check == "positions" and row.detail.startswith("data.max-prompt-tokens (2048) + rollout.max-new-tokens (128) = 2176 positions")
    assert "lower data.max-prompt-tokens to at most 384" in row.detail
    rows = {r.check: r for r in run_checks(_pair(model_copies, **{"rollout.backend": backend})).rows}
    assert rows["positions"].detail == "prompt + response need 512 positions; the models have student 512, teacher 512"


def test_an_end_of_turn_token_outside_the_stop_set_fails_naming_the_setting(model_copies):
    [row] = _failures(run_checks(_pair(model_copies, **{"rollout.stop-tokens": "<|endoftext|>"})))
    assert row.check == "chat template" and "rollout.stop-tokens = '<|endoftext|>,<|im_end|>'" in row.detail


def test_the_paper_pair_with_hf_rollouts_needs_more_than_a_24_gib_card_and_fits_a_40_gib_one(tmp_path):
    """The paper preset (Qwen3-0.6B-Base student, Qwen3-8B teacher, bf16, HF engine here) planned
    from the published architectures. By hand, what stays for the round: teacher 36 layers x
    (2·4096·32·128 + 2·4096·8·128 + 3·4096·12288) + 2·151936·4096 = 8,190,735,360 parameters x 2
    bytes = 15.26 GiB; student 28 x (2·1024·16·128 + 2·1024·8·128 + 3·1024·3072) + 151936·1024
    = 596,049,920 x 2 bytes plus LoRA 8·(1024+3072)·7·28 = 6,422,528 fp32 x 4 (weights, gradients,
    AdamW moments) = 1.21 GiB; the teacher's hidden states kept for the round, 32 rollouts x 4,096
    tokens x 4,096 x 2 bytes = 1.00 GiB; context 0.75 → 18.21 GiB (15.257 + 1.206 + 1.000 + 0.750). The phases: HF generation's
    KV cache, 32 rollouts x (2,048 + 4,096) positions x 28 layers x 2 (keys, values) x 8 KV heads x
    128 x 2 bytes = 22,548,578,304 bytes = 21.00 GiB; teacher pass
    2·6144 x 4096 x 34 = 1.59 GiB; scoring pass, 4 cached rollouts x 6 candidates x 6,144 tokens
    x (4·1024 + 3·3072) x 2 bytes + 2 x 4·16 positions x 6 x 151,936 x 4 bytes = 4.09 GiB; local
    OPD, loss chunk 7 x 256 x 151,936 x 4 bytes + 2 x 64 MiB head blocks = 1.14 GiB and student
    activations, checkpointed, 4·6144 tokens x 1024 x (28·2 + 34) bytes = 2.11 GiB, 3.25 GiB. The
    peak is in HF generation: 18.21 + 21.00 = 39.21 GiB."""
    student = architecture_only("sandbox-student", tmp_path / "student", QWEN3_0_6B)
    teacher = architecture_only("sandbox-teacher", tmp_path / "teacher", QWEN3_8B)
    from fedopd.config.presets import load_preset

    overrides = {
        **load_preset(REPO / "configs" / "paper-0.6b-1x.toml"),
        "model.student": str(student),
        "model.teacher": str(teacher),
        "data.name": "sandbox",
        "data.prompts-per-client": 32,
        "rollout.backend": "hf",
        "eval.every": 0,
    }
    [row] = _failures(run_checks(overrides, gpu_free_gib=24.0))
    assert row.check == "GPU memory" and "; peak in HF generation = 39.2 GiB of 24.0 GiB free: too little GPU memory" in row.detail
    assert (
        "teacher weights 15.26, student weights + LoRA + AdamW 1.21, kept teacher hidden states 1.00, CUDA context 0.75, "
        "HF KV cache 21.00, teacher pass 1.59, scoring pass 4.09, loss chunk 1.14, student activations 2.11" in row.detail
    )
    memory = {r.check: r for r in run_checks(overrides, gpu_free_gib=40.0).rows}["GPU memory"]
    assert memory.status == OK and memory.detail.endswith("; peak in HF generation = 39.2 GiB of 40.0 GiB free")
    # FedAvg scores nothing (no scoring pass); the cap sets the KV cache: 1,024 tokens give
    # 32 x 3,072 x 28 x 2 x 8 x 128 x 2 bytes = 10.50 GiB, and with the kept hidden states of 32 x
    # 1,024 x 4,096 x 2 bytes = 0.25 GiB the peak 15.257 + 1.206 + 0.25 + 0.75 + 10.50 = 27.96 GiB
    fedavg = {r.check: r for r in run_checks({**overrides, "strategy.name": "fedavg", "rollout.max-new-tokens": 1024}, gpu_free_gib=40.0).rows}
    assert fedavg["GPU memory"].detail.endswith("; peak in HF generation = 28.0 GiB of 40.0 GiB free")
    assert "HF KV cache 10.50" in fedavg["GPU memory"].detail and "scoring pass" not in fedavg["GPU memory"].detail


def test_the_command_exits_non_zero_on_a_problem_and_zero_when_all_pass(model_copies):
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedopd.preflight",
            "--run-config",
            f"model.student='{model_copies['base-student']}' model.teacher='{model_copies['instruct-teacher']}'",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("preflight: passed"), ok.stdout + ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "fedopd.preflight", "--run-config", "data.max-prompt-tokens=10"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1 and "FAILED" in bad.stdout


def test_packed_micro_batches_are_refused_where_the_versions_would_leak(model_copies, monkeypatch):
    """transformers < 5 with torch < 2.6 lets packed SDPA rows attend across sequences."""
    monkeypatch.setattr("transformers.__version__", "4.57.6")
    monkeypatch.setattr("torch.__version__", "2.5.1")
    [row] = _failures(run_checks(_pair(model_copies, **{"train.packing": "packed"})))
    assert row.check == "packing" and "transformers 4.57.6, torch 2.5.1 does not isolate packed rows" in row.detail


def test_a_qwen25_instruct_student_with_a_qwen3_teacher_fails_on_the_template_pair_row(model_copies):
    """Qwen3's non-thinking generation prompt ends with an empty think block that Qwen2.5's has not
    (the real templates, tests/chat_templates/): the one failing row is the template pair's."""
    overrides = {"model.student": model_copies["qwen2.5-instruct-student"], "model.teacher": model_copies["qwen3-teacher"]}
    [row] = _failures(run_checks(overrides))
    assert row.check == "template pair" and "<think>" in row.detail


def test_the_sandbox_pair_renders_the_same_ids_on_the_template_pair_row():
    rows = {r.check: r for r in run_checks({}).rows}
    assert rows["template pair"].status == OK and "render the training prompt to the same ids" in rows["template pair"].detail


def test_an_unreachable_hub_model_lists_every_check_it_skipped_and_what_each_needs(model_copies, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    report = run_checks({**_pair(model_copies), "model.teacher": "nobody-here/no-such-model-xyz", "rollout.backend": "hf"})
    rows = {r.check: r for r in report.rows}
    assert rows["teacher model"].status == FAIL and "hf download nobody-here/no-such-model-xyz" in rows["teacher model"].detail
    skipped = [r.check for r in report.rows if r.status == "skip"]
    assert skipped == ["model pair", "stop tokens", "chat template", "template pair", "prompts", "positions", "GPU memory"]
    assert all(rows[c].detail.startswith("not checked: needs ") for c in skipped)
    assert {"torch", "engines", "packing"} <= set(rows)  # what needs only this host still ran


def test_the_download_advice_is_a_command_of_the_installed_hub_client():
    hf = Path(sys.executable).parent / "hf"
    assert hf.is_file(), "huggingface_hub's `hf` command is not installed beside this interpreter"
    out = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "repo_id" in out.stdout.lower().replace("-", "_"), out.stdout + out.stderr
