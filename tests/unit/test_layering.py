"""The package layering (pyproject's [tool.importlinter] contracts) holds, and is really checked:
a module that imports across a forbidden edge breaks it (torch at import time: test_imports.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_layering_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize("module, imports, contract", [
    ("meshnet/tracker/_probe.py", "from meshnet.node import runtime", "the tracker depends on the protocol"),
    ("meshnet/protocol/_probe.py", "import meshnet.tracker.service", "the protocol depends on no meshnet service"),
    ("meshnet/gateway/_probe.py", "import meshnet.node.runtime", "services are layered"),
    ("meshnet/gateway/_probe.py", "import torch", "the gateway knows the entry node's layers only"),
    ("tui/_probe.py", "import meshnet.tracker.app", "the console reaches meshnet only through"),
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, imports, contract):
    for name in ("meshnet", "tui"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / module).write_text(f'"""A deliberate layering violation."""\n{imports}\n')
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.rstrip().endswith("BROKEN")
              or line.strip() == "code BROKEN"]
    assert broken, result.stdout
    assert contract in result.stdout.split("Broken contracts")[1]

