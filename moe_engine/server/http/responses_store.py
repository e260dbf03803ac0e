"""The in-memory store of past responses, for `previous_response_id` and GET /v1/responses/{id}.

Bounded and least-recently-used: at most `MAX_RESPONSES` responses and `MAX_CHARS` characters
of stored conversation text in all; the least recently created or continued response goes
first. The store lives as long as the server (nothing is written to disk), so a
`previous_response_id` from before a restart, evicted, or never stored (`store: false`) is
unknown: HTTP 400 as OpenAI answers (`code` "previous_response_not_found").

Each entry keeps the whole conversation that led to it (its input, earlier turns included, and
its output as chat messages), so continuing it never needs an evicted ancestor. The
`instructions` of a response are not part of it (OpenAI: they are not carried over).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from moe_engine.server.http.errors import OpenAIError

#: The most responses kept (count).
MAX_RESPONSES = 1024
#: The most characters of stored conversations and responses kept, in all (about 4 bytes each
#: at worst in memory: 64 Mi characters).
MAX_CHARS = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    """One stored response: the conversation it ends (chat messages, outputs included) and
    the response object as it was returned."""

    conversation: list[dict[str, Any]]
    response: dict[str, Any]
    chars: int


class ResponseStore:
    """An LRU map of response id -> StoredResponse, bounded by count and characters."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.chars = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, conversation: list[dict[str, Any]],
            response: dict[str, Any]) -> None:
        """Keep a response; evicts the least recently used ones past either bound (a single
        response over `max_chars` is not kept)."""
        chars = len(json.dumps(conversation)) + len(json.dumps(response))
        if chars > self.max_chars:
            return
        self._entries[response_id] = StoredResponse(conversation, response, chars)
        self.chars += chars
        while len(self._entries) > self.max_responses or self.chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self.chars -= old.chars

    def get(self, response_id: str, field: str = "previous_response_id") -> StoredResponse:
        """The stored response (now the most recently used).

        Raises:
            OpenAIError: 400 naming `field` for an unknown id (404 on GET by id: pass
                field "response_id").
        """
        entry = self._entries.get(response_id)
        if entry is None:
            status = 404 if field == "response_id" else 400
            code = "not_found" if status == 404 else "previous_response_not_found"
            raise OpenAIError(
                status, f"{field}: no response with id {response_id!r} in this server's store "
                f"(it keeps the last {self.max_responses} stored responses of its lifetime)",
                field, code,
            )
        self._entries.move_to_end(response_id)
        return entry
