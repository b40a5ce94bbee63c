"""Where a KV layout loses (issue 42 item 2): its keys alone, its values alone, and each layer's
keys or values alone, measured through the engine's real cache path.

    PYTHONPATH=. nice -n 19 python benchmarks/kv_layer_loss.py --data /usr/share/common-licenses/GPL-3 \
        --kv-cache-dtype kivi2 --kv-residual 0 --block-size 128 --kv-group-size 64 --kv-exact-sink \
        --kv-key-wide-channels 24 --kv-symmetric-values --no-kv-rotate-keys --kv-rotation hadamard \
        [--per-layer] [--out results.json]

The layout is given with the engine's own flags (as `kvserve eval` takes them); each probe keeps
its options (with a residual of at least one token: the block still filling stays exact, as a
block-encoded layout at @0 keeps it) and compresses only part of the cache:
`--kv-cache-dtype-v bf16` for keys alone, a one-layer plan file (`plan:PATH`, the other layers in
the model dtype) for one layer's keys or values. Windows as `kvserve eval` cuts them (from the
text's start, 512 tokens, half prefilled, the rest decoded into the cache); KL(reference ||
probe) per decoded position and the perplexity change against the model-dtype cache. One layer's
perplexity change is noise; its KL is steady (tune-kv's reasoning), so layers print KL alone.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvserve import LLM
from kvserve.cache.kv_plan import KVPlan
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.eval import quality
from kvserve.texts import load_text


def windows_of(tok: Any, text: str, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the text's start, end to end (kvserve eval's cut)."""
    ids = tok.encode(text[:40 * count * length], add_special_tokens=False)
    windows = [ids[i * length:(i + 1) * length] for i in range(count)]
    if len(windows[-1]) < length:
        raise SystemExit(f"the text holds fewer than {count} windows of {length} tokens")
    return windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", required=True, help="a text (kvserve eval's --data); repeatable")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--per-layer", action="store_true", help="also each layer's keys alone and values alone")
    p.add_argument("--out", default=None, help="a JSON file for the numbers")
    add_engine_args(p)
    p.set_defaults(kv_cache_memory="512MiB", max_model_len=2048, enable_prefix_caching=False)
    args = p.parse_args()
    fmt = args.kv_cache_dtype
    dense = "bf16" if args.dtype == "bfloat16" else "auto"
    # A block-encoded format (KIVI keys) keeps the block still filling in full-precision staging;
    # a residual of one token stages exactly that block for any format, so keys alone, values alone
    # and one layer alone all read the same tokens exact as the whole layout does (unset: the
    # formats' own windows, none for per-token formats such as fp8).
    base = engine_kwargs(args, max_num_seqs=max(args.max_num_seqs, args.windows), 
                        kv_residual=None if args.kv_residual is None else max(args.kv_residual, 1))

    reference = LLM(**{**base, "kv_cache_dtype": "auto", "kv_rotation": "none"})
    layers = reference.engine.model_config.num_layers
    prefill = args.window_len // 2
    texts = []
    for spec in args.data:
        source = load_text(spec)
        windows = windows_of(reference.tokenizer, source.text, args.windows, args.window_len)
        ref = quality.forced_logprobs(reference, windows, prefill)
        targets = torch.tensor([w[prefill:] for w in windows])
        texts.append((source.name, windows, ref, targets, quality.compare(ref, ref, targets).perplexity))
    del reference

    def probe(**overrides: Any) -> dict[str, dict[str, float]]:
        llm = LLM(**{**base, **overrides})
        out = {}
        for name, windows, ref, targets, ref_ppl in texts:
            q = quality.compare(quality.forced_logprobs(llm, windows, prefill), ref, targets)
            out[name] = {"kl": q.kl, "ppl": 100 * (q.perplexity / ref_ppl - 1)}
        return out

    results: dict[str, Any] = {"whole": probe(), "keys": probe(kv_cache_dtype_v=dense),
                               "values": probe(kv_cache_dtype_k=dense)}
    for row in ("whole", "keys", "values"):
        print(row, "  ".join(f"{n}: KL {r['kl']:.4f} ppl {r['ppl']:+.2f}%" for n, r in results[row].items()),
              flush=True)
    if args.per_layer:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "plan.json"
            for layer in range(layers):
                for role, pair in (("k", (fmt, "auto")), ("v", ("auto", fmt))):
                    pairs = [("auto", "auto")] * layers
                    pairs[layer] = pair
                    KVPlan(tuple(pairs)).save(path)
                    results[f"{layer}{role}"] = probe(kv_cache_dtype=f"plan:{path}")
                print(f"layer {layer:>2}", "  ".join(
                    f"{n}: K {results[f'{layer}k'][n]['kl']:.4f} V {results[f'{layer}v'][n]['kl']:.4f}"
                    for n, *_ in texts), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
