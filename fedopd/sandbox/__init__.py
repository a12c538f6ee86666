"""The CPU sandbox: a synthetic step-by-step arithmetic task and small trained Qwen3 models.

* :mod:`fedopd.sandbox.task`: the ``sandbox`` data (three skill groups that share sub-skills).
* :mod:`fedopd.sandbox.train`: ``python -m fedopd.sandbox.train`` regenerates the shipped
  ``builtin:sandbox-teacher`` and ``builtin:sandbox-student`` from a seed.
"""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
SANDBOX_MODELS = ("sandbox-teacher", "sandbox-student")


def sandbox_model_path(name: str) -> Path:
    """The shipped folder of ``builtin:<name>`` (a ``save_pretrained`` folder in the package)."""
    from fedopd.models import ModelLoadError

    path = MODELS_DIR / name
    if name not in SANDBOX_MODELS or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"built-in model 'builtin:{name}' is not in {MODELS_DIR}; regenerate the sandbox models "
            "with: python -m fedopd.sandbox.train"
        )
    return path
