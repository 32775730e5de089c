"""`--kv-events-config`: vLLM's JSON option for publishing KV-cache events, parsed and checked.

The fields and their defaults are vLLM's (`KVEventsConfig`), so a deployment written for vLLM starts
kestrel unchanged. docs/kv-events.md says what is published.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" once events are enabled, unless given
    endpoint: str = "tcp://*:5557"  # PUB: bound when it holds a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # ROUTER answering replay requests; none: no replay
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000  # steps waiting for the publisher thread before the engine blocks
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,), "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,), "topic": (str,),
}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config a JSON object gives (vLLM's field names). Raises ValueError naming what is wrong."""
    where = "kv_events_config"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} must be a JSON object such as '{{\"enable_kv_cache_events\": true, "
                         f"\"endpoint\": \"tcp://*:5557\"}}'; it does not parse: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(raw).__name__}")
    names = [f.name for f in fields(KVEventsConfig)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; valid fields: {', '.join(names)}")
    for name, value in raw.items():
        # bool is an int in Python: a count given as true is refused too.
        if not isinstance(value, _TYPES[name]) or (bool not in _TYPES[name] and isinstance(value, bool)):
            kinds = " or ".join("null" if t is type(None) else t.__name__ for t in _TYPES[name])
            raise ValueError(f"{where}: {name} must be {kinds}, got {json.dumps(value)}")
    values: dict[str, Any] = dict(raw)
    values.setdefault("publisher", "zmq" if values.get("enable_kv_cache_events") else "null")
    config = KVEventsConfig(**values)
    if config.publisher not in ("null", "zmq"):
        raise ValueError(f"{where}: publisher must be 'zmq' or 'null', got {config.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {getattr(config, name)}")
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, name)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{where}: {name} must be a ZeroMQ address (tcp://HOST:PORT, ipc://PATH or "
                             f"inproc://NAME), got {endpoint!r}")
    if config.publishes:
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as e:
            raise ValueError(f"{where}: publishing KV-cache events needs pyzmq and msgpack ({e}); install them with "
                             "`pip install 'kestrel[kv-events]'`") from None
    return config
