"""How far the bfloat16 wire drifts from float32: SmolLM2 split 0-9 / 10-19 / 20-29.

Runs the three shards in this process exactly as three nodes would (float32 compute, every
hop's input encoded and decoded with meshnet.node.wire), greedy, against transformers'
monolithic float32 forward with KV cache. Prints the first differing token (if any) and
the max absolute logit difference over the compared steps, for both wire dtypes.

Usage: .venv/bin/python bench/wire_exactness.py [--tokens 32]
"""

from __future__ import annotations

import argparse

import torch

from meshnet.node import wire
from meshnet.layers import LayerRange
from meshnet.models.caches import KVCache
from meshnet.models.shard import ShardModel
from meshnet.models.sources import resolve

PROMPTS = ["What is the capital of France?", "Write a short story about a robot who learns to paint.",
           "Explain photosynthesis to a child."]


def run(shards, ids, n_tokens, wire_dtype, reference) -> tuple[int | None, float]:
    caches = [KVCache() for _ in shards]
    tokens, position, first_diff, max_diff = list(ids), 0, None, 0.0
    step_input = ids
    for step in range(n_tokens):
        hidden = shards[0].embed_tokens(torch.tensor([step_input]), position)
        for k, (shard, cache) in enumerate(zip(shards, caches)):
            if k > 0:
                hidden = wire.decode(wire.encode(hidden, dtype=wire_dtype))
            hidden = shard.forward(hidden, cache, position)
        logits = shards[0].logits(hidden[:, -1:])[0, -1]
        ref_logits = reference(tokens)
        max_diff = max(max_diff, float((logits - ref_logits).abs().max()))
        token, ref_token = int(logits.argmax()), int(ref_logits.argmax())
        if token != ref_token and first_diff is None:
            first_diff = step
            break
        position += len(step_input)
        tokens.append(token)
        step_input = [token]
    return first_diff, max_diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    path = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    full = whole_model(path)
    shards = [ShardModel(path, LayerRange(a, b)) for a, b in ((0, 10), (10, 20), (20, 30))]

    @torch.inference_mode()
    def reference(tokens):
        return full(torch.tensor([tokens])).logits[0, -1].float()

    print(f"{'prompt':58} {'wire':9} {'first differing token':>22} {'max |logit diff|':>17}")
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            for dtype in ("float32", "bfloat16"):
                first, diff = run(shards, ids, args.tokens, dtype, reference)
                where = "none in %d" % args.tokens if first is None else f"token {first}"
                print(f"{prompt[:58]:58} {dtype:9} {where:>22} {diff:17.4f}")


if __name__ == "__main__":
    main()
