"""The vocabulary every meshnet service shares, torch-free and dependent on none of them.

- :mod:`meshnet.protocol.control`: node ↔ tracker payloads (registration, heartbeats,
  directives, capability reports, stats), tiers and recipes.
- :mod:`meshnet.protocol.route`: hops and routes, one type and one JSON form.
"""
