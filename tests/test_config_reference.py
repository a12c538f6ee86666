"""What is generated from the run config's declarations stays true: the reference in
docs/configuration.md, pyproject's [tool.flwr.app.config], and every run-config override a README
command gives."""

import re
import shlex
from pathlib import Path

import pytest

from fedopd.config import _KEYS, HELP, parse_run_config
from fedopd.config.presets import app_defaults, load_preset, overrides_from_args
from fedopd.config.reference import PAGE, PYPROJECT, app_config_table, render_page, render_pyproject, table

REPO = Path(__file__).resolve().parent.parent


def test_every_key_has_one_line_of_help_and_a_default():
    assert set(HELP) == set(_KEYS)
    assert all(h.strip() and "\n" not in h for h in HELP.values())
    assert set(app_defaults()) == set(_KEYS)


def test_the_reference_in_docs_configuration_is_the_generated_one():
    page = PAGE.read_text()
    assert render_page(page, table()) == page, "docs/configuration.md is stale: run python -m fedopd.config.reference --write"
    for key in _KEYS:  # one row per key, with its default
        assert f"| `{key}` |" in page


def test_pyprojects_app_config_is_the_generated_one():
    text = PYPROJECT.read_text()
    assert render_pyproject(text, app_config_table()) == text, "pyproject.toml is stale: run python -m fedopd.config.reference --write"


def test_a_field_declared_as_a_setting_is_a_key_of_its_dashed_path_with_its_help():
    from dataclasses import dataclass

    from fedopd.core.settings import _dashed, _int, _schema, setting

    @dataclass(frozen=True)
    class Group:
        mini_batch: int = setting(4, _int(1), "rollouts per step")
        not_a_key: int = 3

    @dataclass(frozen=True)
    class Config:
        top_level: int = setting(1, _int(0), "a top-level key")
        group: Group = Group()

    found = {_dashed(path): f.metadata for path, f in _schema(Config)}
    assert list(found) == ["top-level", "group.mini-batch"]
    assert found["group.mini-batch"]["run-config help"] == "rollouts per step"


def test_rendering_pyproject_replaces_only_its_app_config_table():
    text = '[project]\nname = "x"\n\n[tool.flwr.app.config]\nold = 1\n\n[tool.other]\nkeep = true\n'
    assert (
        render_pyproject(text, "[tool.flwr.app.config]\nnew = 2\n")
        == '[project]\nname = "x"\n\n[tool.flwr.app.config]\nnew = 2\n\n[tool.other]\nkeep = true\n'
    )


def test_the_generated_table_changes_with_the_schema():
    text = table({**app_defaults(), "strategy.trust-budget": 0.25})
    assert "| `strategy.trust-budget` | float | `0.25` | a number >= 0, or inf" in text


def _readme_overrides() -> list[str]:
    """The --run-config argument of every README command and the overrides of every ``--variant``
    (inline strings; multi-line ones joined)."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        command = block.replace("\\\n", " ")
        for line in re.findall(r"--run-config (\"[^\"]*\"|'[^']*'|\S+)", command):
            found.append(shlex.split(line)[0] if line[0] in "\"'" else line)
        for variant in re.findall(r"--variant (\"[^\"]*\")", command):  # python -m eval.variants: NAME: overrides
            found.append(shlex.split(variant)[0].partition(":")[2].strip())
    return found


def test_every_run_config_a_readme_command_gives_validates():
    overrides = _readme_overrides()
    assert len(overrides) >= 5  # the strategies, your own prompts, the paper preset
    for value in overrides:
        if value == "...":
            continue  # a placeholder in prose
        if value.endswith(".toml"):
            parse_run_config({**app_defaults(), **load_preset(REPO / value)})
        else:
            parse_run_config({**app_defaults(), **overrides_from_args([value])})


def test_a_bad_readme_style_override_would_fail():
    from fedopd.config import ConfigError

    with pytest.raises(ConfigError):
        parse_run_config({**app_defaults(), **overrides_from_args(["strategy.name='fedprox'"])})


def test_the_strategy_table_in_docs_strategies_is_the_generated_one():
    from fedopd.config.reference import STRATEGIES_PAGE, strategies_table
    from fedopd.core.strategies import CAPABILITIES

    page = STRATEGIES_PAGE.read_text()
    assert render_page(page, strategies_table()) == page, "docs/strategies.md is stale: run python -m fedopd.config.reference --write"
    for name in CAPABILITIES:
        assert f"| `{name}` |" in page
