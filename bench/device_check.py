"""The device check of issue 25, parts (b)-(d); ``bench/device_check.sh`` runs it after the parity tests.

Every model here is built from a config with seeded random weights (real weights cannot travel to
the lent machine). On ``--device`` (``cuda`` on the GPU machine, ``cpu`` here):

  (b) a tracker and three node processes serving ``tiny-llama`` on the device in float32: the
      greedy tokens of a chat equal transformers' ``generate`` of the whole model on the same
      device in float32;
  (c) decode tokens/s of a three-process mesh in bfloat16 beside ``generate`` of the whole model
      on the same device, for 1 and 8 sessions at once: a Llama of about 1.2 B parameters on a GPU,
      a small one on the CPU (``--speed-model``); the mesh idles while ``generate`` runs; medians
      of ``--runs`` runs, client-timed: tokens over the time from the first to the last token;
  (d) one nf4 shard's doctor on the device (bitsandbytes), with its error against float32.

Prints one line per figure and a JSON summary last. Usage:
  python bench/device_check.py [--device cuda] [--speed-model auto|1b|small] [--runs 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: the speed models: about 1.2 B parameters (a Llama 3.2 1B's shape, fewer vocabulary rows), and a
#: small one for a CPU run
SPEED_CONFIGS = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
    "small": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 4096},
}
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse in a storm."}]
NO_END = {"2": -100}  # the byte tokenizer's end token: random weights decode the whole budget


def say(line: str) -> None:
    print(line, flush=True)


def mesh_of(log_dir: Path, model: str, device: str, dtype: str, ranges: list[tuple[int, int]]):
    """A tracker (serving no layers) and one node process per range of ``model`` on ``device``."""
    from meshnet.localmesh import LocalMesh

    mesh = LocalMesh(log_dir, heartbeat_s=1.0)
    mesh.start_tracker(model, node_timeout_s=10.0)
    for i, (a, b) in enumerate(ranges):
        mesh.start_node(f"n{i}", "--model", model, "--shard-start", str(a), "--shard-end", str(b), "--device", device,
                        "--dtype", dtype, "--wire-dtype", dtype, "--spot-check-rate", "0", threads=2)
    mesh.wait_routable(model, 300)
    return mesh


def chat(url: str, model: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": model, "messages": STORY, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_END}
    if not stream:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()
    times, usage = [], {}
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if event.get("choices"):
                    times.append(time.perf_counter())
    return {"tokens": usage.get("completion_tokens", 0), "first": times[0], "last": times[-1]}


def equal_to_generate(device: str, log_dir: Path) -> dict:
    """(b): three float32 processes on ``device`` give ``generate``'s greedy tokens."""
    import torch
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    from meshnet.models.sources import resolve
    from meshnet.node.entry import chat_token_ids

    model = "tiny-llama"
    path = resolve(model)
    mesh = mesh_of(log_dir / "equal", model, device, "float32", [(0, 1), (2, 2), (3, 3)])
    try:
        got = chat(mesh.url, model, 24)["meshnet"]["completion_token_ids"]
    finally:
        mesh.stop()
    whole = whole_model(path).to(device)
    prompt = torch.tensor([chat_token_ids(AutoTokenizer.from_pretrained(path), STORY)], device=device)
    with torch.inference_mode():
        out = whole.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             pad_token_id=0, suppress_tokens=[2])[0, prompt.shape[1]:].tolist()
    say(f"(b) {model}, 3 processes on {device}, float32: {len(got)} tokens, equal to generate: {got == out}")
    return {"tokens": len(got), "equal": got == out}


def speed_model(size: str, work: Path) -> str:
    """Build the seeded random speed model ``size`` into ``work`` and add it as preset ``bench-llama-<size>``
    (to this run's own added-presets file, ``MESHNET_USER_PRESETS``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshnet.models.catalog import add_preset, preset_for
    from meshnet.models.sources import byte_tokenizer

    path = work / f"llama-{size}"
    config = AutoConfig.for_model("llama", **SPEED_CONFIGS[size], max_position_embeddings=4096, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer(config.vocab_size).save_pretrained(path)
    say(f"speed model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters ({size})")
    add_preset(preset_for(str(path), f"bench-llama-{size}"))
    return f"bench-llama-{size}"


def mesh_rates(url: str, model: str, sessions: int, tokens: int) -> float:
    """Decode tokens/s of ``sessions`` streamed chats at once: their tokens after each one's first,
    over the time from the first first token to the last token."""
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(chat(url, model, tokens, stream=True)))
               for _ in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    return sum(r["tokens"] - 1 for r in results) / span


def generate_rate(whole, prompt, sessions: int, tokens: int) -> float:
    """Decode tokens/s of ``generate`` on ``sessions`` copies of ``prompt`` at once: the time of
    ``tokens`` tokens less the time of the first (prefill), over the tokens after the first."""
    import torch

    batch = prompt.repeat(sessions, 1)

    def run(n: int) -> float:
        if batch.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            whole.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        if batch.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return sessions * (tokens - 1) / max(run(tokens) - run(1), 1e-9)


def speed(device: str, size: str, runs: int, tokens: int, work: Path) -> dict:
    """(c): decode tokens/s, bfloat16, of the 3-process mesh and of ``generate``, 1 and 8 sessions."""
    import torch
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    from meshnet.models.sources import resolve
    from meshnet.node.entry import chat_token_ids
    from meshnet.presets import get_preset

    model = speed_model(size, work)
    layers = get_preset(model).num_layers
    third = layers // 3
    ranges = [(0, third - 1), (third, 2 * third - 1), (2 * third, layers - 1)]
    mesh = mesh_of(work / "speed", model, device, "bfloat16", ranges)
    out: dict = {}
    try:
        path = resolve(model)
        whole = whole_model(path, torch.bfloat16).to(device)
        prompt = torch.tensor([chat_token_ids(AutoTokenizer.from_pretrained(path), STORY)], device=device)
        mesh_rates(mesh.url, model, 1, 4)  # warm-up: connections, first forwards
        generate_rate(whole, prompt, 1, 4)
        for sessions in (1, 8):
            got = {"mesh": [], "generate": []}
            for _ in range(runs):  # alternated: both see the same load
                got["mesh"].append(mesh_rates(mesh.url, model, sessions, tokens))
                got["generate"].append(generate_rate(whole, prompt, sessions, tokens))
            m, g = statistics.median(got["mesh"]), statistics.median(got["generate"])
            out[sessions] = {"mesh_tokens_per_s": round(m, 1), "generate_tokens_per_s": round(g, 1),
                             "ratio": round(m / g, 3)}
            say(f"(c) {model} bfloat16 on {device}, {sessions} session(s), {tokens} tokens, medians of {runs}: "
                f"mesh {m:.1f} tokens/s, generate {g:.1f} tokens/s, ratio {m / g:.2f}")
    finally:
        mesh.stop()
    return out


def nf4_doctor(device: str) -> dict:
    """(d): an nf4 shard of tiny-llama on ``device`` and its doctor report."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        say(f"(d) nf4 doctor not run: bitsandbytes is not installed here ({exc})")
        return {"ran": False, "why": str(exc)}
    from meshnet.layers import LayerRange
    from meshnet.models.sources import resolve
    from meshnet.node.doctor import run_doctor
    from meshnet.node.runtime import NodeRuntime

    runtime = NodeRuntime(compute_dtype="bfloat16", device=device)
    slot = runtime.load("tiny-llama", resolve("tiny-llama"), LayerRange(0, 4), quantization="nf4")
    report = run_doctor(slot)
    fields = {k: getattr(report, k) for k in ("passed", "reason", "tokens_per_s")}
    say(f"(d) nf4 doctor of tiny-llama on {device}: {fields}")
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--speed-model", default="auto", choices=["auto", *SPEED_CONFIGS])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from meshnet.models.devices import resolve_device

    device = resolve_device(args.device)
    size = args.speed_model if args.speed_model != "auto" else ("1b" if device.startswith("cuda") else "small")
    work = Path(tempfile.mkdtemp(prefix="meshnet-device-check-"))
    os.environ["MESHNET_USER_PRESETS"] = str(work / "presets.toml")  # the children read it too
    started = time.perf_counter()
    summary = {"device": device, "equal": equal_to_generate(device, work), "speed": speed(device, size, args.runs,
                                                                                            args.tokens, work),
               "nf4": nf4_doctor(device)}
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
