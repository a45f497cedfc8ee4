"""A node's identity: its Ed25519 key, made on first start and kept in its state directory.

The tracker binds the node id to the public key at the first registration (ADR-0035); the
node proves it is that node by signing its calls. Losing ``node.key`` means losing the id.
The key file is PKCS#8 PEM, mode 0600, at ``<state_dir>/node.key`` (default state dir:
``<MESHNET_CACHE or ~/.cache/meshnet>/nodes/<node_id>``).
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet import keyfile
from meshnet.models.sources import cache_dir

KEY_FILE = "node.key"


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
