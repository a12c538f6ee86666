"""ServerApp: validate, initialise the adapter from ``seed``, run the strategy, write the run.

Everything that can be checked is checked before round 1 (run config, model names); a bad value
stops the run with a message naming the key, and no run folder or adapter is created.
A run in which no client returns a valid update in round 1, or in ``max-failed-rounds``
consecutive rounds (0: never), stops after recording that round: ``status.json`` says ``failed`` with the
clients' own error messages (each one's root cause's line, :func:`server_app.error_lines.root_cause`)
and their node ids, and the ServerApp raises (:class:`RunFailed`). The full text of every error
reply is in the run folder's ``client-errors.log``.
"""

from __future__ import annotations

import json
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedopd.config import RESUME_FREE_KEYS, ConfigError, RunConfig, check_per_round, check_server_requirements, parse_run_config
from fedopd.core.strategies import clients_per_round
from fedopd.engine.templates import WARN as TEMPLATES_WARN
from fedopd.engine.templates import run_chat_templates
from fedopd.models import ModelLoadError, attach_lora, load_adapter, load_causal_lm, resolve_model_path
from fedopd.models.vocab import run_stop_tokens
from fedtops_strategy import make_strategy
from fedtops_strategy.factory import capabilities
from fedtops_strategy.privacy import PrivacyBudgetSpent
from fedtops_strategy.round import play_round
from fedtops_strategy.sampling import NodesNotConnected
from server_app.grid import PromptGrid
from server_app.log_lines import evaluation_summary, log_reply, reply_summary, round_summary  # noqa: F401 - re-exported
from server_app.progress import run_summary
from server_app.recorder import RoundRecorder
from server_app.run_folder import RunFolder, complete_rounds, config_mismatch, new_run_dir, read_rounds, read_run_config, read_status
from server_app.run_privacy import NoPrivacy, run_privacy
from server_app.stop_rules import RunFailed
from server_app.tracking import Trackers, run_trackers

app = ServerApp()


def initial_adapter(cfg: RunConfig):
    """(named fp32 arrays, LoraConfig) of PEFT's default LoRA init drawn from ``seed``.

    Loaded on CPU: the server only needs the adapter's shapes and initial values. The config
    names the base model as the run config does (a hub id, a path as written, or a built-in
    model's ``builtin:`` name), not where this host keeps its files: a saved adapter says which
    model it belongs to on any machine.
    """
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as on the clients: no 'Loading weights' bar in the run's stream
    student = attach_lora(load_causal_lm(cfg.model.student, dtype="float32", device=torch.device("cpu")), cfg.lora, cfg.seed)
    config = copy.copy(student.lora_config)
    config.base_model_name_or_path = cfg.model.student
    return student.get_lora_arrays(), config


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        cfg = parse_run_config(context.run_config)
        check_server_requirements(cfg)
        resolve_model_path(cfg.model.student), resolve_model_path(cfg.model.teacher)
    except (ConfigError, ModelLoadError) as err:
        log(ERROR, "FedTOPS: invalid run config, nothing was run or written: %s", err)
        raise
    run_server(grid, cfg)


def check_connected(cfg: RunConfig, connected: int) -> None:
    """With ``num-clients = 0`` the run trains the nodes connected when it starts: the settings
    that depend on how many a round averages (:func:`fedopd.config.check_per_round`) are checked
    against them, before anything is written."""
    try:
        check_per_round(cfg, clients_per_round(connected, cfg.strategy.fraction_train, cfg.strategy.min_train_clients))
    except ConfigError as err:
        raise ConfigError(
            f"{err} (num-clients = 0: the run trains the {connected} node(s) connected now; set num-clients to the federation's size "
            "to wait for all of them)"
        ) from None


def open_resumed_run(cfg: RunConfig, lora_config, resolved: dict | None, privacy: NoPrivacy, flower_run_id: int = 0) -> tuple[RunFolder, int]:
    """(the run folder of ``resume-from``, its last complete round), checked before anything changes.

    The folder must hold a run whose resolved config equals this one except for
    :data:`fedopd.config.RESUME_FREE_KEYS`; a half-written last round is removed.
    """
    path = Path(cfg.resume_from).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"run config 'resume-from' = {cfg.resume_from!r}: no run folder there (no config.json)")
    original = read_run_config(path)
    changed = config_mismatch(original, cfg.to_run_config())
    if changed:
        diffs = ", ".join(f"'{k}' ({original.get(k)!r} -> {cfg.to_run_config()[k]!r})" for k in changed)
        raise ConfigError(
            f"run config 'resume-from' = {cfg.resume_from!r}: the run was made with other values of {diffs}; "
            f"a resumed run may change only {', '.join(RESUME_FREE_KEYS)}"
        )
    if cfg.num_server_rounds < int(original["num-server-rounds"]):
        raise ConfigError(
            f"run config 'num-server-rounds' = {cfg.num_server_rounds} is below the resumed run's {original['num-server-rounds']}; it may only grow"
        )
    privacy.check_resume(path)  # a private run's journal: no journal, no account
    done = max((r["round"] for r in complete_rounds(path)), default=0)
    if done >= cfg.num_server_rounds:
        raise ConfigError(
            f"run config 'resume-from' = {cfg.resume_from!r}: the run already completed its {done} rounds; raise 'num-server-rounds' to continue it"
        )
    run = RunFolder(path, cfg, lora_config, resolved, flower_run_id=flower_run_id, first_round=done + 1)
    return run, done


def run_server(grid: Grid, cfg: RunConfig) -> Path:
    """The whole run for a validated config; returns the run folder after the last round.

    With ``resume-from``, the run continues in that folder after its last complete round, from
    the global adapter saved there (the clients restore their own state, ``client_app/client_state.py``).
    """
    grid = PromptGrid(grid, on_reply=log_reply)
    # Deployment: with num-clients = n the strategy waits until n SuperNodes are connected.
    num_clients = cfg.num_clients or max(1, len(list(grid.get_node_ids())))
    # The boundary's ranges (fedtops_strategy/replies.py): partition ids in [0, num-clients), and a
    # client holds at most the whole prompt pool (data.prompts-per-client per client). With
    # num-clients = 0 the pool is that of the nodes connected at the start (a simulation's
    # partitions are exactly those nodes), and partition ids have no upper bound to check against
    # (nodes may still register).
    if not cfg.num_clients:
        check_connected(cfg, num_clients)
    strategy = make_strategy(
        cfg.strategy,
        num_clients=num_clients,
        seed=cfg.seed,
        timeouts=cfg.timeout,
        privacy=cfg.privacy,
        max_examples=cfg.data.prompts_per_client * num_clients,
        num_partitions=num_clients if cfg.num_clients else None,
    )
    supports = capabilities(cfg.strategy.name)
    privacy = run_privacy(cfg, strategy)
    privacy.check_first_round()
    check_data(cfg, num_clients)
    # The pair and its stop set, from the models' files, before anything is written: a pair the
    # clients would refuse stops here, and config.json records where responses end.
    stop = run_stop_tokens(cfg.model.student, cfg.model.teacher, cfg.rollout.stop_tokens)
    log(INFO, "rollouts stop at %s (ids %s)", list(stop.tokens), list(stop.ids))
    # The teacher scores the student's rendering of each prompt: a teacher template that starts the
    # response elsewhere stops the run here, one that differs only before it is logged once.
    # Fixed problems (fedopd.engine.templates.PROBLEMS): the clients load the run's own.
    try:
        templates = run_chat_templates(cfg.model.student, cfg.model.teacher)
    except ModelLoadError as err:
        log(ERROR, "FedTOPS: the model pair cannot be distilled as configured, nothing was run or written: %s", err)
        raise
    if templates.status == TEMPLATES_WARN:
        log(WARNING, "%s", templates.message)
    check_positions(cfg)
    resolved = {"rollout.stop-tokens": stop.as_record(), **engine_settings(cfg)}
    arrays, lora_config = initial_adapter(cfg)
    if cfg.resume_from:
        run, done = open_resumed_run(cfg, lora_config, resolved, privacy, flower_run_id(grid))
        if done > 0 and not supports.per_client_adapters:  # Local's global adapter stays the initial one
            arrays = load_adapter(run.adapter_dir(done), names=list(arrays))
        privacy.resume(run.path, done)  # the privacy spent so far, and adaptive clipping's C
        log(INFO, "FedTOPS run folder: %s (resumed after round %d)", run.path.resolve(), done)
    else:
        run, done = RunFolder(new_run_dir(cfg.output_dir, cfg.strategy.name), cfg, lora_config, resolved, flower_run_id=flower_run_id(grid)), 0
        log(INFO, "FedTOPS run folder: %s", run.path.resolve())
        run.save_adapter(0, arrays)
    privacy.open(run.path)
    grid.on_error = run.log_client_error  # the full text to client-errors.log, the root cause's line onwards

    run.write_status("running", done)
    # logging.tensorboard / wandb / mlflow: the config now, each round's scalars, the final status
    trackers = run_trackers(cfg, run.path)
    trackers.log_config(json.loads((run.path / "config.json").read_text()))
    try:
        return _run_rounds(grid, cfg, strategy, privacy, run, done, arrays, trackers)
    except RunFailed as err:
        log(ERROR, "FedTOPS run failed: %s", err)
        run.write_status("failed", error=str(err))
        raise
    except PrivacyBudgetSpent as err:  # a release refused mid-round (the check before each round should have stopped it)
        log(WARNING, "FedTOPS run stopped: %s", err)
        run.write_status("budget-spent", error=str(err))
        return run.path
    except BaseException as err:
        run.write_status("failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        trackers.close(_final_status(run))


def _final_status(run: RunFolder) -> str:
    """The status the run ended with (``status.json``), for the trackers; unreadable: ``failed``."""
    try:
        return str(read_status(run.path).get("status", "failed"))
    except (OSError, ValueError):
        return "failed"


def check_data(cfg: RunConfig, num_partitions: int) -> None:
    """The prompt set and its partition over ``num_partitions`` clients, before anything is
    written (:func:`fedopd.config.parse.check_local_prompts`); ``data.name = 'prompts'`` files that
    are not on this host (a hub id, or files that only the clients hold) are checked by each client
    when it loads them."""
    from fedopd.config.parse import check_local_prompts

    try:
        skipped = check_local_prompts(cfg, num_partitions, fetch=True)
    except ConfigError as err:
        log(ERROR, "FedTOPS: the prompt set cannot be used, nothing was run or written: %s", err)
        raise
    if skipped:
        log(INFO, "%s", skipped)


def engine_settings(cfg: RunConfig) -> dict:
    """``model.dtype`` and ``rollout.backend`` as they resolve on this host (a simulation: the
    clients' host too; a client on another host logs its own). Both engines run the student in
    that one dtype (:func:`fedopd.rollout.make_rollout_engine`)."""
    from fedopd.models import default_device, resolve_dtype
    from fedopd.rollout import resolve_backend
    from fedopd.rollout.vllm_engine import torch_dtype_name, vllm_platform

    dtype = torch_dtype_name(resolve_dtype(cfg.model.dtype, default_device()))
    # 'vllm' stays 'vllm' where the ServerApp's host has no vLLM: the clients check it on theirs
    backend = "vllm" if cfg.rollout.backend == "vllm" else resolve_backend(cfg.rollout.backend, vllm_platform())
    return {"model.dtype": dtype, "rollout.backend": backend}


def check_positions(cfg: RunConfig) -> None:
    """The longest prompt plus the longest response fits the student's and the teacher's positions
    (:func:`fedopd.models.positions.check_run_positions`), before anything is written."""
    from fedopd.models.positions import check_run_positions, load_model_config

    try:
        check_run_positions(cfg, load_model_config(cfg.model.student), load_model_config(cfg.model.teacher))
    except ConfigError as err:
        log(ERROR, "FedTOPS: invalid run config, nothing was run or written: %s", err)
        raise


def _run_rounds(grid: PromptGrid, cfg: RunConfig, strategy, privacy: NoPrivacy, run: RunFolder, done: int, arrays, trackers: Trackers) -> Path:
    """Algorithm 1 from the round after ``done``: each round trains, scores (FedTOPS) and steps
    (:func:`fedtops_strategy.round.play_round`), is recorded with its evaluation when due, and may
    end the run (:mod:`server_app.stop_rules`, the privacy budget)."""
    started_run = time.perf_counter()
    recorder = RoundRecorder(grid, cfg, strategy, run, trackers, capabilities(cfg.strategy.name).per_client_adapters)
    stop_rules = privacy.stop_rules(cfg)
    log(INFO, "Starting %s strategy:", type(strategy).__name__)
    strategy.summary()
    privacy.announce(cfg.num_server_rounds - done)
    theta = ArrayRecord({n: Array(a) for n, a in arrays.items()})
    if done == 0:
        recorder.record_start(theta)
    for server_round in range(done + 1, cfg.num_server_rounds + 1):
        # The budget, before anything of the round is released (its releases are known in advance)
        if (stop := privacy.budget_stop(server_round)) is not None:
            log(WARNING, "FedTOPS run stopped on its privacy budget: %s", stop)
            run.write_status("budget-spent", server_round - 1, error=stop)
            _finish(run, cfg, started_run)
            return run.path
        log(INFO, "[ROUND %d/%d]", server_round, cfg.num_server_rounds)
        try:
            result = play_round(
                strategy,
                grid,
                server_round,
                theta,
                round_config(run, server_round, done),
                train_timeout=cfg.timeout.train,
                score_timeout=cfg.timeout.score,
                meter=grid.phase_traffic,
            )
        except NodesNotConnected as err:
            raise RunFailed(str(err)) from None
        theta, record = result.step.arrays(), result.to_record()
        failure = stop_rules.after(server_round, record)
        recorder.record(result, record, theta, evaluate=failure is None)  # excluded reasons and all
        if failure is not None:
            raise failure
    run.write_status("completed", cfg.num_server_rounds)
    _finish(run, cfg, started_run)
    return run.path


def round_config(run: RunFolder, server_round: int, done: int) -> ConfigRecord:
    """The train messages' config from the app: the run folder, and on the first round of a
    resumed run the round whose state the clients restore (``resume-round``) and, for SuperNodes,
    which keep their state by the SuperLink's run id, the run id that played it (``resume-run``)."""
    config = ConfigRecord({"run-dir": str(run.path.resolve())})
    if server_round == done + 1 and done > 0:
        config["resume-round"] = done
        previous = run.flower_run_of(done)
        if previous is not None:  # a SuperNode keeps its state under the run id that saved it
            config["resume-run"] = str(previous)  # run ids are unsigned 64-bit: past a ConfigRecord's int64
    return config


def flower_run_id(grid: Grid) -> int:
    """The run id the SuperLink assigned to this run (0 where the grid has none)."""
    run_id = getattr(getattr(grid, "run", None), "run_id", 0)
    return run_id if isinstance(run_id, int) else 0


def _finish(run: RunFolder, cfg: RunConfig, started_run: float) -> None:
    """Print the run's summary (a run that completed or spent its budget)."""
    for line in run_summary(read_rounds(run.path), cfg.strategy.name, run.path.resolve(), time.perf_counter() - started_run):
        log(INFO, "%s", line)
    log(INFO, "FedTOPS run finished: %s", run.path.resolve())
