"""The data plane: what moves activations between processes, torch-free (ADR-0049).

- :mod:`~meshnet.dataplane.frames`: the activation frame (ADR-0001): header, dtype codes, zstd
  rules and limits, and a numpy reader. :mod:`meshnet.node.wire` is the nodes' torch adapter.
- :mod:`~meshnet.dataplane.frames`: hop stream messages (OPEN, STEP, RESULT, ERROR, BUNDLE)
  and their header, chain id and chain key (ADR-0040, ADR-0049).
- :mod:`~meshnet.dataplane.transport`: one node's outbound WebSocket streams, one per peer,
  shared by every session, and bundling of the messages sent together (ADR-0040).
- :mod:`~meshnet.dataplane.evidence`: comparing two holders' frames (ADR-0042).

Layering: the gateway, the node and the tracker use it; it uses only the protocol (and numpy,
zstandard, websockets). The import-linter contracts in pyproject.toml hold it there.
"""
