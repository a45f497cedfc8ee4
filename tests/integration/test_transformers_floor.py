"""meshnet runs on the oldest transformers its pyproject allows: 5.17, the version the GPU image
of the device machine ships (KINDS.md). transformers 5.17 with its huggingface_hub are installed
into a scratch directory from the package registry, and the families' split-parity tests and the
shard tests run on them in a child process (transformers 5.17's decoder layers name their cache
``past_key_values``, its Qwen3.5 rotary takes three position axes and its linear-attention
modules read ``cache.layers[i]``: each is met by meshnet's own code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLOOR, HUB = "5.17.0", "1.33.0"


def test_the_pyproject_floor_is_the_version_tested_here():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"transformers>=([0-9.]+),<6"', pyproject).group(1) + ".0" == FLOOR


def test_families_and_shards_pass_on_the_floor_transformers(tmp_path):
    target = tmp_path / "floor"
    got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          f"transformers=={FLOOR}", f"huggingface_hub=={HUB}"], capture_output=True, text=True,
                         timeout=600)
    if got.returncode != 0:
        pytest.skip(f"the package registry did not give transformers {FLOOR}: {got.stderr.strip()[-300:]}")
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_families.py",
                          "tests/unit/test_shard.py", "-k", "not certified"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"], env=env,
                             capture_output=True, text=True, timeout=120).stdout.strip()
    assert version == FLOOR
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"\d+ passed", run.stdout)
