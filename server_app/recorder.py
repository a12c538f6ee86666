"""What the ServerApp does after each round, one object for the run: save the round's adapters,
evaluate on the held-out prompts when due, write the round record, print its line, hand it to the
trackers and redraw the run's figure (:meth:`RoundRecorder.record`)."""

from __future__ import annotations

import time
from functools import partial
from logging import INFO, WARNING

from flwr.app import ArrayRecord
from flwr.common.logger import log

from fedopd.config import RunConfig
from fedopd.core.procinfo import rss_mb
from fedopd.models.lora import from_record
from fedtops_strategy.round import RoundResult
from server_app.evaluation import evaluate_round, is_evaluation_round
from server_app.log_lines import eta_seconds, round_summary
from server_app.progress import FIGURE, draw, run_title
from server_app.run_folder import RunFolder, read_rounds
from server_app.tracking import Trackers
from server_app.traffic import round_communication


class RoundRecorder:
    """Records every round of one run in its run folder, stream, trackers and figure."""

    def __init__(self, grid, cfg: RunConfig, strategy, run: RunFolder, trackers: Trackers, per_client_adapters: bool) -> None:
        self.grid, self.cfg, self.strategy, self.run, self.trackers = grid, cfg, strategy, run, trackers
        self.per_client = per_client_adapters
        self.title = run_title(cfg.to_run_config())

    def record_start(self, theta: ArrayRecord) -> None:
        """Round 0: the evaluation of the initial adapter, when due."""
        if is_evaluation_round(0, self.cfg.eval.every, self.cfg.num_server_rounds):
            record: dict = {"round": 0, "strategy": self.cfg.strategy.name}
            traffic = self.add_evaluation(0, theta, record)
            record["communication"] = round_communication(traffic)
            self.write(0, record)

    def record(self, result: RoundResult, record: dict, theta: ArrayRecord, evaluate: bool = True) -> None:
        """Save the round's adapters, evaluate on the held-out prompts when due, and write the
        round's ``record`` (:meth:`RoundResult.to_record`) with the server's timings, memory, the
        bytes per node of each phase (``communication``) and the evaluation."""
        server_round = result.server_round
        record["seconds"] = time.perf_counter() - result.train.sent.started
        record["server-rss-mb"] = rss_mb()
        record["excluded-node-ids"] = sorted({int(e["node-id"]) for e in record.get("excluded", [])})
        self.save_adapters(server_round, theta)
        traffic = dict(result.traffic)
        if evaluate and is_evaluation_round(server_round, self.cfg.eval.every, self.cfg.num_server_rounds):
            traffic.update(self.add_evaluation(server_round, theta, record))
        if traffic:
            record["communication"] = round_communication(traffic)
        self.write(server_round, record)

    def add_evaluation(self, server_round: int, theta: ArrayRecord, record: dict) -> dict:
        """The held-out evaluation into ``record`` (``evaluation``, ``eval_seconds``); its traffic."""
        started = time.perf_counter()
        record["evaluation"] = self.evaluate(server_round, theta)
        record["eval_seconds"] = time.perf_counter() - started
        return {"evaluate": self.grid.phase_traffic()}

    def save_adapters(self, server_round: int, global_arrays: ArrayRecord) -> None:
        """θ_{t+1}, or each client's own adapter where there is no global one (Local)."""
        if self.per_client:
            for pid, named in self.strategy.client_adapters().items():
                self.run.save_adapter(server_round, named, client=pid)
        else:
            self.run.save_adapter(server_round, from_record(global_arrays))
            evaluated = self.strategy.evaluated_arrays(global_arrays)
            if evaluated is not None:  # what the evaluation reads instead (FedExP's last-two average)
                self.run.save_evaluated(server_round, from_record(evaluated))

    def evaluate(self, server_round: int, global_arrays: ArrayRecord):
        """The held-out evaluation of ``server_round`` (:func:`server_app.evaluation.evaluate_round`)."""
        cfg, strategy = self.cfg, self.strategy
        return evaluate_round(
            self.grid,
            server_round,
            partial(strategy.evaluation_arrays, global_arrays=global_arrays),
            local_mean=self.per_client,
            timeout=cfg.timeout.evaluate,
            fraction=cfg.eval.fraction,
            seed=cfg.seed,
            num_partitions=strategy.num_partitions,
            max_examples=cfg.eval.prompts_per_client,
            # nodes that sit out this round, or the next one after a silence noted this round
            skip=strategy.sitting_out(server_round) | strategy.sitting_out(server_round + 1),
            on_silence=partial(strategy.note_timeouts, server_round),
            required=(f"avg@{cfg.eval.samples}", f"pass@{cfg.eval.samples}"),
        )

    def write(self, server_round: int, record: dict) -> None:
        """The record to ``rounds.jsonl``, the status, the stream's line, the trackers, the figure."""
        self.run.append_round(record)
        self.run.write_status("running", server_round)
        records = read_rounds(self.run.path)
        log(INFO, "%s", round_summary(record, self.cfg.num_server_rounds, eta_seconds(records, self.cfg.num_server_rounds)))
        self.trackers.log_round(record)
        try:
            draw(records, self.run.path / FIGURE, self.title)
        except Exception as err:  # noqa: BLE001 - a figure must never stop a run
            log(WARNING, "could not draw %s: %s", self.run.path / FIGURE, err)
