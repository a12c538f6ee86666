"""data.partitioner: Flower Datasets' iid, dirichlet and natural partitions of the built-in sets,
held-out problems that follow each client's mix, the unchanged 'groups' partitions, and
``python -m fedopd.data describe``."""

import json
import math
from collections import Counter

import pytest

from fedopd import data
from fedopd.config import PARTITIONERS, ConfigError, DataSettings, parse_run_config
from fedopd.data import pools
from fedopd.data.__main__ import main as describe_main
from fedopd.data.partition import heldout_allocation, partition_indices, partition_pool, sample_pool, take_heldout
from fedopd.sandbox import task


def _sandbox(**kw) -> DataSettings:
    return DataSettings(name="sandbox", **kw)


def _problems(rows):
    return [r["problem"] for r in rows]


def _fresh_partitions(settings, num):
    """The partitions computed anew (not the per-process cache)."""
    data.partitions.cache_clear()
    data.heldout_partitions.cache_clear()
    return [list(p) for p in data.partitions(settings, num)]


def _largest_remainder(weights, total):
    """The definition: floors of the exact shares, then +1 by largest remainder (ties: first)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# iid
# ---------------------------------------------------------------------------------------------


def test_iid_cuts_contiguous_shards_the_first_n_mod_k_one_larger():
    # 10 rows over 3: 10 = 3 x 3 + 1, so shard 0 holds 4 and shards 1, 2 hold 3 (Dataset.shard, contiguous)
    parts = partition_indices(10, None, 3, "iid", partition_by="group", alpha=0.5, seed=0, source="t")
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    # 11 over 4: 11 = 4 x 2 + 3 -> 3, 3, 3, 2
    parts = partition_indices(11, None, 4, "iid", partition_by="group", alpha=0.5, seed=0, source="t")
    assert [len(p) for p in parts] == [3, 3, 3, 2]


def test_iid_sandbox_partitions_are_disjoint_and_cover_a_sample_of_the_pool():
    # ppc 5 x 2 clients: ceil(10 / 3) = 4 problems per group (a pool of 12), of which 10 are partitioned
    settings = _sandbox(partitioner="iid", prompts_per_client=5, seed=3)
    parts = _fresh_partitions(settings, 2)
    assert [len(p) for p in parts] == [5, 5]
    drawn = _problems(parts[0] + parts[1])
    pool = {r["problem"] for g in task.GROUPS for r in task.problems(g, 4, 3)}
    assert len(set(drawn)) == 10 and set(drawn) <= pool


def test_the_pool_is_shuffled_before_the_iid_shards_are_cut():
    # the pool lists the groups one after the other; unshuffled, client 0 would hold addition only
    parts = _fresh_partitions(_sandbox(partitioner="iid", prompts_per_client=30, seed=0), 3)
    assert all(len({r["group"] for r in p}) == 3 for p in parts)


def test_too_few_prompts_for_the_partitions_is_refused():
    with pytest.raises(ValueError, match="has 2 prompts, fewer than num-partitions = 3"):
        partition_indices(2, None, 3, "iid", partition_by="group", alpha=0.5, seed=0, source="t")


# ---------------------------------------------------------------------------------------------
# seeds, dirichlet, natural
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_the_same_data_seed_gives_the_same_partition_and_another_seed_another(partitioner):
    rows = [{"problem": f"p{i}", "group": "abc"[i % 3]} for i in range(30)]  # a fixed pool: only the seed moves

    def split(seed):
        settings = DataSettings(partitioner=partitioner, seed=seed)
        return [_problems(p) for p in partition_pool(sample_pool(rows, 30, seed), 3, settings, "a test pool")]

    assert split(7) == split(7)
    assert split(7) != split(8)


def test_dirichlet_at_small_alpha_gives_unequal_sizes_and_no_empty_client():
    parts = _fresh_partitions(_sandbox(partitioner="dirichlet", dirichlet_alpha=0.1, prompts_per_client=30, seed=5), 4)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 120  # the sampled pool: 30 x 4
    assert min(sizes) >= 1 and len(set(sizes)) > 1
    problems = [r["problem"] for p in parts for r in p]
    assert len(set(problems)) == 120  # disjoint


def test_dirichlet_that_cannot_fill_every_client_names_alpha_and_num_partitions():
    # 18 prompts of 3 groups at alpha 0.01: each group goes (almost) whole to one client, so 3 of 6 stay empty
    settings = _sandbox(partitioner="dirichlet", dirichlet_alpha=0.01, prompts_per_client=3, seed=0)
    with pytest.raises(ValueError, match="data.dirichlet-alpha = 0.01 .* num-partitions = 6"):
        _fresh_partitions(settings, 6)


def test_natural_gives_one_partition_per_value_in_sorted_order():
    # ppc 6 x 3 clients: 6 problems per group, all 18 partitioned; partition i = sorted groups[i]
    parts = _fresh_partitions(_sandbox(partitioner="natural", prompts_per_client=6, seed=2), 3)
    for part, group in zip(parts, sorted(task.GROUPS)):
        assert sorted(_problems(part)) == sorted(_problems(task.problems(group, 6, 2)))


def test_natural_refuses_a_num_partitions_other_than_the_number_of_values():
    with pytest.raises(
        ValueError,
        match=r"'natural' gives one partition per value of data.partition-by = 'group'.*"
        r"has 3 \(addition, expression, multiplication\), but num-partitions is 4",
    ):
        _fresh_partitions(_sandbox(partitioner="natural", prompts_per_client=6), 4)


def test_a_partition_by_column_that_rows_lack_is_named():
    with pytest.raises(ValueError, match="data.partition-by = 'subject' is not a column of the sandbox training pool"):
        _fresh_partitions(_sandbox(partitioner="dirichlet", partition_by="subject", prompts_per_client=4), 3)


def test_a_sandbox_group_short_of_its_share_names_the_keys_and_the_capacity():
    capacity = sum(not task.is_heldout(f"Compute {c} * {b}.") for c in range(2, 10) for b in range(10, 100))
    # ppc 200 x 9 clients: ceil(1800 / 3) = 600 multiplication problems, more than there are
    with pytest.raises(
        ValueError,
        match=rf"= 600 .* group 'multiplication' holds only {capacity}; lower "
        rf"data.prompts-per-client \(at most {3 * capacity // 9} for num-partitions = 9\)",
    ):
        _fresh_partitions(_sandbox(partitioner="iid", prompts_per_client=200), 9)


def test_partitions_are_computed_once_per_process(monkeypatch):
    calls = []
    pool = pools._pool
    monkeypatch.setattr(pools, "_pool", lambda *a: calls.append(a) or pool(*a))
    data.partitions.cache_clear()
    settings = _sandbox(partitioner="iid", prompts_per_client=4)
    for pid in range(3):
        data.DATASETS["sandbox"].train_rows(settings, pid, 3)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# groups: today's partitions
# ---------------------------------------------------------------------------------------------


def test_groups_gives_exactly_the_set_s_own_partitions(tmp_path):
    from fedopd.data import load_math_rows, partition_math, tiny_arith_partition

    settings = _sandbox(prompts_per_client=12, seed=5, partitioner="groups")  # the loaders themselves take a resolved partitioner
    assert data.partition_rows(_sandbox(prompts_per_client=12, seed=5), 0, 5) == task.client_partition(0, 5, 12, 5)  # 'auto' is groups here
    for pid in range(5):
        assert data.DATASETS["sandbox"].train_rows(settings, pid, 5) == task.client_partition(pid, 5, 12, 5)
        assert data.DATASETS["sandbox"].heldout_rows(settings, pid, 5, 4) == task.client_heldout(pid, 5, 4)
        tiny = DataSettings(name="tiny-arith", prompts_per_client=12, seed=5)
        assert data.DATASETS["tiny-arith"].train_rows(tiny, pid, 5) == tiny_arith_partition(pid, 5, 12, 5)
    rows = [
        {"problem": f"{s} #{k}", "level": "Level 1", "type": s, "solution": f"\\boxed{{{k}}}"}
        for s in ("Prealgebra", "Algebra", "Number Theory", "Counting & Probability", "Intermediate Algebra", "Precalculus")
        for k in range(8)
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    math_settings = DataSettings(name="math", prompts_per_client=5, path=str(path), seed=1, partitioner="groups")
    expected = partition_math(load_math_rows(str(path)), 5, 1)
    assert [data.DATASETS["math"].train_rows(math_settings, pid, 3) for pid in range(3)] == expected


def test_math_partitions_by_subject_beyond_groups(tmp_path):
    # 4 subjects x 3 problems, plus one without a boxed answer and one repeat: 12 clean rows
    rows = [
        {"problem": f"{s} #{k}", "level": "Level 1", "type": s, "solution": f"\\boxed{{{k}}}"}
        for s in ("Algebra", "Geometry", "Number Theory", "Prealgebra")
        for k in range(3)
    ]
    rows += [
        {"problem": "no answer", "level": "Level 1", "type": "Algebra", "solution": "4"},
        {"problem": "Algebra  #0", "level": "Level 1", "type": "Algebra", "solution": "\\boxed{9}"},
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parts = _fresh_partitions(DataSettings(name="math", path=str(path), partitioner="natural", prompts_per_client=3), 4)
    assert [{r["group"] for r in p} for p in parts] == [{"Algebra"}, {"Geometry"}, {"Number Theory"}, {"Prealgebra"}]
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert "no answer" not in _problems(parts[0]) and "9" not in [r["answer"] for r in parts[0]]


# ---------------------------------------------------------------------------------------------
# held-out problems
# ---------------------------------------------------------------------------------------------


def test_heldout_allocation_follows_each_client_s_mix_by_largest_remainder():
    mixes = [{"a": 3, "b": 1}, {"b": 2}, {"x": 5}]
    # client 0: 6 x 3/4 = 4.5, 6 x 1/4 = 1.5 -> 4 + 1, the tie goes to 'a' -> a 5, b 1
    # client 1: all 6 from b
    # client 2: 'x' has no held-out problem -> the pool's proportions 10:10:2 -> 2.73, 2.73, 0.55 -> 3, 3, 0
    assert heldout_allocation(mixes, 6, {"a": 10, "b": 10, "c": 2}) == [{"a": 5, "b": 1}, {"b": 6}, {"a": 3, "b": 3, "c": 0}]


def test_heldout_slices_are_disjoint_between_clients_while_the_pool_allows():
    pools = {"a": [f"a{i}" for i in range(10)], "b": [f"b{i}" for i in range(4)]}
    got = take_heldout([{"a": 5, "b": 1}, {"b": 3}, {"a": 3, "b": 3}], pools)
    # a: 0-4, then 5-7; b: 0, 1-3, then the pool is spent and wraps around: 0, 1, 2
    assert got == [["a0", "a1", "a2", "a3", "a4", "b0"], ["b1", "b2", "b3"], ["a5", "a6", "a7", "b0", "b1", "b2"]]


def test_sandbox_heldout_follows_the_client_s_group_mix_and_is_never_a_training_problem():
    settings = _sandbox(partitioner="dirichlet", dirichlet_alpha=0.5, prompts_per_client=20, seed=4)
    parts = _fresh_partitions(settings, 3)
    held = [data.DATASETS["sandbox"].heldout_rows(settings, pid, 3, 10) for pid in range(3)]
    for part, rows in zip(parts, held):
        mix = Counter(r["group"] for r in part)
        groups = sorted(mix)
        assert Counter(r["group"] for r in rows) == Counter(dict(zip(groups, _largest_remainder([mix[g] for g in groups], 10))))
    training = {r["problem"] for p in parts for r in p}
    heldout = [r["problem"] for rows in held for r in rows]
    assert len(heldout) == len(set(heldout)) == 30  # disjoint between clients
    assert not training & set(heldout) and all(task.is_heldout(p) for p in heldout)


# ---------------------------------------------------------------------------------------------
# the config, check_prompt_set and describe
# ---------------------------------------------------------------------------------------------


def test_the_config_accepts_every_partitioner_for_sandbox_and_math_and_only_groups_for_tiny_arith():
    for partitioner in PARTITIONERS:
        parse_run_config({"data.partitioner": partitioner})
        parse_run_config({"data.name": "math", "data.partitioner": partitioner, "eval.every": 0})
    with pytest.raises(ConfigError, match="'data.partitioner' = 'iid' is not defined for 'data.name' = 'tiny-arith'; allowed: 'groups'"):
        parse_run_config({"data.name": "tiny-arith", "data.partitioner": "iid", "eval.every": 0})


def test_check_prompt_set_refuses_a_partition_that_cannot_be_made(tmp_path):
    data.check_prompt_set(_sandbox(partitioner="natural", prompts_per_client=4), 3, heldout_count=2)
    with pytest.raises(ValueError, match="num-partitions is 2"):
        data.check_prompt_set(_sandbox(partitioner="natural", prompts_per_client=4), 2)
    with pytest.raises(ValueError, match="3 subject-group clients; num-partitions is 4"):
        data.check_prompt_set(DataSettings(name="math", path=str(tmp_path / "nowhere")), 4)  # not loaded: cheap


def test_describe_prints_each_partition_s_size_mix_and_held_out_counts(capsys):
    # natural over the 3 groups, 4 prompts each; eval.prompts-per-client = 2 held-out of its own group
    code = describe_main(["describe", "-c", "data.partitioner='natural' data.prompts-per-client=4 eval.prompts-per-client=2"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == [
        (
            "data.name = 'sandbox', data.partitioner = 'natural', data.partition-by = 'group', "
            "data.prompts-per-client = 4, data.seed = 42: 3 partitions, 12 prompts"
        ),
        "partition 0: 4 prompts; group: addition 4 (100.0%)",
        "  held-out: 2 prompts; group: addition 2 (100.0%)",
        "partition 1: 4 prompts; group: expression 4 (100.0%)",
        "  held-out: 2 prompts; group: expression 2 (100.0%)",
        "partition 2: 4 prompts; group: multiplication 4 (100.0%)",
        "  held-out: 2 prompts; group: multiplication 2 (100.0%)",
    ]


def test_describe_shares_and_the_preset_and_the_plot(tmp_path, capsys, monkeypatch):
    from flwr_datasets.common import telemetry

    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    out = tmp_path / "parts.png"
    # the tiny preset (tiny-arith, groups) over 2 partitions: addition, subtraction; no held-out set
    code = describe_main(["describe", "--preset", "tiny", "-c", "data.prompts-per-client=3", "--num-partitions", "2", "--plot", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["partition 0: 3 prompts; group: addition 3 (100.0%)", "partition 1: 3 prompts; group: subtraction 3 (100.0%)"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_describe_exits_one_naming_the_problem(capsys):
    assert describe_main(["describe", "-c", "data.partitioner='natural'", "--num-partitions", "5"]) == 1
    assert "num-partitions is 5" in capsys.readouterr().err
