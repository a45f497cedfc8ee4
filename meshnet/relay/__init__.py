"""The relay (ADR-0045): a reverse tunnel that lets an unreachable node serve through a reachable host.

- :mod:`frames`: the tunnel's framing (one WebSocket carries many channels).
- :mod:`hub`: the relay side: tunnels by node id, and the routes that expose a node as
  ``{relay}/v1/relay/{node_id}/...`` (the tracker, or a node started with ``--offer-relay``).
- :mod:`auth`: who may attach, for a relay without a registry (a node offering relay).
- :mod:`tunnel`: the node side: keeps one outbound tunnel open and replays what comes through
  it against the node's own listener.
- :mod:`backoff`: bounded, jittered retry delays (the tunnel and the tracker agent).
"""
