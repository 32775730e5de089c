"""The Responses API's stored responses, for `previous_response_id` and `GET /v1/responses/{id}`.

In memory and bounded: the least recently used response goes once `capacity` are held
(`--responses-store-size`), so a long-running server's memory does not grow with its traffic. A
response is lost with the server; clients that need it longer send the conversation themselves.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as the client got it
    items: list[dict[str, Any]]  # the conversation up to and including its output, as input items


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._held[response_id] = stored
        self._held.move_to_end(response_id)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._held.get(response_id)
        if stored is not None:
            self._held.move_to_end(response_id)
        return stored
