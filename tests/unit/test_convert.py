"""GGUF conversion prerequisites: a missing package is named in the error, not guessed."""

from __future__ import annotations

import importlib.util

import pytest

from meshnet.errors import ModelSourceError
from meshnet.models import convert


def test_every_gguf_requirement_is_installed():
    # both are declared dependencies of meshnet; a fresh `make venv` must provide them
    assert convert.missing_gguf_requirements() == []


def test_missing_accelerate_is_named_in_the_error_and_hint(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ModelSourceError) as info:
        convert.prepare_gguf(gguf, tmp_path / "out", say=lambda msg: None)
    assert info.value.message == "cannot convert model.Q4_1.gguf: missing package(s) accelerate"
    assert info.value.hint == "pip install accelerate (declared in meshnet's dependencies)"
    assert not (tmp_path / "out").exists()
