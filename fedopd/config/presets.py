"""Presets: the app's defaults, run-config TOML files, ``--run-config`` overrides, and the
command that validates them.

``python -m fedopd.config [FILE.toml] [--run-config ...]`` (or ``python -m fedopd.config.presets``)
validates a preset over the app's defaults (the ``[tool.flwr.app.config]`` table of
``pyproject.toml``) exactly as ``flwr run`` would receive it, without loading any model, and prints
the resolved configuration as JSON with the run-config key names.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from fedopd.config.parse import check_local_prompts, check_server_requirements, parse_run_config
from fedopd.core.errors import ConfigError


def app_defaults(pyproject: str | Path | None = None) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of the app's ``pyproject.toml``."""
    path = Path(pyproject) if pyproject else Path(__file__).resolve().parents[2] / "pyproject.toml"
    with open(path, "rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def load_preset(path: str | Path) -> dict[str, Any]:
    """Read a run-config TOML file (flat keys, as accepted by ``flwr run --run-config FILE``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run config file '{path}' does not exist")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"run config file '{path}' is not valid TOML: {err}") from None
    return _flatten(data)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def add_run_config_option(parser, help: str = "overrides exactly as for `flwr run --run-config` (repeatable)") -> None:
    """``--run-config`` / ``-c`` on an argparse ``parser``, read by :func:`overrides_from_args`."""
    parser.add_argument("--run-config", "-c", action="append", default=[], metavar="'k1=v1 k2=v2'", help=help)


def overrides_from_args(values: Sequence[str]) -> dict[str, Any]:
    """``--run-config`` values exactly as ``flwr run`` reads them (Flower's own parser): key=value
    pairs in TOML syntax, or one TOML file."""
    from flwr.common.config import parse_config_args

    for value in values:
        if value.endswith(".toml") and not Path(value).expanduser().is_file():
            raise ConfigError(f"run config file '{value}' does not exist")
    try:
        return parse_config_args(list(values))
    except Exception as err:  # click.ClickException or ValueError, with Flower's message
        raise ConfigError(f"--run-config {' '.join(values)!r}: {getattr(err, 'message', err)}") from None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fedopd.config",
        description="Validate run-config overrides over the app's defaults, as `flwr run` would receive them, "
        "without loading a model; print the resolved config. Exit status 1 on any problem.",
    )
    parser.add_argument("file", nargs="?", help="a TOML file of overrides (e.g. configs/paper-0.6b-1x.toml)")
    add_run_config_option(parser)
    parser.add_argument(
        "--num-clients", type=int, default=3, help="clients to check the data's partition for where num-clients is 0 (default 3, as make run)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        merged = app_defaults()
        if args.file:
            merged.update(load_preset(args.file))
        if args.run_config:
            merged.update(overrides_from_args(args.run_config))
        cfg = parse_run_config(merged)
        check_server_requirements(cfg)
        skipped = check_local_prompts(cfg, cfg.num_clients or args.num_clients)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if skipped:
        print(f"note: {skipped}", file=sys.stderr)
    print(json.dumps(cfg.to_run_config(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
