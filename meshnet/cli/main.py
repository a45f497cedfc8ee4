"""The ``meshnet`` command. Heavy imports (torch, transformers) stay inside commands."""

from __future__ import annotations

import typer

from meshnet.cli import models, ops, serve, services, timings, traffic

app = typer.Typer(name="meshnet", no_args_is_help=True, add_completion=False,
                  help="meshnet: a distributed LLM inference network. Nodes serve layer shards of a "
                       "transformer; a tracker covers every model and routes chat across nodes.")
app.add_typer(models.app, name="models")
services.node_app.command("timings")(timings.timings)
app.add_typer(services.node_app, name="node")
app.add_typer(services.tracker_app, name="tracker")
app.command("serve")(serve.serve)
for name, fn in ops.COMMANDS.items():
    app.command(name)(fn)
app.command("traffic")(traffic.traffic)


@app.command("tui")
def tui(url: str = typer.Option(None, "--url", envvar="MESHNET_URL", help="Tracker URL."),
        token: str = typer.Option(None, "--token", envvar="MESHNET_OPERATOR_TOKEN", help="Operator token."),
        readonly: bool = typer.Option(False, "--readonly", help="Hide every mutating action."),
        interval: float = typer.Option(2.0, "--interval", min=0.2, help="Refresh interval, seconds."),
        theme: str = typer.Option("textual-dark", "--theme", help="Textual theme name.")) -> None:
    """Open the operator console (Textual) on a tracker."""
    from meshnet.cli.output import tracker_url
    from tui.app import MeshnetConsole

    MeshnetConsole(url=tracker_url(url), token=token, readonly=readonly, interval_s=interval, theme=theme).run()


def main() -> None:
    """The ``meshnet`` executable: :data:`app`, with any :class:`~meshnet.errors.MeshnetError` a
    command did not handle itself (a broken presets file, a state directory in use…) printed as its
    one-line message and hint, exit status 1, instead of a traceback."""
    from meshnet.cli.output import report
    from meshnet.errors import MeshnetError

    try:
        app()
    except MeshnetError as exc:
        report(exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
