"""The built-in worlds that need no download: the CPU sandbox (a synthetic step-by-step arithmetic
task and small trained Qwen3 models) and the random tiny models. Imports only :mod:`fedopd.core`
(``train.py``, a command, uses the layers above).

* :mod:`fedopd.sandbox.tiny`: ``builtin:tiny-student`` and ``builtin:tiny-teacher``, built on first use.
* :mod:`fedopd.sandbox.task`: the ``sandbox`` data (three skill groups that share sub-skills).
* :mod:`fedopd.sandbox.train`: ``python -m fedopd.sandbox.train`` regenerates the shipped
  ``builtin:sandbox-teacher`` and ``builtin:sandbox-student`` from a seed.
"""

import sys
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
SANDBOX_MODELS = ("sandbox-teacher", "sandbox-student")
WEIGHTS = "model.safetensors"


def sandbox_model_path(name: str) -> Path:
    """The shipped folder of ``builtin:<name>`` (a ``save_pretrained`` folder in the package).

    ``flwr run`` ships the app to its ClientApps as a FAB, and Flower's FAB format admits no
    weight files (nor ``.jinja`` templates); there the folder next to this module holds only the
    JSON files, so the complete folder is looked up in the installed ``fedtops`` package on
    ``sys.path`` (the editable install's source tree, or site-packages).
    """
    from fedopd.core.errors import ModelLoadError

    if name not in SANDBOX_MODELS:
        raise ModelLoadError(f"unknown sandbox model 'builtin:{name}'; allowed: " + ", ".join(f"builtin:{n}" for n in SANDBOX_MODELS))
    roots = [MODELS_DIR] + [Path(entry or ".") / "fedopd" / "sandbox" / "models" for entry in sys.path]
    for root in roots:
        if (root / name / WEIGHTS).is_file():
            return root / name
    raise ModelLoadError(
        f"built-in model 'builtin:{name}' has no {WEIGHTS} in {MODELS_DIR} or in an installed fedtops package; "
        "install the project on this host (pip install -e .) or regenerate the models with: python -m fedopd.sandbox.train"
    )
