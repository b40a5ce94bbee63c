"""Which layers' KV heads lose when their keys are compressed (issue 42, per-head KL): the KL of
each head's attention with a format's keys against the same attention with the model-dtype keys.

    PYTHONPATH=. nice -n 19 python benchmarks/kv_head_loss.py --data python-docs \
        --formats fp8_e4m3,int8,fp8_e4m3_fit [--tokens 512] [--top 12] [--out results.json]

One prompt of `--tokens` tokens from the text's start runs through the model into a dense pool (the
calibration pass's path, kv_calibration.measure_kv_stats, with each layer's queries noted). Then,
per layer, the stored keys are encoded and decoded by each format's keys (calibrated on
`kv_calibration_data` as the engine would), and for every query in the prompt's second half
(those with a context of at least half the prompt, as decoded positions in `kvserve eval`) the
causal softmax of q.k is compared: KL(dense || format) averaged over the queries of the head's GQA
group. Values stay exact, the next layer reads the dense model's inputs: a head's number is its
own keys' loss, not what it passes on. The sum over heads ranks formats as `kvserve eval`'s KL does
(fp8_e4m3 > fp8_e4m3_fit > int8 on the Python docs) without its minutes per format.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.torch_sdpa import SDPAMetadata, TorchSDPABackend
from kvserve.cache.kv_pool import KVPool
from kvserve.engine.llm import LLM
from kvserve.texts import load_text
from kv_probe import calibrated_layers, format_names, kv_stats, probe_llm, probe_parser


class _Queries(TorchSDPABackend):
    """The reference backend, keeping each layer's queries [tokens, heads, D] as they pass."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        super().__init__(pool, num_heads)
        self.queries: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SDPAMetadata,
                scale: float) -> torch.Tensor:
        self.queries[layer] = q.float().clone()
        return super().forward(layer, q, k, v, meta, scale)


@torch.inference_mode()
def keys_and_queries(llm: LLM, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's stored keys [n, kv_heads, D] and queries [n, heads, D] for one prompt."""
    model = llm.engine.model
    cfg, n, block = model.config, len(ids), 16
    blocks = -(-n // block)
    pool = KVPool(cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype,
                  torch.device("cpu"))
    probe = _Queries(pool, cfg.num_heads)
    step = StepMetadata.build([n], [n], [list(range(blocks))], block, torch.device("cpu"))
    model(torch.tensor(ids), StepAttention.of(probe, step, None, None), torch.tensor([n - 1]), llm.engine.runner.ops)
    keys = [layer[0].flatten(0, 1)[:n].float() for layer in pool.layers]
    return keys, [probe.queries[i] for i in range(cfg.num_layers)]


def head_kl(q: torch.Tensor, k: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """KL(softmax(q.k) || softmax(q.decoded)) per KV head [H], over queries of the second half."""
    n, heads, dim = k.shape
    q = q.unflatten(1, (heads, -1)).double()  # [n, H, group, D]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    scores = [torch.einsum("qhgd,khd->hgqk", q, x.double()).masked_fill(~mask, float("-inf")) / dim ** 0.5
              for x in (k, decoded)]
    ref, got = (s.log_softmax(-1)[..., n // 2:, :] for s in scores)
    return torch.where(ref.isinf(), 0.0, ref.exp() * (ref - got)).sum(-1).mean((1, 2))


def main() -> None:
    p = probe_parser(__doc__, "fp8_e4m3,int8,fp8_e4m3_fit", "comma-separated key formats")
    p.add_argument("--tokens", type=int, default=512, help="prompt length from the text's start (default 512)")
    p.add_argument("--top", type=int, default=12, help="heads listed per format, largest KL first")
    p.add_argument("--out", default=None, help="a JSON file for every head's KL")
    args = p.parse_args()
    names = format_names(args.formats)
    llm = probe_llm(args.model, max_model_len=max(2048, args.tokens))
    ids = llm.tokenizer.encode(load_text(args.data).text[:40 * args.tokens], add_special_tokens=False)[:args.tokens]
    keys, queries = keys_and_queries(llm, ids)
    stats = kv_stats(llm, args.calibration_data)
    results: dict[str, list[list[float]]] = {}
    for name in names:
        formats = [k for k, _ in calibrated_layers(name, len(keys), stats)]
        kl = torch.stack([head_kl(q, k, f.decode(f.encode(k), torch.float32))
                          for f, q, k in zip(formats, queries, keys)])  # [layers, kv_heads]
        results[name] = kl.tolist()
        order = kl.flatten().argsort(descending=True)[:args.top].tolist()
        heads = kl.shape[1]
        print(f"{name}: sum over heads {kl.sum().item():.4f}, largest head {kl.max().item():.4f} "
              f"({kl.max().item() / kl.sum().item():.0%} of the sum)")
        print("  " + "  ".join(f"L{i // heads}H{i % heads} {kl.flatten()[i].item():.4f}" for i in order), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "tokens": len(ids), "kl": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
