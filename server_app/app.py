"""ServerApp: validate, initialise the adapter from ``seed``, run the strategy, write the run.

Everything that can be checked is checked before round 1 (run config, model names); a bad value
stops the run with a message naming the key, and no run folder or adapter is created.
"""

from __future__ import annotations

import time
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedopd.config import ConfigError, RunConfig
from fedopd.lora import from_record
from fedopd.models import ModelLoadError, attach_lora, load_causal_lm, resolve_model_path
from fedtops_strategy import make_strategy
from server_app.evaluation import evaluate_round, is_evaluation_round
from server_app.grid import PromptGrid
from server_app.run_folder import RunFolder, new_run_dir

app = ServerApp()


def initial_adapter(cfg: RunConfig):
    """(named fp32 arrays, LoraConfig) of PEFT's default LoRA init drawn from ``seed``.

    Loaded on CPU: the server only needs the adapter's shapes and initial values.
    """
    import torch

    student = attach_lora(load_causal_lm(cfg.model.student, dtype="float32", device=torch.device("cpu")), cfg.lora, cfg.seed)
    return student.get_lora_arrays(), student.lora_config


def evaluation_summary(evaluation: dict | None) -> str:
    if not evaluation or "accuracy" not in evaluation:
        return ""
    sampled = " ".join(f"{k} {v:.1f}%" for k, v in evaluation.items() if k.startswith(("avg@", "pass@")))
    label = "Local mean " if evaluation.get("aggregate") == "local-mean" else ""
    return f" | held-out {label}greedy {evaluation['accuracy']:.1f}% {sampled}"


def round_summary(record: dict, num_rounds: int) -> str:
    """One readable line per round for ``flwr run --stream``."""
    if record["round"] == 0:
        return f"round 0/{num_rounds} [{record['strategy']}] initial adapter{evaluation_summary(record.get('evaluation'))}"
    a = record.get("multiplier")
    j = "-"
    if record.get("teacher_scores") and a in (record.get("candidates") or []):
        j = f"{record['teacher_scores'][record['candidates'].index(a)]:.4f}"
    feasible = f"{record['num-feasible']}/{len(record['candidates'])}" if "num-feasible" in record else "-"
    clients = record.get("clients", [])
    kl = "-"
    if clients:
        before = sum(c["kl_before"] for c in clients) / len(clients)
        after = sum(c["kl_after"] for c in clients) / len(clients)
        kl = f"{before:.4f} -> {after:.4f}"
    flags = "".join(
        [" (fallback: no score replies)" if record.get("fallback") else "",
         f" ({len(record['excluded'])} excluded)" if record.get("excluded") else ""]
    )
    a = "-" if a is None else f"{a:g}"
    return (
        f"round {record['round']}/{num_rounds} [{record['strategy']}] a = {a} | J(a) = {j} | "
        f"feasible {feasible} | client KL {kl}{evaluation_summary(record.get('evaluation'))} | "
        f"{record.get('seconds', 0.0):.1f} s{flags}"
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        cfg = RunConfig.from_run_config(context.run_config)
        resolve_model_path(cfg.model.student), resolve_model_path(cfg.model.teacher)
    except (ConfigError, ModelLoadError) as err:
        log(ERROR, "FedTOPS: invalid run config, nothing was run or written: %s", err)
        raise
    run_server(grid, cfg)


def run_server(grid: Grid, cfg: RunConfig) -> Path:
    """The whole run for a validated config; returns the run folder after the last round."""
    grid = PromptGrid(grid)
    arrays, lora_config = initial_adapter(cfg)

    run = RunFolder(new_run_dir(cfg.output_dir, cfg.strategy.name), cfg, lora_config)
    log(INFO, "FedTOPS run folder: %s", run.path.resolve())
    run.save_adapter(0, arrays)

    # Deployment: with num-clients = n the strategy waits until n SuperNodes are connected.
    num_clients = cfg.num_clients or max(1, len(list(grid.get_node_ids())))
    strategy = make_strategy(cfg.strategy, num_clients=num_clients, score_timeout=cfg.timeout.score)
    local = cfg.strategy.name == "local"

    def after_round(server_round: int, global_arrays: ArrayRecord):
        """Save the round's adapters, evaluate on the held-out prompts when due, write the record."""
        if server_round == 0:
            record = {"round": 0, "strategy": cfg.strategy.name}
        else:
            record = strategy.records.get(server_round, {"round": server_round, "strategy": cfg.strategy.name})
            record["seconds"] = time.perf_counter() - strategy.round_started
            if local:
                for pid, named in strategy.client_adapters().items():
                    run.save_adapter(server_round, named, client=pid)
            else:
                run.save_adapter(server_round, from_record(global_arrays))
        if is_evaluation_round(server_round, cfg.eval.every, cfg.num_server_rounds):
            started = time.perf_counter()
            record["evaluation"] = evaluate_round(
                grid, server_round, lambda node: strategy.evaluation_arrays(node, global_arrays), local_mean=local, timeout=cfg.timeout.evaluate
            )
            record["eval_seconds"] = time.perf_counter() - started
        if server_round > 0 or "evaluation" in record:
            run.append_round(record)
            log(INFO, "%s", round_summary(record, cfg.num_server_rounds))
        return None

    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({n: Array(a) for n, a in arrays.items()}),
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.timeout.train,
        train_config=ConfigRecord(),
        evaluate_fn=after_round,
    )
    log(INFO, "FedTOPS run finished: %s", run.path.resolve())
    return run.path
