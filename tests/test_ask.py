"""eval.ask: which adapter a path names, and that its answer is plain PEFT's greedy answer to the
question rendered in the training format."""

import json
import shutil

import pytest

from eval.ask import find_adapter


def _adapter(folder, base="builtin:sandbox-student"):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    return folder


def _run(tmp_path, rounds=(0, 1, 2), local=False):
    run = tmp_path / "20260101-000000-fedtops"
    run.mkdir()
    config = {"model.student": "Org/Student", "model.teacher": "Org/Teacher", "rollout.stop-tokens": "auto", "eval.max-new-tokens": 64,
              "resolved": {"rollout.stop-tokens": {"ids": [2, 7], "tokens": ["<|im_end|>", "<|endoftext|>"]}}}  # fmt: skip
    (run / "config.json").write_text(json.dumps(config))
    for n in rounds:
        for sub in ("client-0", "client-1") if local else ("",):
            _adapter(run / f"round-{n:03d}" / sub, base="/elsewhere/student")
    return run


def test_a_run_folder_gives_its_last_rounds_adapter_and_the_runs_model_stop_set_and_cap(tmp_path):
    run = _run(tmp_path)
    source = find_adapter(run)
    assert source.adapter == run / "round-002"
    assert (source.model, source.teacher, source.stop_tokens, source.max_new_tokens) == ("Org/Student", "Org/Teacher", "auto", 64)
    assert source.resolved_stop == {"ids": [2, 7], "tokens": ["<|im_end|>", "<|endoftext|>"]}  # what the run used: no teacher file is read
    assert find_adapter(run, model="Other/Model").resolved_stop is None  # another model: its own stop set
    assert find_adapter(run, round=1).adapter == run / "round-001"
    assert find_adapter(run, model="Other/Model").model == "Other/Model"


def test_a_local_run_needs_a_client_and_a_missing_round_names_the_rounds_there(tmp_path):
    run = _run(tmp_path, local=True)
    with pytest.raises(ValueError, match=r"one adapter per client \(a Local run\): choose one with --client \(client-0, client-1\)"):
        find_adapter(run)
    assert find_adapter(run, client=1).adapter == run / "round-002" / "client-1"
    with pytest.raises(ValueError, match="has no round 7; it has rounds 0, 1, 2"):
        find_adapter(run, round=7)


def test_an_adapter_folder_gives_the_base_model_it_names(tmp_path):
    folder = _adapter(tmp_path / "a", base="Qwen/Qwen3-0.6B-Base")
    source = find_adapter(folder)
    assert (source.adapter, source.model, source.teacher, source.run) == (folder, "Qwen/Qwen3-0.6B-Base", None, None)
    with pytest.raises(ValueError, match="--round and --client choose inside a run folder"):
        find_adapter(folder, round=1)
    with pytest.raises(ValueError, match="neither a run folder"):
        find_adapter(tmp_path)


@pytest.mark.slow
def test_the_answer_is_plain_pefts_greedy_answer_to_the_training_prompt(tmp_path):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.ask import Answerer
    from fedopd.data import render_prompt
    from fedopd.models.paths import resolve_model_path

    path = resolve_model_path("builtin:sandbox-student")
    tok = AutoTokenizer.from_pretrained(path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # an adapter that changes the answers
    model.save_pretrained(tmp_path / "adapter")
    question = "Compute 98 + 776."

    # plain PEFT and transformers: the saved adapter on its base, greedy, ending at the EOS token
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path / "adapter").eval()
    ids = tok(render_prompt(tok, question), add_special_tokens=False, return_tensors="pt")["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = plain.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[eos], pad_token_id=eos)
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    ask = Answerer.load(tmp_path / "adapter", dtype="float32")
    assert list(ask.stop.tokens) == ["<|im_end|>"]
    assert ask(question, max_new_tokens=40) == expected
    run = tmp_path / "run"  # a run folder: its resolved stop set is used, its teacher's files are never read
    shutil.copytree(tmp_path / "adapter", run / "round-001")
    config = {"model.student": "builtin:sandbox-student", "model.teacher": "nobody/no-such-teacher", "rollout.stop-tokens": "auto",
              "eval.max-new-tokens": 40, "resolved": {"rollout.stop-tokens": {"ids": [eos], "tokens": ["<|im_end|>"]}}}  # fmt: skip
    (run / "config.json").write_text(json.dumps(config))
    from_run = Answerer.load(run, dtype="float32")
    assert from_run.stop.ids == (eos,) and from_run(question) == expected
    base_answer = Answerer.load(tmp_path / "adapter", dtype="float32")
    base_answer.engine.set_adapter({n: 0 * a for n, a in base_answer.student.get_lora_arrays().items()})
    assert base_answer(question, max_new_tokens=40) != expected  # the adapter is in the answer
