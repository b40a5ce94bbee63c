"""KV events over ZeroMQ, read by a client written against vLLM's event schema (msgspec structs
as vllm/distributed/kv_events.py declares them): the stream replayed into an index equals the
engine's prefix cache after a workload whose small pool evicts, and a subscriber that joins late
catches up through the replay socket."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from kvserve import LLM, SamplingParams
from kvserve.net import free_loopback_port


# vLLM's schema, field for field (vllm/distributed/kv_events.py).
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def apply(batch: KVEventBatch, index: set[bytes]) -> int:
    """Applies the batch; returns how many blocks it removed."""
    removed = 0
    for event in batch.events:
        if isinstance(event, BlockStored):
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= index, "removed a block never stored"
            index.difference_update(event.block_hashes)
            removed += len(event.block_hashes)
        else:
            index.clear()
    return removed


def drain(sub: zmq.Socket, index: set[bytes], quiet_s: float = 0.5) -> tuple[list[int], int]:
    """Every message until none arrives for `quiet_s`; returns their sequence numbers and the
    blocks they removed."""
    seqs, removed = [], 0
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seqs.append(int.from_bytes(seq, "big"))
        removed += apply(DECODER.decode(payload), index)
    return seqs, removed


@pytest.fixture
def engine_with_events(tiny_llm: Callable[..., LLM]) -> tuple[LLM, str, str]:
    pub, replay = f"tcp://127.0.0.1:{free_loopback_port()}", f"tcp://127.0.0.1:{free_loopback_port()}"
    llm = tiny_llm(kv_events_publisher="zmq", kv_events_endpoint=pub,
                   kv_events_replay_endpoint=replay, kv_events_topic="kv", block_size=4, kv_cache_memory="96KiB")
    yield llm, pub, replay
    llm.engine.close()


def test_the_event_stream_rebuilds_the_prefix_cache(engine_with_events: tuple[LLM, str, str]) -> None:
    llm, pub, replay = engine_with_events
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    index: set[bytes] = set()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[(5 * i + j) % 100 + 3 for i in range(30 + 3 * j)] for j in range(6)]
    for round_ in range(3):
        llm.generate(prompts[round_ * 2:] + prompts[:1], params, use_tqdm=False)
    seqs, removed = drain(sub, index)
    bm = llm.engine.block_manager
    assert index == set(bm.cache) and index and removed  # the small pool evicted, and said so
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, none lost
    assert bm.pool.medium == "CPU"

    # A subscriber that joins now asks the replay socket for everything from batch 0.
    late: set[bytes] = set()
    req = context.socket(zmq.DEALER)
    req.connect(replay)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert req.poll(5000), "the replay socket did not answer"
        _, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        apply(replayed[-1][1], late)
    assert late == set(bm.cache)
    # The engine's first batch says its cache starts empty (a restarted replica holds nothing).
    assert replayed[0][0] == 0 and replayed[0][1].events == [AllBlocksCleared()]
    sub.close(linger=0)
    req.close(linger=0)
