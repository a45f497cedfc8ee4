"""The vocabulary every meshnet service shares, torch-free and dependent on none of them.

- :mod:`meshnet.protocol.control`: node ↔ tracker payloads (registration, heartbeats,
  directives, capability reports, stats), tiers and recipes.
- :mod:`meshnet.protocol.route`: hops and routes, one type and one JSON form.
- :mod:`meshnet.protocol.openai`: the OpenAI chat request types.
- :mod:`meshnet.protocol.http`: the error envelope, JSON body validation, the body limit.
- :mod:`meshnet.protocol.signing`: signatures of node calls (ADR-0035).
- :mod:`meshnet.protocol.views`: coverage maps as operators read them.
"""
