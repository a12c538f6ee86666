"""The ServerApp's side of a private run, one object: the budget against one round before
anything is written, the account replayed on resume, the journal in the run folder, the terms in
the stream, and the budget before each round. A run without privacy gets :class:`NoPrivacy`, whose
methods do nothing, so the ServerApp's path has no branch on privacy
(:func:`run_privacy`). The releases themselves (the private mean, the score rows) are the
strategy's averager and score phase (:mod:`fedtops_strategy.privacy`).
"""

from __future__ import annotations

from logging import INFO, WARNING
from pathlib import Path

from flwr.common.logger import log

from fedopd.config import ConfigError, RunConfig
from fedtops_strategy.privacy import JOURNAL, UpdatePrivacy, read_journal
from server_app.run_folder import complete_rounds
from server_app.stop_rules import PrivateStopRules, StopRules


class NoPrivacy:
    """A run without ``privacy.*``: nothing to check, account, journal or announce."""

    private = False

    def check_first_round(self) -> None:
        """Nothing: no budget."""

    def check_resume(self, run_path: Path) -> None:
        """Nothing: no account to read."""

    def resume(self, run_path: Path, done: int) -> None:
        """Nothing: no account to replay."""

    def open(self, run_path: Path) -> None:
        """Nothing: no journal."""

    def announce(self, rounds_left: int) -> None:
        """Nothing: no terms."""

    def budget_stop(self, server_round: int) -> str | None:
        return None

    def stop_rules(self, cfg: RunConfig) -> StopRules:
        """``max-failed-rounds`` and ``max-held-rounds`` as configured."""
        return StopRules(cfg.max_failed_rounds, cfg.max_held_rounds)


class PrivateRun(NoPrivacy):
    """A run under ``privacy.*``: the ledger and the journal of ``privacy`` (the strategy's
    :class:`~fedtops_strategy.privacy.UpdatePrivacy`), whose releases include the score rows when
    the strategy has a score phase (``scores``)."""

    private = True

    def __init__(self, cfg: RunConfig, privacy: UpdatePrivacy, scores: bool) -> None:
        self.cfg, self.privacy, self.scores = cfg, privacy, scores

    def check_first_round(self) -> None:
        """A new run whose ``privacy.max-epsilon`` is below one round's ε is refused before anything is written."""
        settings = self.cfg.privacy
        if not settings.max_epsilon or self.cfg.resume_from:
            return
        one_round = self.privacy.ledger.epsilons(self.privacy.round_multipliers(self.scores))["epsilon"]
        if one_round > settings.max_epsilon:
            raise ConfigError(
                f"run config 'privacy.max-epsilon' = {settings.max_epsilon!r} is below the ε of one round ({one_round:.4g} at "
                f"δ = {settings.delta:g}): no round could run; allowed: a larger budget, or more noise"
            )

    def check_resume(self, run_path: Path) -> None:
        """The run folder to resume holds a readable journal (no journal, no account: never a
        silent fallback), checked before anything changes."""
        try:
            if not (run_path / JOURNAL).is_file():
                raise ValueError(f"{run_path / JOURNAL} is missing")
            read_journal(run_path / JOURNAL)
        except (OSError, ValueError) as err:
            raise ConfigError(f"run config 'resume-from' = {self.cfg.resume_from!r}: its privacy account cannot be read: {err}") from None

    def resume(self, run_path: Path, done: int) -> None:
        """The privacy spent in the first ``done`` rounds, and adaptive clipping's C, from the run
        folder's records and journal; a folder whose account cannot be read refuses the resume."""
        try:
            self.privacy.replay([r for r in complete_rounds(run_path) if r["round"] <= done], run_path / JOURNAL)
        except (OSError, ValueError) as err:
            raise ConfigError(f"run config 'resume-from' = {self.cfg.resume_from!r}: its privacy account cannot be read: {err}") from None

    def open(self, run_path: Path) -> None:
        """Every release from here on goes to the run folder's journal before it leaves; the
        journal exists from the start, since a resume refuses a folder without one."""
        self.privacy.ledger.journal = run_path / JOURNAL
        self.privacy.ledger.journal.touch()

    def announce(self, rounds_left: int) -> None:
        """What the guarantee covers and assumes, and the keys it overrides, in the stream."""
        cfg = self.cfg
        unprotected = cfg.privacy.noise_multiplier == 0 or (self.scores and cfg.privacy.score_noise == 0)
        log(WARNING if unprotected else INFO, "%s", self.privacy.describe(self.scores))
        log(
            INFO,
            "the guarantee assumes that a client answers within timeout.train = %gs and timeout.score = %gs whatever the "
            "other clients' data: clients that queue for one executor (fewer simulation actors than clients, a shared "
            "worker-name) need deadlines well above the slowest honest round (docs/privacy.md)",
            cfg.timeout.train,
            cfg.timeout.score,
        )
        if cfg.timeout.skip_after:
            log(INFO, "timeout.skip-after has no effect under privacy: who is asked must not depend on who answered (docs/privacy.md)")
        if cfg.max_failed_rounds:
            log(
                INFO,
                "max-failed-rounds has no effect under privacy: a run that stopped because no update arrived would tell that "
                "much; a round without updates releases θ_t plus noise (docs/privacy.md)",
            )
        if cfg.privacy.max_epsilon:
            fit = self.privacy.rounds_within_budget(self.scores, rounds_left)
            log(INFO, "privacy.max-epsilon = %g allows %d of the %d rounds to run", cfg.privacy.max_epsilon, fit, rounds_left)

    def stop_rules(self, cfg: RunConfig) -> StopRules:
        """The stop rules that do not read who answered (:class:`PrivateStopRules`): ``max-failed-rounds``
        has no effect, since a round without updates releases θ_t plus noise."""
        return PrivateStopRules(0, cfg.max_held_rounds)

    def budget_stop(self, server_round: int) -> str | None:
        """Why ``server_round``'s releases would exceed ``privacy.max-epsilon`` (they are known in advance), or None."""
        return self.privacy.budget_stop(server_round, self.scores)


def run_privacy(cfg: RunConfig, strategy) -> NoPrivacy:
    """The run's privacy layer: :class:`PrivateRun` around the strategy's privacy, accounting the
    score rows' release when the strategy has a score phase (``strategy.score_phase``), else
    :class:`NoPrivacy`."""
    return NoPrivacy() if strategy.privacy is None else PrivateRun(cfg, strategy.privacy, strategy.score_phase)
