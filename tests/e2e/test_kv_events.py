"""KV-cache events from a real engine, read by a ZeroMQ subscriber as llm-d's indexer or the gateway would."""
from __future__ import annotations

import json
import random
import time

import pytest

from kestrel import Engine, SamplingParams
from kestrel.cache.kv_events import external_hash, page_digest, seed_digest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


def events_config(tmp_path) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
                       "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv@replica-0@tiny"})


def receive_until_cleared(sub, timeout_s: float = 20.0) -> list[list[bytes]]:
    """Every message up to and including the batch holding AllBlocksCleared."""
    messages, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            messages.append(sub.recv_multipart())
            if any(e[0] == "AllBlocksCleared" for e in msgpack.unpackb(messages[-1][2])[1]):
                return messages
    raise AssertionError(f"no AllBlocksCleared within {timeout_s} s ({len(messages)} messages)")


def tree_hashes(radix) -> set[int]:
    """The hash of every page the radix tree holds, chained from its own content."""
    hashes, stack = set(), [(child, seed_digest("")) for child in radix.root.children.values()]
    while stack:
        node, prev = stack.pop()
        for i in range(0, len(node.key), PAGE):
            prev = page_digest(prev, node.key[i:i + PAGE])
            hashes.add(external_hash(prev))
        stack += [(child, prev) for child in node.children.values()]
    return hashes


def test_events_track_the_radix_tree_and_replay(tiny_model, tmp_path):
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(32)]
    prompts = [base[:rng.randrange(8, 32)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]
               for _ in range(12)]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    # A pool of 96 tokens for 12 prompts of up to 46 tokens, 4 at a time: the tree must evict.
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=96,
                kv_events_config=events_config(tmp_path)) as engine:
        sub.connect(f"ipc://{tmp_path}/pub")
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        for i in range(0, len(prompts), 4):
            engine.generate(prompt_token_ids=prompts[i:i + 4], sampling_params=GREEDY, use_tqdm=False)
        cached = tree_hashes(engine.radix)
        assert engine.flush_cache()
        messages = receive_until_cleared(sub)
        assert engine.radix.total_size() == 0
        alloc = engine.kv_memory.allocator
        assert alloc.available_size() == alloc.size

        # Replay from the third batch: the same frames, then the end marker. A DEALER sends the empty
        # delimiter a REQ socket would add, and takes the many replies a REQ socket could not.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/replay")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert empty == b"" and payload == b""
                break
            replayed.append([seq, payload])
        dealer.close(linger=0)
    sub.close(linger=0)

    assert all(topic == b"kv@replica-0@tiny" for topic, _, _ in messages)
    assert [int.from_bytes(seq, "big") for _, seq, _ in messages] == list(range(len(messages)))
    assert replayed == [m[1:] for m in messages[2:]]

    live: dict[int, bytes] = {}  # stored and not removed yet: hash -> digest
    removed = 0
    batches = [msgpack.unpackb(payload) for _, _, payload in messages]
    for ts, events, rank in batches:
        assert isinstance(ts, float) and rank == 0
        for event in events:
            if event[0] == "BlockStored":
                # vLLM's field order: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                # lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window.
                hashes, parent, tokens, size, lora_id, medium, *rest = event[1:]
                assert size == PAGE and len(tokens) == PAGE * len(hashes) and medium == "GPU"
                assert lora_id is None and rest == [None] * 5
                prev = seed_digest("") if parent is None else live[parent]  # the parent is cached
                for h, i in zip(hashes, range(0, len(tokens), PAGE)):
                    prev = page_digest(prev, tokens[i:i + PAGE])
                    assert h == external_hash(prev) and h not in live
                    live[h] = prev
            elif event[0] == "BlockRemoved":
                assert event[2:] == ["GPU", None]
                for h in event[1]:
                    del live[h]  # removed only once, and only after it was stored
                    removed += 1
            else:
                assert event == ["AllBlocksCleared"]
                assert set(live) == cached, "before the flush, the stored minus the removed are the tree's pages"
                live.clear()
    assert removed > 0 and cached


def test_bad_config_is_a_start_up_error(tiny_model, capsys):
    from kestrel.cli import main

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown field.*'port'"):
        Engine(model=model, device="cpu", kv_events_config='{"enable_kv_cache_events": true, "port": 5557}')
    assert main(["generate", "--model", model, "--device", "cpu", "--prompt-token-ids", "1,2",
                 "--kv-events-config", '{"enable_kv_cache_events": 1}']) == 2
    assert "kv_events_config: enable_kv_cache_events must be bool, got 1" in capsys.readouterr().err
