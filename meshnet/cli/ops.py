"""Client commands against a running tracker: chat, coverage, nodes, directives, demand, and the
operator actions pin, reload, doctor, drain."""

from __future__ import annotations

import json
import sys
import time

import httpx
import typer
from rich.table import Table

from meshnet.cli.output import (JsonOpt, TokenOpt, UrlOpt, console, emit, fail, human_bytes, run, tracker_url,
                                tracker_urls)
from meshnet.client import ANSWER_DEADLINE_S, NodeClient, TrackerClient, error_from_response
from meshnet.errors import MeshnetError


def _client(url: str | None, token: str | None = None) -> TrackerClient:
    return TrackerClient(tracker_url(url), token=token, timeout_s=30.0)


async def _call(url, method: str, *args, token=None, **kw):
    async with _client(url, token) as c:
        return await getattr(c, method)(*args, **kw)


def chat(prompt: str = typer.Argument(..., help="The user message."),
         url: str = UrlOpt,
         model: str = typer.Option(None, "--model", "-m",
                                   help="Model id (default: the default preset, or the tracker's routable model)."),
         stream: bool = typer.Option(True, "--stream/--no-stream", help="Print tokens as they arrive."),
         max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Tokens to generate at most."),
         temperature: float = typer.Option(0.0, "--temperature", min=0.0, max=2.0, help="0 = greedy (OpenAI's range: 0-2)."),
         seed: int = typer.Option(None, "--seed", help="Sampling seed."),
         system: str = typer.Option(None, "--system", help="Optional system message."),
         as_json: bool = JsonOpt) -> None:
    """Ask the network a question (OpenAI chat completions through the tracker)."""
    from meshnet.presets import default_model

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    urls = _answering_first(tracker_urls(url))
    body = {"model": model or _served_model(urls, default_model()), "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "stream": stream and not as_json}
    for i, base in enumerate(urls):  # every tracker of one database: the next when one does not answer
        endpoint = f"{base}/v1/chat/completions"
        try:
            _chat_at(endpoint, body, as_json)
            return
        except httpx.ConnectError as exc:
            if i + 1 < len(urls):
                continue
            fail(MeshnetError(f"cannot reach {endpoint}: {exc}", hint="is `meshnet serve` running? see --url"))
        except httpx.HTTPError as exc:
            fail(MeshnetError(f"cannot reach {endpoint}: {exc}", hint="is `meshnet serve` running? see --url"))
        except MeshnetError as exc:
            fail(exc)


def _chat_at(endpoint: str, body: dict, as_json: bool) -> None:
    """One chat request at ``endpoint``, printed as it streams (or whole, with ``--json``).

    Raises:
        httpx.HTTPError: the tracker cannot be reached. MeshnetError: it answered with an error.
    """
    if not body["stream"]:
        resp = httpx.post(endpoint, json=body, timeout=600.0)
        if resp.status_code != 200:
            raise error_from_response(resp)
        data = resp.json()
        emit(data, as_json, lambda d: console.print(d["choices"][0]["message"]["content"]))
        return
    final = None
    with httpx.stream("POST", endpoint, json=body, timeout=600.0) as resp:
        if resp.status_code != 200:
            resp.read()
            raise error_from_response(resp)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise MeshnetError(chunk["error"]["message"])
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
            final = chunk if chunk.get("meshnet") else final
    sys.stdout.write("\n")
    if final:
        m = final["meshnet"]
        hops = " → ".join(f"{h['node_id']}[{h['start_layer']}-{h['end_layer']}]" for h in m["route"])
        console.print(f"[dim]route: {hops} · decode {m['decode_tokens_per_s']} tokens/s[/]", highlight=False)


def _answering_first(urls: list[str]) -> list[str]:
    """``urls`` (every tracker of one database) from the first that answers ``GET /v1/health``
    within :data:`~meshnet.client.ANSWER_DEADLINE_S`, so a hung one costs one deadline, never
    the chat's own long timeout (ADR-0054); unchanged when there is one URL or none answers."""
    if len(urls) < 2:
        return urls
    for i, url in enumerate(urls):
        try:
            httpx.get(f"{url}/v1/health", timeout=ANSWER_DEADLINE_S)
        except httpx.HTTPError:
            continue
        return urls[i:] + urls[:i]
    return urls


def _served_model(urls: list[str], fallback: str) -> str:
    """The model to ask when --model is not given: the default preset if the tracker (the first of
    ``urls`` that answers) routes it, else the first routable model it lists, else the default preset."""
    models = None
    for url in urls:
        try:
            models = httpx.get(f"{url}/v1/models", timeout=ANSWER_DEADLINE_S).json()["data"]
            break
        except (httpx.ConnectError, httpx.TimeoutException):
            continue
        except (httpx.HTTPError, ValueError, KeyError):
            return fallback
    if models is None:
        return fallback
    routable = [m["id"] for m in models if m.get("routable")]
    return fallback if fallback in routable or not routable else routable[0]


def coverage(model: str = typer.Argument(None, help="Model (default: all tracked)."), url: str = UrlOpt,
             as_json: bool = JsonOpt) -> None:
    """Show each model's coverage map (segments of layers with their node counts)."""
    data = run(_call(url, "coverage", model))
    models = [data] if model else data["models"]

    def human(_):
        for m in models:
            badge = "[green]routable[/]" if m["routable"] else "[red]not routable[/]"
            console.print(f"[bold]{m['model']}[/] {m['covered_layers']}/{m['num_layers']} layers {badge} "
                          f"demand {m.get('demand', 0):.2f}/min")
            for s in m["segments"]:
                colour = "red" if s["node_count"] == 0 else "green"
                console.print(f"  layers {s['start_layer']:>3}-{s['end_layer']:<3} [{colour}]{s['node_count']} node(s)[/]")

    emit(data, as_json, human)


def nodes(url: str = UrlOpt, as_json: bool = JsonOpt) -> None:
    """List nodes: memory budget, max assignable layers, shard slots, ranges with tier, and why."""
    data = run(_call(url, "nodes"))

    def human(rows):
        table = Table("node", "endpoint", "budget", "max layers", "slots", "shards (tier)", "tok/s", "hb age", "reason")
        for n in rows:
            maxl = ", ".join(f"{k}: {v}" for k, v in n["max_assignable_layers"].items())
            name = n["node_id"] + (" (draining)" if n.get("draining") else "")
            if n.get("quarantine"):
                name += " [red](quarantined)[/]"
            shards = ", ".join(f"{s['model']} {s['shard_start']}-{s['shard_end']} ({s['tier']}"
                               f"{'' if s['admitted'] else ', not admitted'}"
                               f"{', ' + s['verification']['state'] if s.get('verification') else ''})"
                               for s in n["shards"]) or "-"
            endpoint = n["endpoint"] if n.get("reachable", True) else \
                f"{n['endpoint']} [red]unreachable: {n.get('reach_error', '')}[/]"
            table.add_row(name, endpoint, human_bytes(n["memory_budget_bytes"]), maxl,
                          f"{n['slots_used']}/{n['slots_total']}", shards,
                          f"{(n['stats'] or {}).get('tokens_per_s', 0):.1f}", f"{n['last_heartbeat_age_s']} s",
                          n["reason"] or "")
        console.print(table)
        for n in rows:
            q = n.get("quarantine")
            if q:
                console.print(f"[red]{n['node_id']} quarantined[/] over {q['model']} {q['shard_start']}-{q['shard_end']}"
                              f" (reported by {q['reported_by']}; witnesses {', '.join(q['witnesses'])}; distances "
                              f"{q['distances']}; tolerance {q['tolerance']}): `meshnet reinstate {n['node_id']}` lifts it")
            for s in n["shards"]:
                v = s.get("verification") or {}
                if v.get("state") == "rejected":
                    console.print(f"[yellow]{n['node_id']} {s['model']} {s['shard_start']}-{s['shard_end']} "
                                  f"rejected[/]: {v['reason']}")

    emit(data, as_json, human)


def directives(url: str = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Show the directive log (LOAD_SHARD, DROP_SHARD, RUN_DOCTOR, RELOAD) and each status."""
    data = run(_call(url, "directives"))

    def human(rows):
        table = Table("id", "node", "type", "model", "layers", "tier", "status", "error", "age")
        now = time.time()
        for d in rows:
            layers = f"{d['shard_start']}-{d['shard_end']}" if d["shard_start"] is not None else "-"
            table.add_row(str(d["id"]), d["node_id"], d["type"], d["model"] or "-", layers, d["tier"] or "-",
                          d["status"], d["error"] or "", f"{now - d['created_at']:.0f} s")
        console.print(table)

    emit(data, as_json, human)


def demand(url: str = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Show queued demand per model (requests/min for models that were not routable)."""
    data = run(_call(url, "demand"))

    def human(d):
        table = Table("model", "requests/min", "routable")
        for row in d["demand"]:
            table.add_row(row["model"], f"{row['requests_per_min']:.2f}", "yes" if row["routable"] else "no")
        console.print(table)

    emit(data, as_json, human)


def pin(model: str = typer.Argument(..., help="Model preset."),
        node: str = typer.Option(..., "--node", help="Node id."),
        shard: str = typer.Option(None, "--shard", help="Inclusive layer range 'a-b' (default: first gap)."),
        url: str = UrlOpt, token: str = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Pin a model (and optionally a layer range) to a node; never retargeted by placement."""
    data = run(_call(url, "pin", model, node, shard, token=token))
    emit(data, as_json, lambda d: console.print(f"pinned {d['pinned']['model']} "
                                                f"{d['pinned']['shard_start']}-{d['pinned']['shard_end']} to {node}"))


def unpin(model: str = typer.Argument(..., help="Model preset."),
          node: str = typer.Option(..., "--node", help="Node id."),
          url: str = UrlOpt, token: str = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Forget a pin: the node no longer gets that shard back when it restarts (it keeps serving it now)."""
    data = run(_call(url, "unpin", model, node, token=token))
    emit(data, as_json, lambda d: console.print(f"unpinned {d['unpinned']['model']} from {node}"))


def reload(node: str = typer.Argument(..., help="Node id."), url: str = UrlOpt, token: str = TokenOpt,
           as_json: bool = JsonOpt) -> None:
    """Reload a node's shards (its reports go stale until doctor passes again)."""
    data = run(_call(url, "reload", node, token=token))
    emit(data, as_json, lambda d: console.print(f"RELOAD queued for {node} (directive {d['directive']['id']})"))


def doctor(node: str = typer.Option(None, "--node", help="Run remotely on this node through the tracker."),
           model: str = typer.Option(None, "--model", "-m", help="Local run: model to check (default: preset)."),
           shard: str = typer.Option(None, "--shard", help="Local run: inclusive range 'a-b' (default: all)."),
           dtype: str = typer.Option("bfloat16", "--dtype", help="Local run: compute dtype."),
           quantization: str = typer.Option("bfloat16", "--quantization",
                                            help="Local run: recipe (bfloat16, int8, int4, nf4)."),
           url: str = UrlOpt, token: str = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Prove a shard works with a real forward pass and measure it (capability report)."""
    if node:
        reports = run(_call(url, "doctor", node, token=token))["reports"]
    else:
        reports = [_local_doctor(model, shard, dtype, quantization)]

    def human(rs):
        for r in rs:
            mark = "[green]PASS[/]" if r["passed"] else "[red]FAIL[/]"
            console.print(f"{mark} {r['model']} layers {r['shard_start']}-{r['shard_end']} "
                          f"{r['recipe']['quantization']}/{r['recipe']['compute_dtype']} "
                          f"{r['tokens_per_s']} tokens/s on {r['hardware']['device']} — {r['reason']}")
            resident = r.get("resident_bytes")
            console.print(f"  weights digest {r['weights_digest']}"
                          + (f" · {human_bytes(resident)} resident" if resident else ""), style="dim")

    emit(reports, as_json, human)
    if not all(r["passed"] for r in reports):
        raise typer.Exit(1)


def _local_doctor(model: str | None, shard: str | None, dtype: str, quantization: str) -> dict:
    from meshnet.layers import LayerRange
    from meshnet.models.sources import resolve
    from meshnet.node.doctor import run_doctor
    from meshnet.node.runtime import NodeRuntime
    from meshnet.presets import default_model, get_preset

    try:
        preset = get_preset(model or default_model())
        layers = LayerRange.parse(shard) if shard else LayerRange(0, preset.num_layers)
        with console.status(f"loading {preset.name} layers {layers}"):
            runtime = NodeRuntime(compute_dtype=dtype)
            slot = runtime.load(preset.name, resolve(preset.name), layers, quantization=quantization)
        return run_doctor(slot).model_dump()
    except (MeshnetError, ValueError) as exc:
        fail(exc if isinstance(exc, MeshnetError) else MeshnetError(str(exc)))


def drain(node: str = typer.Argument(..., help="Node id."), url: str = UrlOpt, token: str = TokenOpt,
          as_json: bool = JsonOpt) -> None:
    """Drain a node: no new routes or placements go to it."""
    data = run(_call(url, "drain", node, token=token))
    emit(data, as_json, lambda d: console.print(f"{node} draining"))


def reinstate(node: str = typer.Argument(..., help="Node id."), url: str = UrlOpt, token: str = TokenOpt,
              as_json: bool = JsonOpt) -> None:
    """Lift a node's quarantine (a spot-check outvoted it; `meshnet nodes` shows the evidence)."""
    data = run(_call(url, "reinstate", node, token=token))
    emit(data, as_json, lambda d: console.print(f"{node} reinstated" if d["reinstated"]
                                                else f"{node} was not quarantined"))


def trust(node: str = typer.Argument(..., help="Node id."),
          revoke: bool = typer.Option(False, "--revoke", help="No longer trust the node."),
          url: str = UrlOpt, token: str = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Trust a node you run (ADR-0069): its shards are verified on your word, its weights digest
    becomes the one others of its range and recipe must match, and it is the first reference of
    their challenges. Kept by the tracker across restarts."""
    data = run(_call(url, "trust", node, not revoke, token=token))
    emit(data, as_json, lambda d: console.print(
        f"{node} {'trusted' if d['trusted'] else 'no longer trusted'}" + ("" if d["changed"] else " (already so)")))


def ready(url: str = UrlOpt,
          node: str = typer.Option(None, "--node", help="Ask the node at this URL instead of the tracker."),
          model: str = typer.Option(None, "--model", "-m", help="Tracker: ask about this model only."),
          as_json: bool = JsonOpt) -> None:
    """Readiness: can a chat be served now? Exit 0 when ready, 1 with the reasons when not."""

    async def ask() -> dict:
        if node:
            async with NodeClient(node, timeout_s=10.0) as c:
                return await c.ready()
        async with _client(url) as c:
            return await c.ready(model)

    data = run(ask())

    def human(d):
        if d["ready"]:
            console.print("[green]ready[/]")
        else:
            console.print("[red]not ready[/]")
            for reason in d["reasons"]:
                console.print(f"  - {reason}", highlight=False)

    emit(data, as_json, human)
    if not data["ready"]:
        raise typer.Exit(1)


COMMANDS = {"chat": chat, "coverage": coverage, "nodes": nodes, "directives": directives, "demand": demand,
            "pin": pin, "unpin": unpin, "reload": reload, "doctor": doctor, "drain": drain, "reinstate": reinstate, "trust": trust,
            "ready": ready}
