"""tiny-arith, prompt rendering and the per-round loader."""

import numpy as np
import pytest

from fedopd.data import (
    INSTRUCTION,
    TINY_ARITH_GROUPS,
    encode_prompts,
    render_prompt,
    round_indices,
    tiny_arith_group,
    tiny_arith_partition,
)
from fedopd.models import load_causal_lm


def _answer(problem: str) -> int:
    nums = [int(t.strip("?.")) for t in problem.split() if t.strip("?.").isdigit()]
    if "+" in problem or "sum" in problem:
        return nums[0] + nums[1]
    if "-" in problem or "difference" in problem:
        return nums[0] - nums[1]
    return nums[0] * nums[1]


def test_tiny_arith_has_three_groups_with_correct_integer_answers():
    for group in TINY_ARITH_GROUPS:
        rows = tiny_arith_group(group, 50, seed=42)
        assert len({r["problem"] for r in rows}) == 50
        for r in rows:
            assert r["group"] == group and int(r["answer"]) == _answer(r["problem"])


def test_tiny_arith_is_deterministic_in_the_seed():
    assert tiny_arith_group("addition", 20, 42) == tiny_arith_group("addition", 20, 42)
    assert tiny_arith_group("addition", 20, 42) != tiny_arith_group("addition", 20, 43)


def test_client_partitions_are_one_skill_group_each_and_disjoint():
    parts = [tiny_arith_partition(i, 3, 64, 42) for i in range(3)]
    assert [{r["group"] for r in p} for p in parts] == [{"addition"}, {"subtraction"}, {"multiplication"}]
    six = [tiny_arith_partition(i, 6, 30, 42) for i in range(6)]
    problems = [r["problem"] for p in six for r in p]
    assert len(problems) == len(set(problems)) == 180
    with pytest.raises(ValueError, match="partition-id 3 is not in"):
        tiny_arith_partition(3, 3, 64, 42)


def test_prompts_render_the_instruction_with_the_chat_template():
    tok = load_causal_lm("builtin:tiny-student").tokenizer
    text = render_prompt(tok, "What is 2 + 3?")
    assert text == ("<|im_start|>user\nWhat is 2 + 3?\n" + INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_long_prompts_are_filtered_and_an_empty_set_is_refused():
    tok = load_causal_lm("builtin:tiny-student").tokenizer
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "x" * 500, "answer": "0"}]
    prompts = encode_prompts(tok, rows, max_prompt_tokens=200)
    assert [p.problem for p in prompts] == ["What is 1 + 1?"]
    with pytest.raises(ValueError, match="client 0: the prompt set is empty"):
        encode_prompts(tok, [], 200, source="client 0")
    with pytest.raises(ValueError, match="longer than data.max-prompt-tokens = 10"):
        encode_prompts(tok, rows, max_prompt_tokens=10)


def test_round_loader_draws_each_prompt_once_per_epoch_and_reshuffles():
    rounds = [round_indices(10, r, 4, seed=1) for r in range(1, 6)]  # 20 draws = 2 epochs
    stream = np.concatenate(rounds)
    assert sorted(stream[:10].tolist()) == list(range(10))
    assert sorted(stream[10:].tolist()) == list(range(10))
    assert stream[:10].tolist() != stream[10:].tolist()
    assert np.array_equal(round_indices(10, 3, 4, seed=1), rounds[2])
    assert not np.array_equal(round_indices(10, 1, 4, seed=2), rounds[0])


@pytest.mark.parametrize("num_prompts, per_round", [(10, 4), (7, 3), (10, 7), (64, 32), (570, 32)])
def test_a_round_that_straddles_an_epoch_boundary_never_holds_a_prompt_twice(num_prompts, per_round):
    stream = []
    for r in range(1, 40):
        batch = round_indices(num_prompts, r, per_round, seed=3).tolist()
        assert len(batch) == per_round and len(set(batch)) == per_round, f"round {r}: {batch}"
        stream += batch
    for e in range(len(stream) // num_prompts):  # and every epoch still visits each prompt once
        assert sorted(stream[e * num_prompts : (e + 1) * num_prompts]) == list(range(num_prompts))
