"""Import boundaries (STYLE.md): the tracker and the client import without torch, and nothing
in meshnet imports textual. Each check runs in a fresh interpreter so this test session's own
imports cannot hide a violation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "textual", "tui")


def imported_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; which of HEAVY ended up in ``sys.modules``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("modules", ["meshnet.tracker.app, meshnet.client",
                                     "meshnet.protocol.openai, meshnet.presets, meshnet.errors, meshnet.layers",
                                     "meshnet.protocol.control, meshnet.protocol.route, meshnet.protocol.http",
                                     "meshnet.gateway.openai_api, meshnet.gateway.pipeline, meshnet.dataplane.hops",
                                     "meshnet.localmesh, meshnet.cli.main"])
def test_torch_free_modules(modules):
    loaded = imported_after(f"import {modules}")
    assert loaded == {"torch": False, "transformers": False, "textual": False, "tui": False}


def test_no_meshnet_module_imports_textual():
    code = ("import importlib, pkgutil, meshnet\n"
            "for info in pkgutil.walk_packages(meshnet.__path__, 'meshnet.'):\n"
            "    importlib.import_module(info.name)")
    loaded = imported_after(code)
    assert loaded["torch"] is True  # the walk really reached the node and model modules
    assert loaded["textual"] is False and loaded["tui"] is False
