"""LoRA factor arithmetic in the coordinates that cross the wire, and PEFT adapter folders.

θ is a mapping from factor name to fp32 numpy array: every LoRA A and B factor of the student,
named as in PEFT's saved state dict (:meth:`fedopd.models.CausalLM.lora_names`) and as the keys of
the ``ArrayRecord`` that carries it. Factors are matched by name, never by position (several
factors share a shape). Aggregation and server scaling act on these factors directly (paper App.
"Coordinate-level meaning for LoRA"): no merging, no re-factorization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

Named = dict[str, np.ndarray]


def from_record(record: Mapping[str, Any]) -> Named:
    """Named fp32 arrays from an ``ArrayRecord`` (or any mapping of array-likes), in its key order."""
    return {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float32) for k, v in record.items()}


def name_mismatch(expected: Sequence[str], got: Sequence[str]) -> str | None:
    """The first difference between two ordered name lists, as a sentence, or None."""
    expected_set, got_set = set(expected), set(got)
    missing = [n for n in expected if n not in got_set]
    unexpected = [n for n in got if n not in expected_set]
    if missing:
        return f"factor '{missing[0]}' is missing ({len(missing)} missing in all)"
    if unexpected:
        return f"factor '{unexpected[0]}' is not in the adapter ({len(unexpected)} unknown in all)"
    return None


def check_compatible(reference: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray]) -> str | None:
    """Why ``other`` cannot be combined with ``reference`` (names, shapes, non-finite), or None."""
    problem = name_mismatch(list(reference), list(other))
    if problem:
        return problem
    for name, r in reference.items():
        o = np.asarray(other[name])
        if o.shape != r.shape:
            return f"factor '{name}' has shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        if not np.all(np.isfinite(o)):
            return f"factor '{name}' has non-finite values"
    return None


def _require_same_names(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    problem = name_mismatch(list(a), list(b))
    if problem:
        raise ValueError(f"LoRA factors do not match: {problem}")


def increment(new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray]) -> Named:
    """Δ = new − old, per named factor (in ``old``'s order)."""
    _require_same_names(old, new)
    return {k: np.asarray(new[k], dtype=np.float32) - np.asarray(o, dtype=np.float32) for k, o in old.items()}


def apply_increment(theta: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], multiplier: float) -> Named:
    """θ + aΔ, per named factor, in fp32 (in ``theta``'s order)."""
    _require_same_names(theta, delta)
    a = np.float32(multiplier)
    return {k: np.asarray(t, dtype=np.float32) + a * np.asarray(delta[k], dtype=np.float32) for k, t in theta.items()}


# ---------------------------------------------------------------------------------------------
# Adapter folders (PEFT format)
# ---------------------------------------------------------------------------------------------


def save_adapter(path: str | Path, arrays: Mapping[str, np.ndarray], config) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).

    Needs no model: the server writes the global adapter from the named arrays it aggregated.
    ``config`` is the ``peft.LoraConfig`` (:func:`lora_config`).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: np.ascontiguousarray(a, dtype=np.float32) for n, a in arrays.items()}, str(path / ADAPTER_WEIGHTS))
    config.save_pretrained(str(path))
    return path


def load_adapter(path: str | Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Read a PEFT adapter folder into named fp32 arrays, in ``names`` order when given."""
    from safetensors.numpy import load_file

    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"adapter folder '{path}' has no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(weights))
    names = list(names) if names is not None else list(tensors)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"adapter '{path}' lacks {len(missing)} factors, e.g. '{missing[0]}'")
    return {n: tensors[n].astype(np.float32) for n in names}


# ---------------------------------------------------------------------------------------------
# Aggregation error of averaging the factors (paper App. "Coordinate-level meaning for LoRA")
# ---------------------------------------------------------------------------------------------


def lora_modules(names: Sequence[str]) -> list[tuple[str, str]]:
    """(A name, B name) of every LoRA module in ``names`` (PEFT's ``…lora_A.…`` / ``…lora_B.…``)."""
    present = set(names)
    pairs = []
    for name in names:
        if ".lora_A." in name:
            partner = name.replace(".lora_A.", ".lora_B.")
            if partner not in present:
                raise ValueError(f"LoRA factor '{name}' has no B factor '{partner}'")
            pairs.append((name, partner))
    if not pairs:
        raise ValueError("no LoRA A/B factor pairs among the adapter's names")
    return pairs


def product_gram(factor_sets: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """M[k, l] = Σ over LoRA modules of ⟨B_k A_k, B_l A_l⟩_F for the adapters ``factor_sets``.

    Never forms a d_out × d_in product: ⟨B_k A_k, B_l A_l⟩_F = tr(B_kᵀB_l · A_l A_kᵀ), a sum over
    the elementwise product of two r × r Gram blocks. Float64 throughout. ‖Σ_k c_k B_k A_k‖_F² over
    all modules is then cᵀMc.
    """
    m = len(factor_sets)
    gram = np.zeros((m, m))
    for a_name, b_name in lora_modules(list(factor_sets[0])):
        sa, sb = np.shape(factor_sets[0][a_name]), np.shape(factor_sets[0][b_name])
        if len(sa) != 2 or len(sb) != 2 or sb[1] != sa[0]:
            raise ValueError(f"'{a_name}' {sa} and '{b_name}' {sb} are not LoRA factors A (r × d_in) and B (d_out × r)")
        r = sa[0]
        a = np.concatenate([np.asarray(f[a_name], dtype=np.float64) for f in factor_sets])  # (m·r, d_in)
        b = np.concatenate([np.asarray(f[b_name], dtype=np.float64) for f in factor_sets], axis=1)  # (d_out, m·r)
        # block (k, l) of bᵀb is B_kᵀB_l, of a aᵀ is A_kA_lᵀ = (A_lA_kᵀ)ᵀ: tr(XY) = Σ X ∘ Yᵀ. np.einsum
        # without BLAS: these (m·r)² products are small, and a multi-threaded BLAS on a busy server
        # host is ~50× slower than one thread.
        product = (np.einsum("ok,ol->kl", b, b) * np.einsum("ki,li->kl", a, a)).reshape(m, r, m, r)
        gram += product.sum(axis=(1, 3))
    return gram


def _combination_norm(gram: np.ndarray, coefficients: Sequence[float]) -> float:
    c = np.asarray(coefficients, dtype=np.float64)
    return float(np.sqrt(max(float(c @ gram @ c), 0.0)))  # ≥ 0 up to float64 rounding


def aggregation_gram(theta: Mapping[str, np.ndarray], clients: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> np.ndarray:
    """The Gram matrix of the n + 3 product terms that the round's aggregation errors combine.

    With w_i the normalised weights, B̄ = Σ_i w_i B_i, Ā = Σ_i w_i A_i, ΔB = B̄ − B_t and ΔA = Ā − A_t,
    the terms are (B_i − B̄)(A_i − Ā) for each client i, then ΔB ΔA, ΔB A_t and B_t ΔA. Every
    quantity :func:`aggregation_errors_from_gram` needs is a short combination of them:

    * Σ_i w_i B_i A_i − B̄Ā = C, with C = Σ_i w_i (B_i − B̄)(A_i − Ā) (the cross terms vanish since
      Σ_i w_i (B_i − B̄) = 0);
    * Σ_i w_i B_i A_i − B_t A_t = C + ΔB ΔA + ΔB A_t + B_t ΔA.

    Built from differences of factors, not of products, so nothing of size ‖BA‖ cancels: the
    errors keep float64's relative precision however small the update is next to θ_t (taking
    cᵀMc over the products themselves loses digits in proportion to ‖BA‖² / ‖error‖²).
    """
    if not clients or len(clients) != len(weights):
        raise ValueError("aggregation_errors: one weight per client, at least one client")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("aggregation_errors: weights must be positive")
    w = w / w.sum()
    t = {k: np.asarray(v, dtype=np.float64) for k, v in theta.items()}
    cs = [{k: np.asarray(c[k], dtype=np.float64) for k in t} for c in clients]
    mean = {k: sum(wi * c[k] for wi, c in zip(w, cs)) for k in t}
    delta = {k: mean[k] - t[k] for k in t}
    modules = lora_modules(list(t))

    def product(b_from: Mapping[str, np.ndarray], a_from: Mapping[str, np.ndarray]) -> Named:  # the factors of B·A, per module
        return {n: f[n] for a_name, b_name in modules for n, f in ((a_name, a_from), (b_name, b_from))}

    terms = [{k: c[k] - mean[k] for k in t} for c in cs] + [product(delta, delta), product(delta, t), product(t, delta)]
    return product_gram(terms)


def aggregation_errors_from_gram(gram: np.ndarray, weights: Sequence[float], multiplier: float | None = None) -> dict[str, float | None]:
    """``mean`` and ``applied`` of :func:`aggregation_errors` from :func:`aggregation_gram` (cheap:
    a strategy builds the Gram once per round and evaluates any multiplier from it)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    change = _combination_norm(gram, [*w, 1.0, 1.0, 1.0])
    error = _combination_norm(gram, [*w, 0.0, 0.0, 0.0])
    out: dict[str, float | None] = {"mean": error / change if change > 0 else None, "applied": None}
    if multiplier is not None and float(multiplier) != 0.0 and change > 0:
        out["applied"] = _combination_norm(gram, [*w, 1.0 - float(multiplier), 0.0, 0.0]) / change
    return out


def aggregation_errors(
    theta: Mapping[str, np.ndarray],
    clients: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    multiplier: float | None = None,
) -> dict[str, float | None]:
    """What averaging the LoRA factors separately costs in this round, over all LoRA modules.

    With P = BA per module, P_t of θ_t, P_i of client i's update and w_i the normalised weights:

    * ``mean``: ‖Σ_i w_i P_i − B̄Ā‖_F / ‖Σ_i w_i P_i − P_t‖_F, where B̄ = Σ_i w_i B_i and Ā = Σ_i w_i A_i
      (the error of the average of the products that FedAvg's factor average makes, relative to
      the update that averaging the products would make);
    * ``applied``: the same for the adapter θ_t + aΔ_t applied at a = ``multiplier``, whose factors
      are B' = B_t + a(B̄ − B_t), A' = A_t + a(Ā − A_t), against the target P_t + a(Σ_i w_i P_i − P_t):
      ‖P_t + a(Σ_i w_i P_i − P_t) − B'A'‖_F / ‖a(Σ_i w_i P_i − P_t)‖_F. Expanding, the numerator is
      |a| ‖C + (1 − a) ΔB ΔA‖_F (:func:`aggregation_gram`), so at a = 1 it is ``mean``. B'A' is
      taken in exact arithmetic: the fp32 rounding of the stored adapter (~1e-7 relative) is not
      an error of the aggregation.

    None where the denominator is 0 (no client moved the product, or a = 0, or no multiplier
    given). Computed from r × r Gram matrices, never forming a d_out × d_in product.
    """
    return aggregation_errors_from_gram(aggregation_gram(theta, clients, weights), weights, multiplier)
