"""The doctor's correctness checks (the article's section 5.2): each compares two ways of computing
the same distributions through the real engine and says pass, warn or fail, with advice.

Every comparison is in log-probabilities over the tokens that matter (reference log-prob above
-10: the tail of a 49k vocabulary in bf16 is noise), plus top-1 agreement. Tolerances come from
the model dtype. In fp32 two ways of computing must agree to 1e-3. In bf16 / fp16 two correct
ways already differ by their rounding (a decode step's matmuls sum in another order than a
prefill's), so the check asks the engine's way to stay about as close to an fp32 recomputation
(the truth) as the reference way in the same dtype is: KL(truth || cached) at most twice
KL(truth || reference) (+1e-4), and top-1 agreement with the truth at most 0.03 lower (or two
positions, where there are fewer than 67), counted where the truth's top two are not a near-tie
(NEAR_TIE): a near-tie goes either way in rounding.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.engine.llm import LLM
from kvserve.eval.quality import forced_logprobs, forcing, kl, top1
from kvserve.sampling_params import SamplingParams

MakeLLM = Callable[..., LLM]
# (max |delta log-prob|, min top-1 agreement) per model dtype.
TOLERANCE = {torch.float32: (1e-3, 0.999), torch.float16: (0.05, 0.97), torch.bfloat16: (0.3, 0.95)}
# Top-two log-prob gaps (nats) that a half-precision forward can reverse: a near-tie's top-1 is
# rounding, not quality. Flips measured on SmolLM2 in bf16 had fp32 gaps up to 0.06.
NEAR_TIE = {torch.float32: 0.0, torch.float16: 0.02, torch.bfloat16: 0.1}


@dataclass(frozen=True)
class Check:
    name: str
    status: str                     # "pass", "warn" or "fail"
    measured: dict[str, float]
    threshold: str
    advice: str = ""
    correctness: bool = True        # a failed correctness check makes `kvserve doctor` exit 1
    detail: dict[str, Any] = field(default_factory=dict)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """got, want [N, vocab] log-probs: the largest difference where `want` > -10, and top-1."""
    relevant = want > -10
    diff = (got - want).abs().masked_fill(~relevant, 0).max().item()
    return {"max_abs_logprob_diff": diff, "top1_agreement": top1(got, want)}


def against_truth(name: str, got: torch.Tensor, baseline: torch.Tensor, truth: torch.Tensor | None,
                  dtype: torch.dtype, advice: str, slack: float = 1.0,
                  extra: dict[str, float] | None = None, format_loss: bool = False) -> Check:
    """`got` (the engine's way) against `baseline` (the reference way, same dtype): directly in
    fp32 (`truth` None), else each against the fp32 `truth` (see the module docstring).
    `format_loss`: `got` reads compressed codes where `baseline` read exact values (a prefix hit
    of a format with a full-precision residual window), so the top-1 allowance grows by what the
    format already loses against the truth in `baseline`."""
    if truth is None:
        return judged(name, {**compare(got, baseline), **(extra or {})}, dtype, advice, slack)
    kl_got, kl_base = kl(truth, got), kl(truth, baseline)
    decided = decided_rows(truth, dtype)
    top_got, top_base = top1(got[decided], truth[decided]), top1(baseline[decided], truth[decided])
    # 3% of the decided positions, and never under two of them: two half-precision runs that
    # round differently (a recomputed prompt's matmuls against its decode steps') flip up to two
    # of the ~60 positions of the short checks with KL well inside its bound (the bundled model
    # on five texts), where 3% of 60 would allow one.
    allowance = max(0.03 * slack, 2 / max(int(decided.sum()), 1)) + (1 - top_base if format_loss else 0.0)
    ok = kl_got <= 2 * slack * kl_base + 1e-4 * slack and top_got >= top_base - allowance
    measured = {"kl_vs_fp32": kl_got, "reference_kl_vs_fp32": kl_base, "top1_vs_fp32": top_got,
                "reference_top1_vs_fp32": top_base, "decided_positions": float(decided.sum()),
                **compare(got, baseline), **(extra or {})}
    return Check(name, "pass" if ok else "fail", measured,
                 f"KL to an fp32 recompute <= {2 * slack:g} x the reference's + {1e-4 * slack:g}, top-1 >= the "
                 f"reference's - {allowance:.3g}" + (" (3% or two positions, + the format's own top-1 loss)"
                                                     if format_loss else "")
                 + f" where fp32's top two differ by > {NEAR_TIE[dtype]:g} ({str(dtype).removeprefix('torch.')})",
                 "" if ok else advice)


def decided_rows(truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose fp32 top-1 beats the runner-up by more than `dtype` rounding moves a log-prob:
    below that, two correct half-precision computations pick either token."""
    best = truth.topk(2, dim=-1).values
    return best[:, 0] - best[:, 1] > NEAR_TIE[dtype]


def judged(name: str, measured: dict[str, float], dtype: torch.dtype, advice: str, slack: float = 1.0) -> Check:
    tol, top1 = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    tol *= slack
    ok = measured["max_abs_logprob_diff"] <= tol and measured["top1_agreement"] >= top1
    return Check(name, "pass" if ok else "fail", measured,
                 f"max |delta log-prob| <= {tol:g} and top-1 >= {top1:g} ({str(dtype).removeprefix('torch.')})",
                 "" if ok else advice)


def cached(llm: LLM, prompt: list[int], continuation: list[int], cache_salt: str | None = None) -> torch.Tensor:
    """Distributions after each forced token, decoded one cached step at a time: [N, vocab]."""
    return forced_logprobs(llm, [prompt + continuation], len(prompt), cache_salt)[0]


def prompt_scores(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt scored by one forward over all of it (no cache reuse): the distribution after
    tokens 0 .. j for every j but the last, [len - 1, vocab] per prompt."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)
    return [torch.stack([t.full for t in o.prompt_logprobs[1:]]) for o in outs]


def recomputed(llm: LLM, tokens: list[int], start: int) -> torch.Tensor:
    """`cached`'s distributions for tokens[start:] from a full recompute."""
    return prompt_scores(llm, [tokens])[0][start - 1:]


def cache_vs_recompute(llm: LLM, tokens: list[int], prompt_len: int, label: str,
                       truth: torch.Tensor | None, slack: float = 1.0) -> Check:
    """`truth`: the fp32 recomputation of the same positions (None when the engine runs fp32)."""
    got = cached(llm, tokens[:prompt_len], tokens[prompt_len:])
    want = recomputed(llm, tokens, prompt_len)
    return against_truth(f"cache vs recompute ({label})", got, want, truth, llm.engine.config.model.torch_dtype,
                         "decoding from the cache differs from recomputing: the K/V written while decoding "
                         "is not what the model computes. Isolate the kernel with --attention-backend torch "
                         "--no-cpu-kernels; for a compressed format, raise --kv-residual or use int8", slack)


def kernel_vs_reference(llm: LLM, make_llm: MakeLLM, tokens: list[int], prompt_len: int,
                        truth: torch.Tensor | None) -> Check:
    """The configured KV format decoded through the configured attention kernel, against the
    reference path (`torch` backend: the format's Python decode, then SDPA; eager ops) over the
    same format. Both read the same codes, so what the fast path adds beyond rounding is a kernel
    defect. (A recompute would not do: one prefill reads its own new tokens exactly and never
    sees the codes, so comparing with it measures the format's own error, which the format
    checks report: kivi2's 0.058 KL to fp32 failed such a check on a sound kernel.)"""
    config = llm.engine.config
    name = "kernel vs reference (configured KV format)"
    if config.runtime.attention_backend == "torch" and not config.runtime.cpu_kernels:
        return Check(name, "pass", {}, "the configured path is the reference", correctness=False)
    got = cached(llm, tokens[:prompt_len], tokens[prompt_len:])
    want = cached(make_llm(attention_backend="torch", cpu_kernels=False), tokens[:prompt_len], tokens[prompt_len:])
    # fp32 sums in another order can flip a code near a boundary: 1e-2 there, as the tests hold.
    return against_truth(name, got, want, truth, config.model.torch_dtype,
                         "the attention kernel decodes this format's pages differently from the reference: compare "
                         "with --attention-backend torch --no-cpu-kernels, and report it",
                         slack=10 if truth is None else 1)


def fresh_salt() -> str:
    """A cache salt no other request carries: its first run cannot hit the prefix cache."""
    return f"kvserve-doctor-{uuid.uuid4().hex}"


def prefix_hit_vs_miss(llm: LLM, make_llm: MakeLLM, tokens: list[int], prompt_len: int,
                       truth: torch.Tensor | None) -> Check:
    """The same request twice under a salt of its own: the first run must miss (earlier checks
    cached this prompt without the salt), the second must hit.

    With a full-precision residual window the hit reads the cached prompt blocks as codes, where
    the miss read them exactly (the request is shorter than the window): the format's own loss,
    not a cache defect. So the hit is then judged against a run of the same format whose window
    is one block, which reads the prompt as codes from its second block of output on and its own
    older tokens too: it loses at least what the hit should, and blocks served wrong lose far
    more."""
    engine = llm.engine
    if not engine.config.cache.enable_prefix_caching:
        return Check("prefix hit vs miss", "pass", {}, "prefix caching is off", correctness=False)
    salt = fresh_salt()
    stats = engine.block_manager.prefix_stats
    before = stats.cached_tokens
    miss = cached(llm, tokens[:prompt_len], tokens[prompt_len:], salt)
    missed = stats.cached_tokens - before
    hit = cached(llm, tokens[:prompt_len], tokens[prompt_len:], salt)
    reused = stats.cached_tokens - before - missed
    staged = isinstance(engine.pool, QuantizedKVPool) and engine.pool.staged
    reference = cached(make_llm(kv_residual=engine.block_manager.block_size, enable_prefix_caching=False),
                       tokens[:prompt_len], tokens[prompt_len:]) if staged else miss
    check = against_truth("prefix hit vs miss", hit, reference, truth, engine.config.model.torch_dtype,
                          "a prompt served from the prefix cache decodes differently from a fresh one: "
                          "run with --no-enable-prefix-caching until fixed",
                          extra={"cached_tokens_reused": float(reused), "cached_tokens_on_miss": float(missed)},
                          format_loss=staged)
    if missed:
        return Check(check.name, "fail", check.measured, "a request under a new cache salt must not hit",
                     "a salted request reused another tenant's blocks: the salt does not isolate the "
                     "prefix cache (see the README's side-channel note)")
    if reused == 0:
        return Check(check.name, "warn", check.measured, "the second run must reuse cached blocks",
                     f"the prompt ({prompt_len} tokens) is shorter than a block ({engine.block_manager.block_size}), "
                     "so nothing was reused", correctness=False)
    return check


def preempted_vs_undisturbed(llm: LLM, make_llm: MakeLLM, tokens: list[int], prompt_len: int,
                             truth: torch.Tensor | None, slack: float = 1.0) -> Check:
    """Three copies of the request in a pool that holds about two: some are preempted and
    resumed (by the configured mode), each must match the undisturbed run. `slack` as in
    `cache_vs_recompute`: a recomputed sequence encodes its compressed pages again from a
    prefill's K/V, whose rounding differs from the decode steps' that first wrote them."""
    engine = llm.engine
    # Under a salt of its own, like the small engine without a prefix cache: a prefix hit would
    # read blocks that an earlier, longer request sealed into a compressed format's codes.
    want = cached(llm, tokens[:prompt_len], tokens[prompt_len:], fresh_salt())
    blocks = engine.block_manager.blocks_for(len(tokens))
    sizes = engine.config.replace(max_num_seqs=3).kv_sizes(engine.model_config)
    small = make_llm(kv_cache_memory=str(sizes.memory_for(2 * blocks + 1)), max_num_seqs=3,
                     enable_prefix_caching=False)
    outs = small.generate([tokens[:prompt_len]] * 3, forcing(tokens[prompt_len:]), use_tqdm=False)
    preemptions = small.engine.scheduler.num_preemptions
    mode = engine.config.scheduler.preemption_mode
    advice = f"a sequence resumed after preemption ({mode}) decodes differently: " + (
        "try --preemption-mode recompute" if mode != "recompute"
        else "its recomputed K/V differ from what its decode steps wrote; compare with --attention-backend torch")
    results = [against_truth("preempted vs undisturbed", torch.stack([t.full for t in o.logprobs]), want, truth,
                             engine.config.model.torch_dtype, advice, slack, extra={"preemptions": float(preemptions)})
               for o in outs]
    check = next((r for r in results if r.status == "fail"), results[0])
    if preemptions == 0:
        return Check(check.name, "warn", check.measured, "the small pool must preempt",
                     "no preemption happened, so resumption was not tested", correctness=False)
    return check


def mask_future_tokens(llm: LLM, tokens: list[int]) -> Check:
    """Changing the last token must leave the distribution at every earlier position unchanged
    (all of prompt scoring's rows: the last token's own position is not among them)."""
    changed = tokens[:-1] + [(tokens[-1] + 1) % llm.engine.model_config.vocab_size]
    # Each alone: packed together, their rows would reach the matmuls in calls of other sizes,
    # which some GEMM builds round differently (the batch check judges that).
    a, b = prompt_scores(llm, [tokens])[0], prompt_scores(llm, [changed])[0]
    measured = compare(b, a)
    return judged("mask: later tokens are invisible", measured, llm.engine.config.model.torch_dtype,
                  "an earlier position sees a later token: the attention mask is off; "
                  "compare with --attention-backend torch")


def batch_invariance(llm: LLM, tokens: list[int], others: list[list[int]], truth: torch.Tensor | None) -> Check:
    """`truth`: the fp32 scores of `tokens` (None when the engine runs fp32). In half precision a
    packed batch's matmuls block their rows otherwise (oneDNN with AMX, for one), which moves
    log-probs by rounding alone; so the packed run is judged by its distance to the truth."""
    alone = prompt_scores(llm, [tokens])[0]
    packed = prompt_scores(llm, [tokens, *others])[0]
    return against_truth("alone vs packed in a batch", packed, alone, truth, llm.engine.config.model.torch_dtype,
                         "a sequence's distributions depend on what else is in its batch beyond rounding: "
                         "a masking or slot-mapping bug; compare with --attention-backend torch")


def beam_rescoring(llm: LLM, prompt: list[int], width: int = 2, tokens: int = 8) -> Check:
    """Each returned beam's score equals its tokens' log-probs, recomputed, over length ** penalty."""
    params = SamplingParams(max_tokens=tokens, beam_width=width, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    scores = prompt_scores(llm, [prompt + out.token_ids])[0][len(prompt) - 1:]
    total = scores.gather(1, torch.tensor(out.token_ids)[:, None]).sum().item()
    rescored = total / len(out.token_ids) ** params.length_penalty
    diff = abs(rescored - out.beam_score)
    tol = TOLERANCE.get(llm.engine.config.model.torch_dtype, TOLERANCE[torch.bfloat16])[0] * len(out.token_ids)
    ok = diff <= tol
    return Check("beam score vs recompute", "pass" if ok else "fail",
                 {"reported": out.beam_score, "recomputed": rescored, "abs_diff": diff},
                 f"|reported - recomputed| <= {tol:g}",
                 "" if ok else "beam search scores tokens with other log-probs than the model gives them: "
                               "a beam's cache or its score bookkeeping is wrong")


def format_quality(make_llm: MakeLLM, reference: torch.Tensor, tokens: list[int], prompt_len: int,
                   fmt: str) -> Check:
    """KL and top-1 of one KV format against the model-dtype cache on the same forced tokens."""
    try:
        llm = make_llm(kv_cache_dtype=fmt)
    except ValueError as err:  # e.g. a group size this model's head_dim does not allow
        return Check(f"format {fmt}", "warn", {}, "the format builds for this model", str(err), correctness=False)
    got = cached(llm, tokens[:prompt_len], tokens[prompt_len:])
    measured = {"kl": kl(reference, got), "top1_agreement": top1(got, reference),
                "bytes_per_token": llm.engine.kv_bytes_per_token}
    ok = measured["kl"] <= 0.05 and measured["top1_agreement"] >= 0.9
    return Check(f"format {fmt}", "pass" if ok else "warn", measured, "KL <= 0.05 and top-1 >= 0.9",
                 "" if ok else f"{fmt} loses noticeable quality here: keep recent tokens exact with "
                               "--kv-residual, or use int8 / fp8", correctness=False)
