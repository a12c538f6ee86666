"""The rules that end a run early, after each round's record: one policy object per run
(:class:`StopRules`; under privacy :class:`PrivateStopRules`, chosen by the run's privacy layer,
:meth:`server_app.run_privacy.NoPrivacy.stop_rules`).

* no valid update in round 1 (nothing can work), or in ``max-failed-rounds`` consecutive rounds;
* ``max-held-rounds`` consecutive rounds that held (a = 0, θ unchanged).

A run stopped by a rule raises :class:`RunFailed`, whose message says why in the clients' words.
"""

from __future__ import annotations

from dataclasses import dataclass

from server_app.error_lines import reason_line


class RunFailed(RuntimeError):
    """The run cannot go on (no client can work); the message says why, in the clients' words."""


ERROR_REPLY = "error reply: "


def failure_reasons(excluded: list[dict]) -> str:
    """The round's ``excluded`` entries, one per distinct reason with its node ids:
    ``node 1, 2: ModelLoadError: ...; node 3: train: no reply before the timeout``; an error
    reply's reason is its root cause's line (the full text is in ``client-errors.log``)."""
    nodes: dict[str, list[int]] = {}
    for entry in excluded:
        reason = reason_line(entry.get("reason", "?"))
        reason = reason[len(ERROR_REPLY) :] if reason.startswith(ERROR_REPLY) else reason
        nodes.setdefault(reason, []).append(int(entry["node-id"]))
    if not nodes:
        return "no client was sent a train message"
    return "; ".join(f"node {', '.join(map(str, sorted(set(ids))))}: {reason}" for reason, ids in nodes.items())


def no_update_failure(server_round: int, failed_rounds: int, max_failed_rounds: int, record: dict) -> RunFailed | None:
    """The error that stops the run after ``server_round``, or None: no client returned a valid
    update in round 1 (nothing can work), or in ``max_failed_rounds`` consecutive rounds
    (0: never, round 1 included; always 0 under privacy, :class:`PrivateStopRules`)."""
    if failed_rounds == 0 or max_failed_rounds == 0 or (server_round > 1 and failed_rounds < max_failed_rounds):
        return None
    when = (
        f"round {server_round}"
        if failed_rounds == 1
        else f"{failed_rounds} consecutive rounds ({server_round - failed_rounds + 1}-{server_round}); in round {server_round}"
    )
    return RunFailed(f"no client returned a valid update in {when}: {failure_reasons(record.get('excluded', []))}")


def held_failure(server_round: int, held_rounds: int, max_held_rounds: int, record: dict) -> RunFailed | None:
    """The error that stops the run after ``server_round`` when it held (:meth:`StopRules.held`)
    in ``max_held_rounds`` consecutive rounds (0: never), naming why and the nodes."""
    if not max_held_rounds or held_rounds < max_held_rounds:
        return None
    return RunFailed(
        f"the federation held (a = 0, θ unchanged) in {held_rounds} consecutive rounds "
        f"({server_round - held_rounds + 1}-{server_round}, max-held-rounds = {max_held_rounds}); "
        f"in round {server_round}: {record.get('hold-reason', '?')}"
    )


@dataclass
class StopRules:
    """The stop rules of a run: no valid update (in round 1, or in ``max_failed_rounds``
    consecutive rounds) and ``max_held_rounds`` consecutive holds (:meth:`held`); 0: never."""

    max_failed_rounds: int
    max_held_rounds: int
    failed_rounds: int = 0  # consecutive rounds without a valid client update
    held_rounds: int = 0  # consecutive rounds that held

    @staticmethod
    def held(record: dict) -> bool:
        """Whether a round held, for ``max-held-rounds``: a = 0 with valid updates."""
        return bool(record.get("clients") and record.get("hold-reason"))

    def after(self, server_round: int, record: dict) -> RunFailed | None:
        """Count ``server_round`` (its record); the error that ends the run after it, or None."""
        self.failed_rounds = 0 if record.get("clients") else self.failed_rounds + 1
        self.held_rounds = self.held_rounds + 1 if self.held(record) else 0
        return no_update_failure(server_round, self.failed_rounds, self.max_failed_rounds, record) or held_failure(
            server_round, self.held_rounds, self.max_held_rounds, record
        )


@dataclass
class PrivateStopRules(StopRules):
    """Under privacy the run's length must not depend on who answered: a hold is a released a = 0
    (the privacy layer builds it with ``max_failed_rounds`` 0: a round without updates releases
    θ_t plus noise, :meth:`server_app.run_privacy.PrivateRun.stop_rules`)."""

    @staticmethod
    def held(record: dict) -> bool:
        return record.get("multiplier") == 0.0
