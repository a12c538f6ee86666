"""The client's learning-rate schedule across rounds: one cosine over the run's local steps."""

import numpy as np
import pytest
from client_messages import LR, OVERRIDES, client_context, initial_theta, train

from fedopd.config import parse_run_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]


def test_round_two_continues_the_cosine_schedule_without_warmup():
    cfg = parse_run_config(OVERRIDES)
    context = client_context(cfg)
    theta1, m1 = train(context, initial_theta(cfg), 1)
    _, m2 = train(context, theta1, 2)
    # lr(step) = LR · ½(1 + cos(π · step / 4)), evaluated in float64 then used by torch in fp32
    # (within 2^-24 relative); round 1 takes steps 0, 1; round 2 steps 2, 3.
    rel = 2**-24
    assert m1["lr_first"] == pytest.approx(LR, rel=rel)
    assert m1["lr_last"] == pytest.approx(LR * 0.5 * (1 + np.cos(np.pi / 4)), rel=rel)
    assert m2["lr_first"] == pytest.approx(LR * 0.5, rel=rel)
    assert m2["lr_last"] == pytest.approx(LR * 0.5 * (1 + np.cos(3 * np.pi / 4)), rel=rel)
