"""Ed25519 private keys kept in files: made once, atomically, mode 0600 (ADR-0035, ADR-0038).

A node keeps its identity key in its state directory (:mod:`meshnet.node.identity`); the
tracker keeps the key that signs session tickets next to its sqlite store
(:mod:`meshnet.tracker.tickets`). Service-free: both services use it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import MeshnetError

log = logging.getLogger(__name__)


def load_or_create_key(path: Path, *, code: str = "node_key", hint: str = "") -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (PKCS#8 PEM), made (mode 0600) when there is none.

    Creation is atomic (a temporary file linked into place), so two processes starting at once
    end up with the same key.

    Raises:
        MeshnetError (``code``): the directory cannot be created, the file cannot be read, or it
            holds no Ed25519 private key.
    """
    path = Path(path)
    try:
        if not path.exists():
            _create(path)
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise MeshnetError(f"cannot use the key {path}: {type(exc).__name__}: {exc}", code=code,
                           hint=hint or None) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise MeshnetError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key", code=code)
    if path.stat().st_mode & 0o077:
        log.warning("key %s is readable by other users; chmod 600 it", path)
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)  # fails if another process made it first: use theirs
            log.info("made a new key at %s", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
