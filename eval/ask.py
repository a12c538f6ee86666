"""Ask a trained adapter a question, in the prompt format it was trained on.

    python -m eval.ask runs/<run> "What is 17 + 25?"               # the run's last adapter, greedy
    python -m eval.ask runs/<run> --round 4 --client 1 "..."        # round 4; a Local run's client 1
    python -m eval.ask path/to/adapter --model Qwen/Qwen3-0.6B-Base "..."   # any PEFT adapter folder
    echo "What is 2 + 2?" | python -m eval.ask runs/<run> -        # one question per line of stdin

From Python::

    from eval.ask import Answerer
    ask = Answerer.load("runs/<run>")            # or an adapter folder
    print(ask("What is 17 + 25?"))

The question is rendered exactly as training and held-out evaluation render a problem
(:func:`fedopd.data.render_prompt`: the paper's instruction in the student's chat template,
``enable_thinking=False``); the answer is decoded greedily (``--temperature`` > 0 samples, with
``--top-p`` and ``--seed``) up to the run's ``eval.max-new-tokens`` and stops at the stop tokens the
run resolved (``config.json``'s ``resolved``; no teacher file is read). The base model is the one the adapter names
(``adapter_config.json``'s ``base_model_name_or_path``: a hub id, a local folder or a built-in model),
unless ``--model`` says otherwise. With a plain adapter folder (no run folder around it) the stop set
is the model's own EOS tokens (and ``--teacher``'s, as in training) and the cap ``--max-new-tokens``.

Outside this project the adapter is a standard PEFT adapter::

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B-Base"), "runs/<run>/round-050")
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 512


@dataclass(frozen=True)
class AdapterSource:
    """An adapter folder and what the run it came from says about using it."""

    adapter: Path
    model: str  # the base model, as configured
    teacher: str | None  # its EOS tokens join the stop set, as in training
    stop_tokens: str  # rollout.stop-tokens of the run ('auto' without a run)
    max_new_tokens: int | None  # eval.max-new-tokens of the run
    run: Path | None
    resolved_stop: dict | None = None  # the run's resolved stop set (config.json), {"ids": [...], "tokens": [...]}


def _round_folders(run: Path) -> list[Path]:
    return sorted(p for p in run.glob("round-[0-9][0-9][0-9]") if p.is_dir())


def find_adapter(path: str | Path, round: int | None = None, client: int | None = None, model: str | None = None) -> AdapterSource:
    """The adapter to load: ``path`` is a run folder (its last ``round-NNN``, or ``round``; a Local
    run's ``client-<client>`` inside it) or an adapter folder. Raises ``ValueError`` naming what is
    missing."""
    from fedopd.models.lora import ADAPTER_CONFIG

    path = Path(path)
    run = path if (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file() else None
    if run is None and not (path / ADAPTER_CONFIG).is_file():
        raise ValueError(f"'{path}' is neither a run folder (config.json, round-NNN/) nor a PEFT adapter folder ({ADAPTER_CONFIG})")
    config: dict[str, Any] = {}
    if run is not None:
        config = json.loads((run / "config.json").read_text())
        rounds = _round_folders(run)
        if not rounds:
            raise ValueError(f"run folder '{run}' has no round-NNN adapter folder")
        folder = run / f"round-{round:03d}" if round is not None else rounds[-1]
        if not folder.is_dir():
            raise ValueError(f"run folder '{run}' has no round {round}; it has rounds {', '.join(str(int(p.name[6:])) for p in rounds)}")
        clients = sorted(p.name for p in folder.glob("client-*") if (p / ADAPTER_CONFIG).is_file())
        if client is not None:
            folder = folder / f"client-{client}"
        elif not (folder / ADAPTER_CONFIG).is_file() and clients:
            raise ValueError(f"'{folder}' holds one adapter per client (a Local run): choose one with --client ({', '.join(clients)})")
        if not (folder / ADAPTER_CONFIG).is_file():
            raise ValueError(f"'{folder}' is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    else:
        if round is not None or client is not None:
            raise ValueError("--round and --client choose inside a run folder; this is an adapter folder")
        folder = path
    named = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    base = model or config.get("model.student") or named
    if not base:
        raise ValueError(f"'{folder / ADAPTER_CONFIG}' names no base model: give --model")
    return AdapterSource(
        adapter=folder,
        model=str(base),
        teacher=config.get("model.teacher"),
        stop_tokens=str(config.get("rollout.stop-tokens", "auto")),
        max_new_tokens=config.get("eval.max-new-tokens"),
        run=run,
        resolved_stop=(config.get("resolved") or {}).get("rollout.stop-tokens") if model is None else None,
    )


class Answerer:
    """A base model with an adapter loaded, answering questions in the training prompt format."""

    def __init__(self, source: AdapterSource, student, engine, stop) -> None:
        self.source, self.student, self.engine, self.stop = source, student, engine, stop

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        round: int | None = None,
        client: int | None = None,
        model: str | None = None,
        teacher: str | None = None,
        dtype: str = "auto",
    ) -> Answerer:
        """Load the base model and the adapter (:func:`find_adapter`); no vLLM, no training state."""
        from eval.run import evaluation_stop_tokens, lora_settings_of
        from fedopd.models import attach_lora, load_causal_lm
        from fedopd.models.lora import load_adapter
        from fedopd.models.vocab import StopTokens
        from fedopd.rollout import make_rollout_engine

        source = find_adapter(path, round, client, model)
        if source.resolved_stop and teacher is None:  # the very stop set the run used, no teacher file read
            stop = StopTokens(tuple(int(i) for i in source.resolved_stop["ids"]), tuple(source.resolved_stop["tokens"]))
        else:
            stop = evaluation_stop_tokens(source.model, teacher or source.teacher, source.stop_tokens)
        student = attach_lora(load_causal_lm(source.model, dtype=dtype), lora_settings_of(source.adapter), seed=0)
        engine = make_rollout_engine("hf", student, stop_token_ids=stop.ids)
        engine.set_adapter(load_adapter(source.adapter, student.lora_names()))
        return cls(source, student, engine, stop)

    def __call__(self, question: str, **kwargs: Any) -> str:
        return self.answer([question], **kwargs)[0]

    def answer(
        self, questions: Sequence[str], *, max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
    ) -> list[str]:
        """One answer per question: greedy (``temperature`` 0) or sampled, up to ``max_new_tokens``
        (default: the run's ``eval.max-new-tokens``, else :data:`DEFAULT_MAX_NEW_TOKENS`)."""
        from fedopd.data import render_prompt
        from fedopd.rollout import SamplingParams

        tok = self.student.tokenizer
        ids = [tok(render_prompt(tok, q), add_special_tokens=False)["input_ids"] for q in questions]
        cap = int(max_new_tokens or self.source.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
        out = self.engine.generate(ids, SamplingParams(cap, temperature, top_p, seed))
        return tok.batch_decode(out.response_ids, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.ask", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a run folder (its last adapter) or a PEFT adapter folder")
    p.add_argument("question", nargs="+", help="the question(s); '-' reads one question per line from stdin")
    p.add_argument("--round", type=int, help="the run's adapter of this round (default: the last)")
    p.add_argument("--client", type=int, help="a Local run's client adapter")
    p.add_argument("--model", help="the base model (default: the one the run or the adapter names)")
    p.add_argument("--teacher", help="a teacher whose EOS tokens join the stop set (default: the run's)")
    p.add_argument("--max-new-tokens", type=int, help=f"answer cap (default: the run's eval.max-new-tokens, else {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, as held-out greedy accuracy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        p.error("--temperature must be >= 0, --top-p in (0, 1], --max-new-tokens >= 1")
    questions = [line.strip() for line in sys.stdin if line.strip()] if args.question == ["-"] else args.question
    from fedopd.core.errors import ModelLoadError

    try:
        find_adapter(args.path, args.round, args.client, args.model)  # every path problem before a model is loaded
        ask = Answerer.load(args.path, round=args.round, client=args.client, model=args.model, teacher=args.teacher, dtype=args.dtype)
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"# {ask.source.adapter} on {ask.source.model}; stops at {list(ask.stop.tokens)}", file=sys.stderr)
    answers = ask.answer(questions, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for question, answer in zip(questions, answers):
        print(answer if len(questions) == 1 else f"Q: {question}\nA: {answer}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
