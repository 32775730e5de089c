"""KV-cache events: the config, vLLM's wire bytes and the block-hash chain, without an engine."""
from __future__ import annotations

import hashlib

import pytest

from kestrel.cache.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, encode_batch, external_hash,
                                     page_digest, seed_digest)
from kestrel.cache.kv_events_config import KVEventsConfig, parse_kv_events_config
from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.kv_events_log import BlockChains, KVEventLog
from kestrel.cache.radix import NAMESPACE_SHIFT, RadixCache

pytest.importorskip("msgpack")

# Encoded by msgspec 0.23 from mirrors of vLLM's EventBatch / BlockStored / BlockRemoved / AllBlocksCleared
# (array_like, omit_defaults, tag=True; BlockStored with extra_keys, group_idx, kv_cache_spec_kind and
# kv_cache_spec_sliding_window after lora_name) for the batch built in test_batch_bytes_equal_vllms.
VLLM_BATCH_HEX = (
    "93cb41d954fc40100000949cab426c6f636b53746f72656492cfffffffffffffffff07c0940102cd012cce0001117002c0a347"
    "5055c0c0c0c0c09cab426c6f636b53746f726564910ccfffffffffffffffff92050602c0a3475055c0c0c0c0c094ac426c6f63"
    "6b52656d6f76656492070ca3475055c091b0416c6c426c6f636b73436c656172656400")

# sha256(cbor2.dumps(x, canonical=True)) as vLLM's sha256_cbor computes it: the seed "" and two chained pages.
SEED_DIGEST = "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3"
PAGE1 = "b0744d21dc84d24539c685aa47953f3cc5296757a7d5b0102b5674fe919251b6"  # tokens 1, 2, 3, 4
PAGE2 = "aafab45e78c34e87839e452a9176fbad63193dedd0d1fa6af25b58e74d4dba0c"  # tokens 100..139 after PAGE1


def test_config_takes_vllms_fields_and_defaults():
    c = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                               '"replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000, '
                               '"hwm": 100000, "max_queue_size": 10}')
    assert c.publishes and c.replay_endpoint == "tcp://*:5558" and c.topic == "kv-events" and c.max_queue_size == 10
    assert parse_kv_events_config('{"enable_kv_cache_events": true}') == KVEventsConfig(True, "zmq")
    assert not parse_kv_events_config("{}").publishes  # vLLM: publisher "null" unless events are enabled


@pytest.mark.parametrize("text, message", [
    ("{bad", "does not parse"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "port": 5557}', "unknown field(s) 'port'; valid fields: enable_kv_cache_events"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
    ('{"buffer_steps": true}', "buffer_steps must be int"),
    ('{"hwm": 0}', "hwm must be >= 1"),
    ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
    ('{"endpoint": "localhost:5557"}', "endpoint must be a ZeroMQ address"),
])
def test_bad_config_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match="kv_events_config") as e:
        parse_kv_events_config(text)
    assert message in str(e.value)


def test_batch_bytes_equal_vllms():
    top = 2**64 - 1  # the largest hash: a uint64 on the wire, as msgspec writes it
    events = [BlockStored([top, 7], None, [1, 2, 300, 70000], 2), BlockStored([12], top, [5, 6], 2),
              BlockRemoved([7, 12]), AllBlocksCleared()]
    assert encode_batch(1700000000.25, events, 0).hex() == VLLM_BATCH_HEX


def test_block_hashes_are_vllms_sha256_cbor_chain():
    root = seed_digest("")
    assert root.hex() == SEED_DIGEST
    first = page_digest(root, [1, 2, 3, 4])
    assert first.hex() == PAGE1
    assert page_digest(first, list(range(100, 140))).hex() == PAGE2  # a 40-long array: a two-byte CBOR head
    assert external_hash(first) == int(PAGE1[-16:], 16)


class _Collect:
    def __init__(self):
        self.batches = []

    def submit(self, ts, records):
        self.batches.append(records)

    def close(self):
        pass


def test_chains_follow_splits_and_evictions():
    sink = _Collect()
    log = KVEventLog(sink)
    alloc = TokenToKVPoolAllocator(64, 2, "cpu")
    radix = RadixCache(alloc, 2, events=log)
    a = [1, 2, 3, 4, 5, 6]
    radix.insert(a, alloc.alloc_for(0, 6, 0))
    b = alloc.alloc_for(0, 6, 0)
    assert radix.insert([1, 2, 3, 4, 9, 9], b) == 4  # splits a's node after 4 tokens
    alloc.free(b[:4])  # the caller's duplicates
    log.end_step()
    radix.evict(64)
    log.end_step()
    radix.flush()
    log.end_step()
    chains = BlockChains(2, "")
    stored, removed, cleared = chains.events(sink.batches[0]), chains.events(sink.batches[1]), chains.events(sink.batches[2])
    d = [seed_digest("")]
    for page in ([1, 2], [3, 4], [5, 6]):
        d.append(page_digest(d[-1], page))
    h = [external_hash(x) for x in d[1:]]
    other = external_hash(page_digest(d[2], [9, 9]))
    assert stored == [BlockStored(h, None, a, 2), BlockStored([other], h[1], [9, 9], 2)]
    assert sorted(sum((e.block_hashes for e in removed), [])) == sorted(h + [other])
    assert cleared == [AllBlocksCleared()] and chains.pages == {}
    assert alloc.available_size() == alloc.size


def test_a_lora_adapters_pages_carry_its_id_and_hash_apart():
    """A LoRA request's radix key lives in its adapter's namespace: its events carry the real token ids
    and the adapter's id, and its pages hash with the id as the extra key ([parent, tokens, [id]])."""
    sink = _Collect()
    log = KVEventLog(sink)
    alloc = TokenToKVPoolAllocator(64, 2, "cpu")
    radix = RadixCache(alloc, 2, events=log)
    tokens = [1, 2, 3, 4]
    radix.insert(tokens, alloc.alloc_for(0, 4, 0))
    radix.insert([t + 3 * NAMESPACE_SHIFT for t in tokens], alloc.alloc_for(0, 4, 0))
    log.end_step()
    base, lora = BlockChains(2, "").events(sink.batches[0])
    assert (lora.token_ids, lora.lora_id, base.lora_id) == (tokens, 3, None)
    root = seed_digest("")
    first = hashlib.sha256(b"\x83\x58\x20" + root + b"\x82\x01\x02\x81\x03").digest()  # CBOR by hand
    assert lora.block_hashes[0] == external_hash(first) != base.block_hashes[0]
    assert lora.parent_block_hash is None
