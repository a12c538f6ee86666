"""The default (sandbox) and tiny presets reproduce, byte for byte, the adapters and records saved
before the code was restructured (tests/golden/record.py made them)."""

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))
from record import fingerprint, platform_key, run_preset  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("preset", ["sandbox", "tiny"])
def test_a_preset_reproduces_its_saved_adapters_and_records(preset, tmp_path):
    saved = json.loads((GOLDEN / f"{preset}.json").read_text())
    if saved["platform"] != platform_key():
        pytest.skip(f"saved on {saved['platform']}, this is {platform_key()}: fp32 kernels round differently elsewhere")
    got = fingerprint(run_preset(preset, str(tmp_path)))
    assert got["records"] == saved["records"]
    assert got["adapters"] == saved["adapters"]
