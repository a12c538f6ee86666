"""data.name = 'prompts': your own prompt set from JSONL, JSON, Parquet or CSV files, with boxed
answers, held-out problems that never are training problems, and errors that name the file and
the run-config key."""

import json
from collections import Counter

import pytest

from fedopd import data
from fedopd.config import ConfigError, DataSettings, parse_run_config
from fedopd.data.prompt_files import gold_answer, heldout_pool, load_prompt_files, train_pool

SUBJECTS = ("algebra", "geometry", "number theory")


def _rows(n=12, prefix="Q"):
    """n problems, subjects in turn, the answer as a solution that ends in \\boxed{}."""
    return [{"question": f"{prefix}{i}: what is {i} + 1?", "solution": f"{i} + 1 = \\boxed{{{i + 1}}}", "subject": SUBJECTS[i % 3]} for i in range(n)]


def _write(path, rows):
    """Write rows as the file's suffix says (pandas for Parquet and CSV)."""
    import pandas as pd

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _settings(path, **kw) -> DataSettings:
    base = {
        "name": "prompts",
        "path": str(path),
        "partitioner": "iid",
        "problem_column": "question",
        "answer_column": "solution",
        "partition_by": "subject",
    }
    return DataSettings(**{**base, **kw})


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_prompts_load_from_each_file_format(tmp_path, suffix):
    path = _write(tmp_path / f"set{suffix}", _rows(4))
    (f,) = load_prompt_files(str(path), "train", "question", "solution")
    assert f.name == str(path)
    assert [r["problem"] for r in f.rows] == ["Q0: what is 0 + 1?", "Q1: what is 1 + 1?", "Q2: what is 2 + 1?", "Q3: what is 3 + 1?"]
    assert [r["answer"] for r in f.rows] == ["1", "2", "3", "4"]  # the boxed answers of the solutions
    assert [r["subject"] for r in f.rows] == ["algebra", "geometry", "number theory", "algebra"]  # other columns kept


def test_a_folder_reads_its_files_in_name_order(tmp_path):
    _write(tmp_path / "b.csv", _rows(2, prefix="B"))
    _write(tmp_path / "a.jsonl", _rows(2, prefix="A"))
    (tmp_path / "notes.txt").write_text("not data")
    files = load_prompt_files(str(tmp_path), "train", "question", "solution")
    assert [r["problem"] for f in files for r in f.rows] == ["A0: what is 0 + 1?", "A1: what is 1 + 1?", "B0: what is 0 + 1?", "B1: what is 1 + 1?"]


def test_the_gold_answer_is_the_last_boxed_one_or_the_plain_cell():
    assert gold_answer("first \\boxed{2}, then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert gold_answer("  42 ") == "42"
    assert gold_answer(7) == "7"
    assert gold_answer("\\boxed{12") is None and gold_answer("") is None and gold_answer(None) is None


def test_a_bad_column_names_the_file_the_column_and_the_columns(tmp_path):
    path = _write(tmp_path / "set.jsonl", _rows(3))
    with pytest.raises(ValueError, match=f"data.answer-column = 'answer' is not a column of {path}; its columns: question, solution, subject"):
        load_prompt_files(str(path), "train", "question", "answer")
    with pytest.raises(ValueError, match=f"data.problem-column = 'problem' is not a column of {path}"):
        load_prompt_files(str(path), "train", "problem", "solution")


def test_an_empty_file_is_named(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=f"data.path: {path} is empty"):
        load_prompt_files(str(path), "train", "question", "solution")


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="data.path = '.*nowhere.jsonl' does not exist"):
        load_prompt_files(str(tmp_path / "nowhere.jsonl"), "train", "question", "solution")
    with pytest.raises(ValueError, match="data.eval-path = '.*gone' does not exist"):
        data.check_prompt_set(_settings(_write(tmp_path / "set.jsonl", _rows(9)), eval_path=str(tmp_path / "gone")), 3)


def test_a_row_without_an_answer_is_named_with_its_row(tmp_path):
    rows = _rows(4)
    rows[2]["solution"] = "\\boxed{3"  # unbalanced: no complete answer
    path = _write(tmp_path / "set.jsonl", rows)
    with pytest.raises(ValueError, match=f"data.answer-column = 'solution' of {path} has no answer in row 3"):
        load_prompt_files(str(path), "train", "question", "solution")


def test_an_answer_that_math_verify_cannot_parse_names_file_column_and_rows(tmp_path):
    rows = _rows(6)
    rows[1]["solution"] = "\\boxed{@@}"
    rows[4]["solution"] = "?!"
    path = _write(tmp_path / "set.jsonl", rows)
    with pytest.raises(ValueError, match=f"data.answer-column = 'solution' of {path}: math-verify cannot parse the gold answer of rows 2, 5"):
        data.check_prompt_set(_settings(path), 2)


def test_a_missing_data_path_is_named():
    with pytest.raises(ValueError, match="data.name = 'prompts' needs data.path"):
        data.check_prompt_set(_settings(""), 2)


# ---------------------------------------------------------------------------------------------
# Partitions and held-out problems
# ---------------------------------------------------------------------------------------------


def test_iid_sizes_of_a_small_pool(tmp_path):
    # 10 training rows (held-out problems from their own file); ppc 4 x 3 clients asks for 12, so all
    # 10 are partitioned: 10 = 3 x 3 + 1 -> 4, 3, 3
    train = _write(tmp_path / "train.jsonl", _rows(10))
    held = _write(tmp_path / "held.jsonl", _rows(3, prefix="H"))
    settings = _settings(train, eval_path=str(held), prompts_per_client=4)
    parts = [data.DATASETS["prompts"].train_rows(settings, pid, 3) for pid in range(3)]
    assert [len(p) for p in parts] == [4, 3, 3]
    assert sorted(r["problem"] for p in parts for r in p) == sorted(r["question"] for r in _rows(10))


def test_without_an_eval_source_one_problem_in_five_is_held_out_and_never_trained(tmp_path):
    rows = _rows(20) + [_rows(1)[0]]  # a repeated problem is kept once
    settings = _settings(_write(tmp_path / "set.jsonl", rows), prompts_per_client=100)
    train, held = train_pool(settings), heldout_pool(settings)
    assert (len(train), len(held)) == (16, 4)  # 20 distinct problems, 20 // 5 held out
    assert {r["problem"] for r in train} | {r["problem"] for r in held} == {r["question"] for r in _rows(20)}
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    partitioned = [r["problem"] for pid in range(2) for r in data.DATASETS["prompts"].train_rows(settings, pid, 2)]
    assert sorted(partitioned) == sorted(r["problem"] for r in train)


def test_the_held_out_split_moves_with_the_data_seed(tmp_path):
    path = _write(tmp_path / "set.jsonl", _rows(20))
    assert {r["problem"] for r in heldout_pool(_settings(path, seed=1))} != {r["problem"] for r in heldout_pool(_settings(path, seed=2))}


def test_held_out_problems_follow_each_client_s_subject(tmp_path):
    train = _write(tmp_path / "train.parquet", _rows(9))
    held = _write(tmp_path / "held.csv", _rows(12, prefix="H"))  # 4 problems of each subject
    settings = _settings(train, eval_path=str(held), partitioner="natural", prompts_per_client=3)
    for pid, subject in enumerate(sorted(SUBJECTS)):  # natural: client i holds the i-th subject
        assert {r["subject"] for r in data.DATASETS["prompts"].train_rows(settings, pid, 3)} == {subject}
        got = data.DATASETS["prompts"].heldout_rows(settings, pid, 3, 2)
        assert Counter(r["subject"] for r in got) == {subject: 2}


def test_held_out_problems_mix_like_the_client_s_training_prompts(tmp_path):
    # dirichlet client mixes; each client's 6 held-out problems by largest remainder over its own mix
    train = _write(tmp_path / "train.jsonl", _rows(30))
    held = _write(tmp_path / "held.jsonl", _rows(60, prefix="H"))
    settings = _settings(train, eval_path=str(held), partitioner="dirichlet", dirichlet_alpha=1.0, prompts_per_client=10)
    everyone_trains = {r["problem"] for pid in range(3) for r in data.DATASETS["prompts"].train_rows(settings, pid, 3)}
    held_all = []
    for pid in range(3):
        mix = Counter(r["subject"] for r in data.DATASETS["prompts"].train_rows(settings, pid, 3))
        keys = sorted(mix)
        exact = [6 * mix[k] / sum(mix.values()) for k in keys]
        counts = [int(e) for e in exact]
        for i in sorted(range(len(keys)), key=lambda i: (counts[i] - exact[i], i))[: 6 - sum(counts)]:
            counts[i] += 1
        got = data.DATASETS["prompts"].heldout_rows(settings, pid, 3, 6)
        assert Counter(r["subject"] for r in got) == Counter({k: n for k, n in zip(keys, counts) if n})
        held_all += [r["problem"] for r in got]
    assert len(held_all) == len(set(held_all)) and not everyone_trains & set(held_all)


def test_an_eval_problem_that_is_also_a_training_problem_is_dropped(tmp_path):
    train = _write(tmp_path / "train.jsonl", _rows(6))
    held = _write(tmp_path / "held.jsonl", _rows(2) + _rows(3, prefix="H"))  # Q0, Q1 are training problems
    assert [r["problem"] for r in sorted(heldout_pool(_settings(train, eval_path=str(held))), key=lambda r: r["problem"])] == [
        "H0: what is 0 + 1?",
        "H1: what is 1 + 1?",
        "H2: what is 2 + 1?",
    ]


def test_without_the_partition_by_column_held_out_problems_are_one_mix(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "subject"} for r in _rows(20)]
    settings = _settings(_write(tmp_path / "set.jsonl", rows), prompts_per_client=8)
    held = [data.DATASETS["prompts"].heldout_rows(settings, pid, 2, 2) for pid in range(2)]
    assert [len(h) for h in held] == [2, 2] and len({r["problem"] for h in held for r in h}) == 4  # 20 // 5 = 4 in all


def test_the_config_refuses_groups_for_prompts_and_accepts_held_out_evaluation():
    with pytest.raises(
        ConfigError, match="'data.partitioner' = 'groups' is not defined for 'data.name' = 'prompts'; allowed: 'iid', 'dirichlet', 'natural'"
    ):
        parse_run_config({"data.name": "prompts", "data.path": "x.jsonl", "data.partitioner": "groups"})
    assert parse_run_config({"data.name": "prompts", "data.path": "x.jsonl"}).data.partitioner == "iid"  # the default follows the set
    cfg = parse_run_config({"data.name": "prompts", "data.path": "x.jsonl", "data.partitioner": "iid", "eval.every": 4})
    assert cfg.data.partitioner == "iid"


def test_the_server_stops_before_round_one_on_a_bad_column_and_writes_nothing(tmp_path):
    from server_app.inprocess import run_in_process

    path = _write(tmp_path / "mine.jsonl", _rows())
    config = {
        "data.name": "prompts",
        "data.path": str(path),
        "data.partitioner": "iid",
        "data.problem-column": "problem",
        "data.answer-column": "solution",
        "output-dir": str(tmp_path / "runs"),
    }
    with pytest.raises(ConfigError, match=r"data.problem-column.*mine.jsonl|mine.jsonl.*data.problem-column"):
        run_in_process(config)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_run_on_your_own_prompts_with_dirichlet_clients_and_sampling(tmp_path):
    """Sandbox problems written as a JSONL file with boxed solutions, 4 Dirichlet clients over
    their skill group, half of them sampled per round, evaluated on a seeded held-out split."""
    from fedopd.sandbox import task
    from server_app.inprocess import run_in_process
    from server_app.run_folder import read_rounds

    rows = [{"question": r["problem"], "solution": r["solution"], "skill": r["group"]} for g in task.GROUPS for r in task.problems(g, 40, seed=7)]
    path = _write(tmp_path / "mine.jsonl", rows)
    config = {
        "data.name": "prompts",
        "data.path": str(path),
        "data.partitioner": "dirichlet",
        "data.partition-by": "skill",
        "data.dirichlet-alpha": 0.5,
        "data.problem-column": "question",
        "data.answer-column": "solution",
        "data.prompts-per-client": 16,
        "strategy.fraction-train": 0.5,
        "strategy.name": "fedtops",
        "num-server-rounds": 2,
        "rollout.per-round": 4,
        "rollout.max-new-tokens": 32,
        "cache.rollouts": 2,
        "eval.every": 2,
        "eval.prompts-per-client": 4,
        "eval.samples": 2,
        "eval.max-new-tokens": 32,
        "output-dir": str(tmp_path / "runs"),
    }
    run = run_in_process(config, num_clients=4)
    rounds = read_rounds(run)
    for r in rounds[1:]:
        assert len(r["sampled-node-ids"]) == 2 and r["trained-node-ids"] == r["sampled-node-ids"]
        assert sorted(r["scored-node-ids"]) == r["trained-node-ids"]
        sizes = [c["num-examples"] for c in r["clients"]]
        assert sum(sizes) < 64  # two of the four clients
    partition_sizes = [len(p) for p in data.partitions(parse_run_config(config).data, 4)]
    assert sum(partition_sizes) == 64 and len(set(partition_sizes)) > 1
    trained = {c["partition-id"]: c["num-examples"] for r in rounds[1:] for c in r["clients"]}
    assert all(n == partition_sizes[pid] for pid, n in trained.items())  # num-examples: the client's partition size
    final = rounds[-1]["evaluation"]
    assert sorted(c["partition-id"] for c in final["clients"]) == [0, 1, 2, 3]  # every client evaluates
