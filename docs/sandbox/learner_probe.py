"""Probe of the sandbox learner: does the student improve on its held-out problems within the default
run's budget (8 rounds x 32 sequences, mini-batch 4 = 64 AdamW steps, betas (0.9, 0.999), weight
decay 0.01, clipping at 1, cosine from ``--lr`` without warmup unless ``--warmup``), one learner on
one client's prompts, and does the answer depend on where the sequences come from?

    python docs/sandbox/learner_probe.py --loss rkl --params lora --source student   # the method's learner
    python docs/sandbox/learner_probe.py --loss rkl --params lora --source teacher   # same, teacher's samples
    python docs/sandbox/learner_probe.py --loss ce --params full --source teacher    # plain SFT, full weights

``rkl``: token-mean reverse KL to the teacher over the full vocabulary (the method's loss); ``ce``:
cross-entropy on the sampled tokens. ``lora``: rank ``--rank``, alpha 2 x rank on every linear
projection (the method's adapter); ``full``: every weight. Sequences are sampled at temperature 1
from the teacher or from the student being trained (on-policy). Held-out greedy accuracy and Avg@8
(the run's evaluation) are printed at rounds 0, 2, 4, 6, 8. A plain loop written out here, not the
app's: with ``--loss rkl --params lora`` it reproduces the app's learner (docs/sandbox.md, "The sandbox").
Single-threaded; about a minute per call on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from client_app.worker import setup, setup_heldout
from fedopd.config import LoraSettings, parse_run_config
from fedopd.config.presets import app_defaults
from fedopd.data import round_indices
from fedopd.engine.heldout import evaluate_heldout
from fedopd.engine.round import ClientModels, derive_seed
from fedopd.models import attach_lora, load_causal_lm
from fedopd.rollout import HFRolloutEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", choices=("rkl", "ce"), default="rkl")
    ap.add_argument("--params", choices=("lora", "full"), default="lora")
    ap.add_argument("--source", choices=("student", "teacher"), default="student")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=0, help="linear warmup steps (the method has none)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9, no weight decay")
    ap.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    ap.add_argument("--mini-batch", type=int, default=4)
    ap.add_argument("--student", default="builtin:sandbox-student", help="model.student: a builtin name or a folder")
    ap.add_argument("--partition", type=int, default=1, help="client 0 addition, 1 multiplication, 2 expressions")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = parse_run_config({**app_defaults(), "eval.prompts-per-client": 32, "model.student": args.student})
    models, prompts = setup(cfg, args.partition, 3)
    _, held = setup_heldout(cfg, args.partition, 3)
    teacher = models.teacher
    student = load_causal_lm(cfg.model.student, dtype="float32", device=torch.device("cpu"))
    if args.params == "lora":
        student = attach_lora(student, LoraSettings(rank=args.rank, alpha=2.0 * args.rank), 0)
        params = [p for p in student.model.parameters() if p.requires_grad]
    else:
        params = list(student.model.parameters())
        for p in params:
            p.requires_grad_(True)
    rounds, per_round, mini = 8, 32, args.mini_batch
    total = rounds * per_round // mini
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=args.eps, weight_decay=0.01)

    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    own = HFRolloutEngine(student)
    own.set_adapter = lambda arrays: None  # it samples from the weights being trained
    engine = HFRolloutEngine(teacher) if args.source == "teacher" else own
    pad = student.tokenizer.pad_token_id or 0
    width = student.logit_width

    def evaluate() -> tuple[float, float]:
        student.model.eval()
        with torch.no_grad():
            e = evaluate_heldout(ClientModels(student, teacher, own), {}, held, cfg.eval, 0)
        return round(e["accuracy"], 1), round(e["avg@8"], 1)

    seed = derive_seed(cfg.seed, args.partition)
    results = {0: evaluate()}
    print(f"round 0: held-out greedy {results[0][0]}% avg@8 {results[0][1]}%", flush=True)
    for r in range(1, rounds + 1):
        batch = [prompts[i] for i in round_indices(len(prompts), r, per_round, seed)]
        with torch.no_grad():
            ro = engine.generate([p.token_ids for p in batch], SamplingParams(128, 1.0, 1.0, derive_seed(seed, r, 1)))
        student.model.train()
        for k in range(0, per_round, mini):
            seqs = [ro.prompt_ids[i] + ro.response_ids[i] for i in range(k, k + mini)]
            length = max(map(len, seqs))
            ids = torch.full((mini, length), pad)
            mask = torch.zeros((mini, length), dtype=torch.long)
            predicts = torch.zeros((mini, length), dtype=torch.bool)  # positions that predict a response token
            for i, seq in enumerate(seqs):
                ids[i, : len(seq)] = torch.tensor(seq)
                mask[i, : len(seq)] = 1
                predicts[i, len(ro.prompt_ids[k + i]) - 1 : len(seq) - 1] = True
            logp = F.log_softmax(student.model(input_ids=ids, attention_mask=mask).logits.float()[..., :width], -1)[predicts]
            if args.loss == "ce":
                loss = -logp.gather(1, ids[:, 1:][predicts[:, :-1]][:, None]).mean()
            else:
                with torch.no_grad():
                    logq = F.log_softmax(teacher.model(input_ids=ids, attention_mask=mask).logits.float()[..., :width], -1)[predicts]
                loss = (logp.exp() * (logp - logq)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
        if r % 2 == 0:
            results[r] = evaluate()
            print(f"round {r}: held-out greedy {results[r][0]}% avg@8 {results[r][1]}%", flush=True)
    print(json.dumps({**vars(args), "greedy": {r: v[0] for r, v in results.items()}, "avg@8": {r: v[1] for r, v in results.items()}}))


if __name__ == "__main__":
    main()
