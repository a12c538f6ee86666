"""Packed micro-batches never attend across sequences.

A packed row [A; B] (``attention_mask=None``, position ids restarting at 0 for B) must give B
the hidden states of B alone, whatever A holds. Under SDPA / eager that rests on transformers
building a block-diagonal mask from the restarting position ids, which transformers < 5 does only
with torch >= 2.6; ``packed_rows_isolated`` encodes that and ``use_packing`` refuses
``train.packing = "packed"`` where it does not hold. The forward test checks the installed
versions both ways: isolation where the helper claims it, a real leak where it refuses.
"""

import pytest
import torch

from fedopd.distill.opd import packed_rows_isolated, use_packing
from fedopd.models import CausalLM, resolve_model_path

# fp32 machine epsilon (2^-23). B alone and B inside [A; B] are the same arithmetic in a different
# order of roundings (other row length: other matmul / softmax blocking); masked-out keys add an
# exact 0. Each of the model's ~20 ops per layer (2 layers, reductions of width <= 384) contributes
# a few eps of relative error, so the two agree to a few tens of eps times the states' scale (about
# 2-3 eps measured). 64 eps bounds that; a leak moves B's states by O(1) (about 2 measured), some
# 10^5 times more.
EPS = torch.finfo(torch.float32).eps
LEN_A, LEN_B = 37, 29


def positions(*lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def student(request):
    """The trained sandbox student in fp32 on the CPU. Loaded without its tokenizer (not needed
    here, and saved in a format transformers < 5 cannot read), so the test runs on every version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("builtin:sandbox-student"), dtype=torch.float32, attn_implementation=request.param
    ).eval()
    lm = CausalLM(model, None, torch.device("cpu"), torch.float32, int(model.config.vocab_size), "builtin:sandbox-student")
    assert lm.attn_implementation == request.param
    return lm


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, 333, (1, n), generator=g)  # noqa: E731 (the sandbox vocabulary: 333)
    return draw(LEN_A), draw(LEN_A), draw(LEN_B)


def b_states(lm, a, b, position_ids):
    """B's final hidden states inside the packed row [a; b] (attention_mask None)."""
    with torch.no_grad():
        return lm.hidden_states(torch.cat([a, b], 1), None, position_ids)[0, a.shape[1] :]


def leak_and_error(lm, tokens, position_ids):
    """(max |B in [A;B] − B alone|, max |B in [A;B] − B in [A';B]|, tolerance)."""
    a, a2, b = tokens
    with torch.no_grad():
        alone = lm.hidden_states(b, None, positions(LEN_B))[0]
    packed = b_states(lm, a, b, position_ids)
    other_a = b_states(lm, a2, b, position_ids)
    tol = 64 * EPS * float(alone.abs().max())
    return float((packed - alone).abs().max()), float((packed - other_a).abs().max()), tol


@pytest.mark.slow
def test_packed_row_isolates_its_sequences(student, tokens):
    isolated, why = packed_rows_isolated(student.attn_implementation)
    vs_alone, vs_other_a, tol = leak_and_error(student, tokens, positions(LEN_A, LEN_B))
    if isolated:
        assert vs_alone <= tol, f"B in [A;B] differs from B alone by {vs_alone:.3g} > {tol:.3g} ({why})"
        assert vs_other_a <= tol, f"B in [A;B] changes with A's tokens by {vs_other_a:.3g} > {tol:.3g} ({why})"
    else:  # the helper refuses packing here: the leak it predicts is real
        assert vs_other_a > 1e3 * tol, f"helper refuses packing but B does not depend on A ({why})"


@pytest.mark.slow
def test_a_row_whose_positions_do_not_restart_is_one_sequence(student, tokens):
    """The check above can fail: without the restart, B sees A (and is not B alone)."""
    vs_alone, vs_other_a, tol = leak_and_error(student, tokens, positions(LEN_A + LEN_B))
    assert vs_alone > 1e3 * tol and vs_other_a > 1e3 * tol


# --- the version gate ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tf, th, isolated",
    [
        ("4.57.6", "2.5.1", False),
        ("4.57.1", "2.5.1+cu124", False),
        ("4.57.6", "2.6.0", True),
        ("4.57.6", "2.6.0a0+git1234", True),
        ("4.57.6", "2.13.0+cpu", True),
        ("5.0.0", "2.5.1", True),
        ("5.23.0", "2.13.0", True),
    ],
)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_rows_isolated_by_version(impl, tf, th, isolated):
    ok, why = packed_rows_isolated(impl, transformers_version=tf, torch_version=th)
    assert ok is isolated
    assert f"transformers {tf}" in why and f"torch {th}" in why


def test_flash_attention_isolates_and_unknown_attention_is_not_trusted():
    assert packed_rows_isolated("flash_attention_2", transformers_version="4.57.6", torch_version="2.5.1")[0]
    assert not packed_rows_isolated("some_kernel", transformers_version="5.23.0", torch_version="2.13.0")[0]


class _Model:
    attn_implementation = "sdpa"


def test_packed_is_refused_where_packed_rows_would_leak(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(ValueError) as err:
        use_packing(_Model(), "packed")
    message = str(err.value)
    for needle in ("train.packing", "transformers 4.57.6", "torch 2.5.1", "'padded'", "flash-attention 2", "torch >= 2.6"):
        assert needle in message
    assert not use_packing(_Model(), "padded") and not use_packing(_Model(), "auto")  # never refused


def test_packed_is_accepted_where_packed_rows_are_isolated(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    assert use_packing(_Model(), "packed")
