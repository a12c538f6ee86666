"""``python -m fedopd.data describe``: each client partition's size and mix (and ``--plot``);
``python -m fedopd.data export``: each partition as a file of its own, for a SuperNode's node
config ``data-path`` (and ``eval-path``)."""

from __future__ import annotations

from fedopd.data.describe import describe, plot_partitions


def export_partitions(cfg, num_partitions: int, out) -> list:
    """Write partition i's training rows to ``out/partition-<i>.jsonl`` and, where the set has
    held-out problems, ``eval.prompts-per-client`` of them to ``partition-<i>.eval.jsonl``; the
    files a SuperNode names as ``data-path`` and ``eval-path``. Refuses to overwrite a file."""
    import json

    from fedopd.data import heldout_rows, partition_rows
    from fedopd.data.registry import DATASETS

    files = {}
    for i in range(num_partitions):
        files[out / f"partition-{i}.jsonl"] = partition_rows(cfg.data, i, num_partitions)
        if DATASETS[cfg.data.name].heldout_rows is not None:
            files[out / f"partition-{i}.eval.jsonl"] = heldout_rows(cfg.data, i, num_partitions, cfg.eval.prompts_per_client)
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise ValueError(f"--out: {existing[0]} exists; nothing was written (choose an empty folder)")
    out.mkdir(parents=True, exist_ok=True)
    for path, rows in files.items():
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return list(files)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedopd.data describe [--run-config ...] [--preset NAME] [--num-partitions N] [--plot FILE]``."""
    import argparse
    import sys
    from pathlib import Path

    from fedopd.config import ConfigError, parse_run_config
    from fedopd.config.presets import add_run_config_option, app_defaults, load_preset, overrides_from_args

    parser = argparse.ArgumentParser(prog="python -m fedopd.data", description="Inspect the client prompt partitions.")
    commands = parser.add_subparsers(dest="command", required=True)
    desc = commands.add_parser("describe", help="each partition's size and mix over data.partition-by (and held-out problems)")
    desc.add_argument("--preset", help="a preset of configs/ (e.g. tiny) or a TOML file of run-config overrides")
    add_run_config_option(desc)
    desc.add_argument("--num-partitions", type=int, default=0, help="default: num-clients, or 3")
    desc.add_argument("--plot", metavar="FILE", help="also draw Flower Datasets' partition plot to FILE (e.g. out.png)")
    export = commands.add_parser("export", help="write each partition (and its held-out problems) as a JSONL file a SuperNode can name")
    export.add_argument("--preset", help="a preset of configs/ (e.g. tiny) or a TOML file of run-config overrides")
    add_run_config_option(export)
    export.add_argument("--num-partitions", type=int, default=0, help="default: num-clients, or 3")
    export.add_argument("--out", required=True, help="a folder: partition-<i>.jsonl and partition-<i>.eval.jsonl go there (never overwritten)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        merged = app_defaults()
        if args.preset:
            preset = Path(args.preset)
            if not preset.is_file():
                preset = Path(__file__).resolve().parents[2] / "configs" / f"{args.preset}.toml"
            merged.update(load_preset(preset))
        if args.run_config:
            merged.update(overrides_from_args(args.run_config))
        cfg = parse_run_config(merged)
        num = args.num_partitions or cfg.num_clients or 3
        if args.command == "export":
            for path in export_partitions(cfg, num, Path(args.out)):
                print(path)
            return 0
        print(describe(cfg.data, num, cfg.eval.prompts_per_client))
        if args.plot:
            plot_partitions(cfg.data, num, args.plot)
            print(f"plot: {args.plot}")
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
