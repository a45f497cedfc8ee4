"""Preparing a model into the cache (meshnet.models.sources): locked per model and atomic.

Three processes that resolve the same model on an empty cache at once all get the same complete
directory: one builds it, the others wait for its lock and find it ready. A build that fails
leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet.models import sources

RESOLVE = "from meshnet.models.sources import resolve; print(resolve('tiny-llama'))"


def digest(directory: Path) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


def test_processes_preparing_one_model_at_once_share_one_complete_build(tmp_path):
    env = {"MESHNET_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    target = tmp_path / "models" / "tiny-llama"
    assert {out.strip() for out, _ in outs} == {str(target)}
    assert sources.is_ready(target)
    leftovers = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert leftovers == ["tiny-llama", "tiny-llama.lock"]  # no temporary directory stays
    built = digest(target)
    again = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and digest(target) == built  # found ready: not rebuilt


def test_a_build_that_fails_leaves_no_directory_behind(tmp_path):
    target = tmp_path / "models" / "broken"
    target.parent.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="conversion failed"), sources.model_lock(target):
        with sources.building(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("conversion failed")
    assert sorted(p.name for p in target.parent.iterdir()) == ["broken.lock"]
