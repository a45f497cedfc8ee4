"""A node's identity: its Ed25519 key, made on first start and kept in its state directory.

The tracker binds the node id to the public key at the first registration (ADR-0035); the
node proves it is that node by signing its calls. Losing ``node.key`` means losing the id.
The key file is PKCS#8 PEM, mode 0600, at ``<state_dir>/node.key`` (default state dir:
``<MESHNET_CACHE or ~/.cache/meshnet>/nodes/<node_id>``).

One process at a time runs a node from a state directory: it holds an exclusive lock on
``<state_dir>/node.lock`` while it runs (:func:`lock_state_dir`; the operating system releases
it when the process ends, however it ends). A second process started with the same id on the
same host would otherwise sign as the first and take its record over at the tracker.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet import keyfile
from meshnet.errors import MeshnetError
from meshnet.models.sources import cache_dir

KEY_FILE = "node.key"
LOCK_FILE = "node.lock"


def default_state_dir(node_id: str) -> Path:
    """``<MESHNET_CACHE or ~/.cache/meshnet>/nodes/<node_id>``."""
    return cache_dir() / "nodes" / node_id


def load_or_create_key(state_dir: Path) -> Ed25519PrivateKey:
    """The node's private key from ``state_dir/node.key``, made (mode 0600) when there is none
    (atomically: two processes starting with the same state dir end up with the same key).

    Raises:
        MeshnetError (``node_key``): the directory cannot be created or the file cannot be read,
            or it holds no Ed25519 private key.
    """
    return keyfile.load_or_create_key(Path(state_dir) / KEY_FILE, code="node_key",
                                      hint="check --state-dir; a node keeps its key there (mode 0600)")


def lock_state_dir(state_dir: Path, node_id: str) -> int:
    """Take the exclusive lock of ``state_dir`` for this process; returns the lock file's
    descriptor (closing it releases the lock).

    Raises:
        MeshnetError (409 ``node_id_in_use``): another live process on this host holds it: a node
            with this id (and its key) runs already.
    """
    path = Path(state_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MeshnetError(f"node {node_id} runs already on this host (its state directory {state_dir} is in use)",
                           code="node_id_in_use", status=409,
                           hint="stop the other process, or start this one with another --node-id (and --state-dir)")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
