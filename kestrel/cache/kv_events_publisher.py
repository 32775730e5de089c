"""The ZeroMQ publisher of KV-cache events: vLLM's sockets and framing, on a thread of its own.

PUB socket: one multipart message per engine step that changed the cache, `[topic, sequence number
(8 bytes, big-endian, from 0 without gaps), msgpack EventBatch]`. ROUTER socket (optional): a request
`[identity, b"", start (8 bytes, big-endian)]` is answered with every buffered batch from `start` on, each
`[identity, b"", sequence, payload]`, then `[identity, b"", -1 (8 bytes, signed), b""]`.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from kestrel.cache.kv_events import encode_batch
from kestrel.cache.kv_events_config import KVEventsConfig
from kestrel.cache.kv_events_log import BlockChains, KVEventLog

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits for a step before it looks at the replay socket again.
POLL_S = 0.02
CLOSE_TIMEOUT_S = 5.0


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or ipc / inproc) is bound, any other one connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, chains: BlockChains, data_parallel_rank: int = 0) -> None:
        import zmq

        self.chains = chains
        self.topic = config.topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[tuple]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") from None
        # The sockets belong to the thread from here on (ZeroMQ sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (replay: %s, topic %r)", config.endpoint,
                    config.replay_endpoint or "none", config.topic)

    def submit(self, ts: float, records: list[tuple]) -> None:
        """Queue one step's records; blocks while max_queue_size steps wait (the engine then waits too)."""
        self._queue.put((ts, records))

    def close(self) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the KV-event publisher did not finish its queue in %.0f s; closing it", CLOSE_TIMEOUT_S)
        self._ctx.destroy(linger=0)

    # ---- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("answering a KV-event replay request failed")
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, records = item
            try:
                events = self.chains.events(records)
                if not events:  # a step that only split nodes changed no block
                    continue
                payload = encode_batch(ts, events, self.data_parallel_rank)
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            except Exception:  # noqa: BLE001 - a bad batch must not end publishing for the engine's lifetime
                logger.exception("publishing a KV-event batch failed; it is dropped")
                continue
            self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a KV-event replay request of %d frames: it needs [identity, b'', 8-byte start]",
                           len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])


def open_kv_event_log(config: KVEventsConfig | None, page_size: int, seed: str) -> KVEventLog | None:
    """The radix cache's event log, publishing as `config` says; None when events are off."""
    if config is None or not config.publishes:
        return None
    return KVEventLog(ZmqEventPublisher(config, BlockChains(page_size, seed)))
