"""``meshnet models list | pull``."""

from __future__ import annotations

import typer
from rich.table import Table

from meshnet.cli.output import JsonOpt, console, emit, fail, human_bytes
from meshnet.errors import MeshnetError

app = typer.Typer(help="Model presets and the local weights cache.", no_args_is_help=True)


@app.command("list")
def list_models(as_json: bool = JsonOpt) -> None:
    """List model presets (layer counts and sizes known without any network call)."""
    from meshnet.models.sources import is_ready, model_dir
    from meshnet.presets import all_presets, default_model

    rows = []
    for p in all_presets().values():
        rows.append({"name": p.name, "hf_repo": p.hf_repo, "family": p.family, "num_layers": p.num_layers,
                     "hidden_size": p.hidden_size, "bytes_per_layer": p.bytes_per_layer,
                     "source": p.source.get("kind"), "default": p.name == default_model(),
                     "cached": is_ready(model_dir(p.name)), "cache_dir": str(model_dir(p.name))})

    def human(data):
        table = Table("name", "family", "layers", "hidden", "bf16/layer", "source", "cached")
        for r in data:
            name = r["name"] + (" (default)" if r["default"] else "")
            table.add_row(name, r["family"], str(r["num_layers"]), str(r["hidden_size"]),
                          human_bytes(r["bytes_per_layer"].get("bfloat16")), r["source"], "yes" if r["cached"] else "no")
        console.print(table)

    emit(rows, as_json, human)


@app.command("pull")
def pull(name: str = typer.Argument(None, help="Preset name, hub repo id or local directory (default: the default preset)."),
         as_json: bool = JsonOpt) -> None:
    """Fetch a model and convert it once into the local safetensors cache."""
    from meshnet.models.sources import resolve
    from meshnet.presets import default_model

    name = name or default_model()
    try:
        with console.status(f"pulling {name}") as status:
            path = resolve(name, progress=lambda msg: status.update(f"{name}: {msg}"))
    except MeshnetError as exc:
        fail(exc)
    emit({"model": name, "path": str(path)}, as_json, lambda d: console.print(f"[green]✓[/] {name} ready at {d['path']}"))
