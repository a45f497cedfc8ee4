"""``meshnet models list | add | pull | certify``."""

from __future__ import annotations

from pathlib import Path

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
        where = Path(p.source["path"]).expanduser() if p.source.get("kind") == "local" else model_dir(p.name)
        rows.append({"name": p.name, "hf_repo": p.hf_repo, "family": p.family, "num_layers": p.num_layers,
                     "hidden_size": p.hidden_size, "bytes_per_layer": p.bytes_per_layer,
                     "source": p.source.get("kind"), "default": p.name == default_model(),
                     "cached": is_ready(where), "cache_dir": str(where)})

    def human(data):
        table = Table("name", "family", "layers", "hidden", "bf16/layer", "source", "cached")
        for r in data:
            name = r["name"] + (" (default)" if r["default"] else "")
            table.add_row(name, r["family"], str(r["num_layers"]), str(r["hidden_size"]),
                          human_bytes(r["bytes_per_layer"].get("bfloat16")), r["source"], "yes" if r["cached"] else "no")
        console.print(table)

    emit(rows, as_json, human)


@app.command("add")
def add(source: str = typer.Argument(..., help="Hub repository id (e.g. Qwen/Qwen3-0.6B) or local model directory."),
        name: str = typer.Option(None, "--name", help="Preset name (default: the source's last part, lower case)."),
        as_json: bool = JsonOpt) -> None:
    """Add a model to the presets from its config.json: its family, layer count, hidden size and
    bytes per layer per recipe (counted from one layer built on the meta device; no weights are
    fetched). The preset goes to the added presets file; every command of this machine then knows
    the model by its name. Exits 1 when no certified family serves the model or the name is taken."""
    from dataclasses import asdict

    from meshnet.models.catalog import add_preset, preset_for

    try:
        with console.status(f"reading {source}'s config") as status:
            preset = preset_for(source, name, progress=lambda msg: status.update(f"{source}: {msg}"))
        path = add_preset(preset)
    except MeshnetError as exc:
        fail(exc)

    def human(d):
        sizes = ", ".join(f"{k} {human_bytes(v)}" for k, v in d["bytes_per_layer"].items())
        console.print(f"[green]✓[/] added {d['name']} ({d['family']}, {d['num_layers']} layers, hidden "
                      f"{d['hidden_size']}; per layer: {sizes}) to {d['presets_file']}")

    emit({**asdict(preset), "presets_file": str(path)}, as_json, human)


@app.command("pull")
def pull(name: str = typer.Argument(None, help="Preset name, hub repo id or local directory (default: the default preset)."),
         as_json: bool = JsonOpt) -> None:
    """Fetch a model into the local cache (a hub model's safetensors, a GGUF file with its config,
    tokenizer and tensor index, or a seeded random model built from its config)."""
    from meshnet.models.sources import resolve
    from meshnet.presets import default_model

    name = name or default_model()
    try:
        with console.status(f"pulling {name}") as status:
            path = resolve(name, progress=lambda msg: status.update(f"{name}: {msg}"))
    except MeshnetError as exc:
        fail(exc)
    emit({"model": name, "path": str(path)}, as_json, lambda d: console.print(f"[green]✓[/] {name} ready at {d['path']}"))


@app.command("certify")
def certify(name: str = typer.Argument(None, help="Preset name, hub repo id or local directory (default: the default preset)."),
            splits: str = typer.Option(None, "--splits",
                                       help="Splits to check, ';'-separated, each the first layers of the shards "
                                            "after the first (e.g. '10;10,20'); default: every boundary into two "
                                            "shards and a few three-shard splits."),
            prompt_tokens: int = typer.Option(300, "--prompt-tokens", min=1, help="Random prompt length, tokens."),
            decode_tokens: int = typer.Option(40, "--decode-tokens", min=1, help="Greedy tokens decoded after it."),
            device: str = typer.Option("cpu", "--device",
                                       help="Where the whole model and the shards run: cpu, cuda, cuda:N or auto."),
            as_json: bool = JsonOpt) -> None:
    """Check split parity: the model split into shards (each its own shard model and KV cache,
    chunked prefill then decode across them, float32) gives the whole transformers model's logits
    (max |diff| <= 1e-4) and greedy tokens. Exits 1 when a split differs or the model's family is
    not the one its preset names."""
    from rich.progress import Progress

    from meshnet.models.certify import TOLERANCE, check_family, certify as run_certify
    from meshnet.models.sources import resolve
    from meshnet.presets import default_model, find_preset

    name = name or default_model()
    try:
        chosen = None if splits is None else [tuple(int(b) for b in s.split(",")) for s in splits.split(";") if s]
    except ValueError:
        fail(MeshnetError(f"--splits {splits!r}: each split is comma-separated layer numbers, splits are ';'-separated"))
    preset = find_preset(name)
    try:
        from meshnet.models.devices import resolve_device

        device = resolve_device(device)
        with console.status(f"preparing {name}") as status:
            path = resolve(name, progress=lambda msg: status.update(f"{name}: {msg}"))
        family = check_family(path, preset.family if preset else None)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"certifying {name} ({family})", total=None)
            results = run_certify(path, splits=chosen, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                                  device=device, progress=lambda done, total: bar.update(task, completed=done, total=total))
    except MeshnetError as exc:
        fail(exc)
    rows = [{"split": list(r.boundaries), "max_abs_diff": r.max_abs_diff, "tokens_decided": r.tokens_decided,
             "tokens_matched": r.tokens_matched, "passed": r.passed} for r in results]

    def human(data):
        table = Table("split (shards start at)", "max |Δ logit|", "tokens equal", "verdict",
                      title=f"{name}: {family}, {prompt_tokens}-token prompt + {decode_tokens} decoded, float32 "
                            f"on {device}")
        for r in data:
            table.add_row("0, " + ", ".join(map(str, r["split"])), f"{r['max_abs_diff']:.2e}",
                          f"{r['tokens_matched']}/{r['tokens_decided']}", "[green]ok[/]" if r["passed"] else "[red]DIFFERS[/]")
        console.print(table)
        console.print(f"logits equal within {TOLERANCE:g}; tokens compared where the whole model's top two "
                      f"logits differ by more than that (a near tie may go either way on other kernels)")

    emit(rows, as_json, human)
    if not all(r["passed"] for r in rows):
        raise typer.Exit(1)
