"""The ids that cross modules, as distinct types (``typing.NewType`` over ``str``: free at run time).

- :data:`NodeId`: a node's id, bound to its key at its first registration (ADR-0035).
- :data:`SessionId`: a generation's KV-cache session on a hop: 32 hex characters (a uuid);
  on a hop stream the chain id is the session id of that chain on every hop (ADR-0040).
- :data:`ModelName`: a model's canonical name (:func:`meshnet.presets.canonical_model_name`).

A type checker then refuses a node id where a session id is expected; nothing is checked at run
time (the wire formats validate what arrives).
"""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
SessionId = NewType("SessionId", str)
ModelName = NewType("ModelName", str)

__all__ = ["ModelName", "NodeId", "SessionId"]
