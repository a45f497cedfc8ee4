"""A node's identity: its Ed25519 key, made on first start and kept in its state directory.

The tracker binds the node id to the public key at the first registration (ADR-0035); the
node proves it is that node by signing its calls. Losing ``node.key`` means losing the id.
The key file is PKCS#8 PEM, mode 0600, at ``<state_dir>/node.key`` (default state dir:
``<MESHNET_CACHE or ~/.cache/meshnet>/nodes/<node_id>``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import MeshnetError
from meshnet.models.sources import cache_dir

log = logging.getLogger(__name__)

KEY_FILE = "node.key"


def default_state_dir(node_id: str) -> Path:
    """``<MESHNET_CACHE or ~/.cache/meshnet>/nodes/<node_id>``."""
    return cache_dir() / "nodes" / node_id


def load_or_create_key(state_dir: Path) -> Ed25519PrivateKey:
    """The node's private key from ``state_dir/node.key``, made (mode 0600) when there is none.

    Creation is atomic (a temporary file linked into place), so two processes starting with the
    same state dir end up with the same key.

    Raises:
        MeshnetError (``node_key``): the directory cannot be created or the file cannot be read,
            or it holds no Ed25519 private key.
    """
    path = Path(state_dir) / KEY_FILE
    try:
        if not path.exists():
            _create(path)
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise MeshnetError(f"cannot use the node key {path}: {type(exc).__name__}: {exc}", code="node_key",
                           hint="check --state-dir; a node keeps its key there (mode 0600)") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise MeshnetError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key", code="node_key")
    if path.stat().st_mode & 0o077:
        log.warning("node key %s is readable by other users; chmod 600 it", path)
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)  # fails if another process made it first: use theirs
            log.info("made a new node key at %s", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
