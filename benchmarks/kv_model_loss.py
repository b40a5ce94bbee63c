"""Where a KV format loses through the whole model, offline (issue 42, Gemma 3): the KL of the
next-token distribution with a format's keys and/or values, on all layers or one group of layers,
against the model-dtype cache; and the floor the model's own numerics set.

    PYTHONPATH=. nice -n 19 python benchmarks/kv_model_loss.py --model gemma3-270m \
        --data /usr/share/common-licenses/GPL-3 --formats int8,fp8_e4m3_fit [--windows 8] [--out r.json]

Each window (512 tokens from the text's start, end to end, as `kvserve eval` cuts them) runs as
one prompt; every layer's keys and values pass through the format's encode and decode before
attention reads them (queries exact), and KL(reference || probe) is averaged over the positions of
the window's second half, those `kvserve eval` decodes. A prefill sees what eval's decode sees
(every earlier key compressed), in one pass instead of 256 steps: seconds a probe, not minutes, so
it ranks probes; `kvserve eval` measures. Probes per format: keys and values, keys alone, values
alone, and each alone on the global (full-attention) layers or on the sliding ones.

Floors, printed first: the same model in fp32 against the bf16 one (what the reference's own
numerics move), and in the fp32 model, its KV rounded to bf16 (what bf16 pages alone cost).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.torch_sdpa import SDPAMetadata, TorchSDPABackend
from kvserve.cache.formats import KVFormat
from kvserve.cache.kv_pool import KVPool
from kvserve.engine.llm import LLM
from kvserve.eval.quality import kl
from kvserve.texts import load_text
from kv_probe import calibrated_layers, format_names, kv_stats, probe_llm, probe_parser

Roundtrip = Callable[[torch.Tensor], torch.Tensor]  # [n, kv_heads, D] -> the same, as pages return it


class _Compressed(TorchSDPABackend):
    """The reference backend, each layer's keys and values first passed through `k[layer]` and
    `v[layer]` (None: left as the model computed them)."""

    def __init__(self, pool: KVPool, num_heads: int, k: list[Roundtrip | None], v: list[Roundtrip | None]) -> None:
        super().__init__(pool, num_heads)
        self.k, self.v = k, v

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SDPAMetadata,
                scale: float) -> torch.Tensor:
        fk, fv = self.k[layer], self.v[layer]
        k = k if fk is None else fk(k).to(k.dtype)
        v = v if fv is None else fv(v).to(v.dtype)
        return super().forward(layer, q, k, v, meta, scale)


@torch.inference_mode()
def log_probs(llm: LLM, ids: list[int], k: list[Roundtrip | None], v: list[Roundtrip | None]) -> torch.Tensor:
    """Log-probabilities [n/2, vocab] of the window's second half, keys and values passed through k, v."""
    model = llm.engine.model
    cfg, n, block = model.config, len(ids), 16
    blocks = -(-n // block)
    pool = KVPool(cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype,
                  torch.device("cpu"))
    step = StepMetadata.build([n], [n], [list(range(blocks))], block, torch.device("cpu"))
    attention = StepAttention.of(_Compressed(pool, cfg.num_heads, k, v), step, None, None)
    logits = model(torch.tensor(ids), attention, torch.arange(n // 2 - 1, n - 1), llm.engine.runner.ops)
    return logits.double().log_softmax(-1)


def roundtrip(fmt: KVFormat) -> Roundtrip:
    return lambda x: fmt.decode(fmt.encode(x), torch.float32)


def main() -> None:
    p = probe_parser(__doc__, "int8,fp8_e4m3_fit", "comma-separated formats")
    p.add_argument("--windows", type=int, default=8, help="windows of 512 tokens (default 8)")
    p.add_argument("--out", default=None, help="a JSON file for every probe's KL per window")
    args = p.parse_args()
    names = format_names(args.formats)
    llm = probe_llm(args.model)
    tok, model = llm.tokenizer, llm.engine.model
    cfg, length = model.config, 512
    ids = tok.encode(load_text(args.data).text[:40 * args.windows * length], add_special_tokens=False)
    windows = [ids[i * length:(i + 1) * length] for i in range(args.windows)]
    if len(windows[-1]) < length:
        raise SystemExit(f"--windows: the text holds fewer than {args.windows} windows of {length} tokens")
    layers = cfg.num_layers
    none: list[Roundtrip | None] = [None] * layers
    refs = [log_probs(llm, w, none, none) for w in windows]
    results: dict[str, list[float]] = {}

    def probe(label: str, k: list[Roundtrip | None], v: list[Roundtrip | None], model_llm: LLM = llm,
              against: list[torch.Tensor] = refs) -> None:
        results[label] = [kl(r, log_probs(model_llm, w, k, v)) for r, w in zip(against, windows)]
        t = torch.tensor(results[label])
        print(f"{label:40s} KL {t.mean().item():.5f} (sd {t.std().item():.5f}, {len(t)} windows)", flush=True)

    fp32 = probe_llm(args.model, dtype="float32")
    refs32 = [log_probs(fp32, w, none, none) for w in windows]
    results["floor: fp32 model vs bf16"] = [kl(r32, r) for r32, r in zip(refs32, refs)]
    print(f"{'floor: fp32 model vs bf16':40s} KL {torch.tensor(results['floor: fp32 model vs bf16']).mean():.5f}")
    to_bf16: Roundtrip = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    probe("floor: fp32 model, bf16 KV vs fp32 KV", [to_bf16] * layers, [to_bf16] * layers, fp32, refs32)
    del fp32

    stats = kv_stats(llm, args.calibration_data)
    sliding = set(cfg.sliding_layers)
    groups = {"global": [i for i in range(layers) if i not in sliding], "sliding": sorted(sliding)}
    for name in names:
        formats = calibrated_layers(name, layers, stats)
        ks = [roundtrip(k) for k, _ in formats]
        vs = [roundtrip(v) for _, v in formats]
        probe(f"{name} K+V", ks, vs)
        probe(f"{name} K", ks, none)
        probe(f"{name} V", none, vs)
        for group, members in groups.items():
            if members:
                probe(f"{name} K, {group} layers", [f if i in members else None for i, f in enumerate(ks)], none)
                probe(f"{name} V, {group} layers", none, [f if i in members else None for i, f in enumerate(vs)])
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "model": args.model, "windows": len(windows),
                                              "kl": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
