"""Held-out evaluation arithmetic: greedy accuracy from greedy responses, Avg@k / Pass@k from samples."""

from fedopd.config import EvalSettings
from fedopd.data import Prompt
from fedopd.engine.heldout import evaluate_heldout
from fedopd.engine.round import ClientModels
from fedopd.rollout import RolloutEngine, Rollouts


class Tok:
    """Token ids are characters; decoding joins them."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in r) for r in ids]


class Student:
    tokenizer = Tok()


class Scripted(RolloutEngine):
    """Greedy: problem 0 right, problem 1 wrong. Samples (k = 2): 0 -> right, right; 1 -> right, wrong."""

    GREEDY = {"1": "\\boxed{1}", "2": "\\boxed{7}"}
    SAMPLED = {"1": ["\\boxed{1}", "\\boxed{1}"], "2": ["\\boxed{2}", "\\boxed{9}"]}

    def set_adapter(self, arrays):
        self.adapter = arrays

    def generate(self, prompts, params):
        if params.temperature == 0:
            texts = [self.GREEDY[chr(p[0])] for p in prompts]
        else:
            assert (params.temperature, params.top_p) == (1.0, 0.8)
            seen = {}
            texts = []
            for p in prompts:
                i = seen.get(p[0], 0)
                texts.append(self.SAMPLED[chr(p[0])][i])
                seen[p[0]] = i + 1
        return Rollouts([list(p) for p in prompts], [[ord(c) for c in t] for t in texts], [False] * len(prompts))


def test_accuracy_is_greedy_and_avg_and_pass_at_k_come_from_the_samples():
    prompts = [Prompt("one", "1", "g", (ord("1"),)), Prompt("two", "2", "g", (ord("2"),))]
    engine = Scripted()
    out = evaluate_heldout(ClientModels(Student(), None, engine), {"a": 1}, prompts, EvalSettings(samples=2), seed=0)
    assert engine.adapter == {"a": 1}
    # Means of 0/1 over 2 or 4 values and 1 − C(0, 2)/C(2, 2) are dyadic: exact in float64.
    assert out["accuracy"] == 50.0  # 1 of 2 greedy answers right
    assert out["avg@2"] == 75.0  # 3 of 4 samples right
    assert out["pass@2"] == 100.0  # both problems solved at least once
