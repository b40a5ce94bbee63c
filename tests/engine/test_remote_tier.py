"""Engines sharing prefix blocks through a real redis-server (kv_remote)."""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cache.block_manager import block_hash
from kvserve.cli import build_parser
from kvserve.config import EngineConfig
from kvserve.engine_args import engine_kwargs
from tests.conftest import RedisServer

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
PROMPT = [(7 * j + 3) % 128 for j in range(70)]  # 4 full blocks before the last token


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def tokens(llm: LLM, prompt: list[int] = PROMPT) -> list[int]:
    return outputs(llm, [prompt])[0][0]


def prompt_keys(llm: LLM, prompt: list[int] = PROMPT) -> list[bytes]:
    """The Redis keys of the prompt's full blocks, as the engine's tier names them."""
    keys, chain = [], None
    for i in range((len(prompt) - 1) // 16):
        chain = block_hash(chain, tuple(prompt[i * 16:(i + 1) * 16]))
        keys.append(llm.engine.remote.key(chain))
    return keys


def forged(key: bytes, pages: bytes) -> bytes:
    """A value in the tier's layout (its magic, a BLAKE2b of the key and the pages, the pages), as
    anyone who can write to the Redis server can make one without holding a secret."""
    return b"KVS2" + hashlib.blake2b(key + pages, digest_size=32).digest() + pages


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3"])
def test_a_second_engine_computes_only_the_suffix(tiny_llm: Callable[..., LLM], redis_server: RedisServer,
                                                  fmt: str) -> None:
    a = tiny_llm(kv_remote=redis_server.url, kv_cache_dtype=fmt)
    b = tiny_llm(kv_remote=redis_server.url, kv_cache_dtype=fmt)
    alone = tiny_llm(kv_cache_dtype=fmt)
    want = outputs(alone, [PROMPT])
    assert outputs(a, [PROMPT]) == want
    assert a.engine.remote.stats.stored >= 4
    # The same pages, so the same tokens; logprobs to rounding, since b computes only the suffix
    # and some BLAS builds (MKL on AMD CPUs) round a row differently at another row count.
    got = outputs(b, [PROMPT])
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        assert [t.token_id for t in got_lp] == [t.token_id for t in want_lp]
        assert [t.logprob for t in got_lp] == pytest.approx([t.logprob for t in want_lp], abs=1e-5)
    assert b.engine.block_manager.prefix_stats.remote_tokens == 64
    assert b.engine.tokens_computed == a.engine.tokens_computed - 64
    # Blocks loaded from the tier join the local cache: a third run hits locally.
    outputs(b, [PROMPT])
    assert b.engine.remote.stats.hits == 4


def test_engines_whose_pages_differ_share_nothing(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    outputs(tiny_llm(kv_remote=redis_server.url), [PROMPT])
    for kwargs in ({"kv_cache_dtype": "int8"}, {"seed": 1}, {"block_size": 8}, {"kv_rotation": "hadamard"}):
        other = tiny_llm(kv_remote=redis_server.url, **kwargs)
        outputs(other, [PROMPT])
        assert other.engine.block_manager.prefix_stats.remote_tokens == 0, kwargs


def test_killing_redis_mid_run_loses_no_request(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    prompts = [[(5 * i + 3 * j) % 128 for j in range(40 + 9 * i)] for i in range(6)]
    want = outputs(tiny_llm(max_num_seqs=2), prompts)
    llm = tiny_llm(kv_remote=redis_server.url, max_num_seqs=2)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.logprobs)
        steps += 1
        if steps == 5:
            redis_server.stop()
    assert [finished[i] for i in ids] == want
    assert engine.remote.stats.errors >= 1 and engine.remote.stats.stored > 0


@pytest.mark.parametrize("bad", [0, 2])
def test_a_value_of_the_wrong_length_is_a_miss_for_that_prompt_alone(tiny_llm: Callable[..., LLM],
                                                                       redis_server: RedisServer, bad: int) -> None:
    """A prompt's `bad`-th block replaced by a value with a valid header and checksum but a 10-byte
    payload: generate raised AssertionError (on the server, the whole batch was aborted), and the
    loaded blocks stayed in the prefix cache unfilled. Now the value is corrupt, counted, and the
    prompt computes from that block on; another prompt of the same batch is untouched."""
    other = [(11 * j + 5) % 128 for j in range(40)]
    want = [ids for ids, _ in outputs(tiny_llm(), [PROMPT, other])]
    writer = tiny_llm(kv_remote=redis_server.url)
    outputs(writer, [PROMPT])
    tier = writer.engine.remote
    chain = None
    for i in range(bad + 1):
        chain = block_hash(chain, tuple(PROMPT[i * 16:(i + 1) * 16]))
    redis_server.client.set(tier.key(chain), tier.pack(chain, b"x" * 10))
    reader = tiny_llm(kv_remote=redis_server.url)
    assert [ids for ids, _ in outputs(reader, [PROMPT, other])] == want
    assert reader.engine.remote.stats.corrupt == 1
    assert reader.engine.block_manager.prefix_stats.remote_tokens == bad * 16
    redis_server.client.delete(tier.key(chain))
    assert [ids for ids, _ in outputs(reader, [PROMPT])] == want[:1]  # from the blocks it computed


def test_values_swapped_between_keys_are_corrupt(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    """The values of two prompts' first blocks swapped, each written by an engine with its
    checksum right: the checksum covered the pages alone, so each prompt was answered from the
    other's first block, undetected. Each value is now bound to its key."""
    other = [(11 * j + 5) % 128 for j in range(70)]
    want = [tokens(tiny_llm(), p) for p in (PROMPT, other)]
    writer = tiny_llm(kv_remote=redis_server.url)
    outputs(writer, [PROMPT, other])
    first, second = prompt_keys(writer)[0], prompt_keys(writer, other)[0]
    values = redis_server.client.mget([first, second])
    redis_server.client.mset({first: values[1], second: values[0]})
    reader = tiny_llm(kv_remote=redis_server.url)
    assert [tokens(reader, p) for p in (PROMPT, other)] == want
    assert reader.engine.remote.stats.corrupt == 2 and reader.engine.block_manager.prefix_stats.remote_tokens == 0


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_a_secret_keeps_out_values_its_holders_did_not_write(tiny_llm: Callable[..., LLM], redis_server: RedisServer,
                                                             secret: str | None) -> None:
    """Every block of a prompt overwritten with pages of 0xFF bytes, each value well formed and
    bound to its key. Without a secret the tier takes them (it trusts whoever can write to the
    Redis server, as the README says): the tokens go wrong, which shows the forgery is well
    made. With kv_remote_secret each value carries a keyed MAC: the forgeries fail it, are
    counted, and the prompt is computed."""
    options = {} if secret is None else {"kv_remote_secret": secret}
    want = tokens(tiny_llm())
    writer = tiny_llm(kv_remote=redis_server.url, **options)
    tokens(writer)
    pages = b"\xff" * writer.engine.remote.block_bytes
    for key in prompt_keys(writer):
        redis_server.client.set(key, forged(key, pages))
    reader = tiny_llm(kv_remote=redis_server.url, **options)
    got = tokens(reader)
    stats, loaded = reader.engine.remote.stats, reader.engine.block_manager.prefix_stats.remote_tokens
    if secret is None:
        assert loaded == 64 and got != want
    else:
        assert got == want and stats.corrupt == 1 and loaded == 0


def test_engines_with_other_secrets_share_nothing(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    tokens(tiny_llm(kv_remote=redis_server.url, kv_remote_secret="a"))
    for options in ({}, {"kv_remote_secret": "b"}, {"kv_remote_secret": "a"}):
        other = tiny_llm(kv_remote=redis_server.url, **options)
        tokens(other)
        shared = options.get("kv_remote_secret") == "a"
        assert other.engine.block_manager.prefix_stats.remote_tokens == (64 if shared else 0), options
        assert other.engine.remote.stats.corrupt == 0  # other keys altogether, not rejected values


def test_the_secret_is_never_shown(tiny_llm: Callable[..., LLM], redis_server: RedisServer,
                                   caplog: pytest.LogCaptureFixture) -> None:
    from kvserve.server.metrics import Metrics

    caplog.set_level(logging.DEBUG)
    llm = tiny_llm(kv_remote=redis_server.url, kv_remote_secret="hunter2-secret")
    tokens(llm)
    redis_server.stop()
    tokens(llm, [(3 * j + 1) % 128 for j in range(40)])  # a miss: the dead server's warning
    assert llm.engine.remote.stats.errors == 1
    metrics = Metrics()
    metrics.observe_step(llm.engine)
    shown = repr(llm.engine.config) + caplog.text + metrics.render().decode()
    with pytest.raises(ValueError, match="CacheOptions.kv_remote_secret must be str") as refused:
        EngineConfig.of(kv_remote="redis://x", kv_remote_secret=b"hunter2-secret")  # type: ignore[arg-type]
    assert "hunter2" not in shown + str(refused.value)


def test_the_secret_has_its_flag() -> None:
    args = build_parser().parse_args(["bench", "throughput", "--kv-remote", "redis://127.0.0.1:1/0",
                                      "--kv-remote-secret", "k"])
    assert engine_kwargs(args)["kv_remote_secret"] == "k"


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_remote": "http://127.0.0.1:6379"}, "kv_remote"),
    ({"kv_remote": "redis://x", "enable_prefix_caching": False}, "kv_remote"),
    ({"kv_remote": "redis://x", "kv_cache_dtype": "kivi4"}, "kv_remote"),
    ({"kv_remote": "redis://x", "kv_cache_dtype": "int8", "kv_residual": 16}, "kv_remote"),
    ({"kv_remote_timeout": 0}, "kv_remote_timeout"),
    ({"kv_remote_secret": "k"}, "kv_remote_secret"),  # no kv_remote: it would protect nothing
    ({"kv_remote": "redis://x", "kv_remote_secret": ""}, "kv_remote_secret"),
])
def test_bad_remote_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.of(**kwargs)


def test_the_tier_counts_show_in_metrics(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    from kvserve.server.metrics import Metrics

    outputs(tiny_llm(kv_remote=redis_server.url), [PROMPT])
    b = tiny_llm(kv_remote=redis_server.url)
    outputs(b, [PROMPT])
    metrics = Metrics()
    metrics.observe_step(b.engine)
    text = metrics.render().decode()
    assert 'kvserve_kv_remote_blocks_total{event="hits"} 4.0' in text
    assert 'kvserve_kv_remote_blocks_total{event="corrupt"} 0.0' in text


def test_a_step_copies_before_it_loads(tiny_llm: Callable[..., LLM]) -> None:
    """A copy-on-write may read a block that a sample preempted in the same step gave back, and an
    admission of that step may load remote pages into it: the runner copies first, so the copy
    reads the block's own pages (a copy never reads a block loaded in its step)."""
    from kvserve.cache.block_bytes import read_blocks
    from kvserve.cache.block_ops import BlockOps
    from kvserve.engine.model_runner import BlockMoves

    runner = tiny_llm().engine.runner
    tensors = runner.pool.block_tensors
    for value, block in ((1.0, 1), (7.0, 3)):
        for t in tensors:
            t[block].fill_(value)
    own, remote = read_blocks(tensors, [1, 3])
    runner.apply(BlockMoves(BlockOps(copies=((1, 2),), loads=((1, remote),)), None))
    assert read_blocks(tensors, [2, 1]) == [own, remote]
