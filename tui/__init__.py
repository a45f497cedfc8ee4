"""meshnet operator console (Textual).

The console is a client: it talks to the tracker only over HTTP through
:class:`meshnet.client.TrackerClient` and never imports tracker internals. Headless
modules under ``meshnet/`` never import this package or textual.

Layout:
    app.py          :class:`MeshnetConsole`: bindings, views (modes), the polling worker
    actions.py      operator actions (pin, doctor, reload, drain) behind confirmation modals
    connection.py   connection state and back-off (pure)
    state.py        what the console knows: the last snapshot plus bounded histories (pure)
    format.py       text helpers: ages, bytes, sparklines, layer counts (pure)
    screens/        one view per file (coverage, nodes, directives, demand, help)
    modals/         confirm, pin form, doctor report
    widgets/        top bar, layer bar, gauge
"""
