"""The process-local store of Responses: an LRU bounded by record count and bytes.

A record holds everything a later request needs from a Response: the terminal object
(for GET), the canonical Items its request supplied (for ``input_items``), the whole
conversation after it (for ``previous_response_id``), the resolved
``preserve_thinking`` its children inherit, and the transcript whose tokens a
continuation reuses. A record's conversation shares Item objects with its parent's,
so deleting or evicting a parent leaves its descendants fully usable. Sizes are
estimated from the JSON size of everything a record keeps reachable, so a chain is
counted in full by each of its records: the budget errs on the side of memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import attrs
import msgspec

from ninfer.errors import InvalidRequestError
from ninfer_plugins.protocols.openai_responses.items import Item
from ninfer_plugins.protocols.openai_responses.transcript import Transcript

MIB = 1 << 20
#: rough per-Item bookkeeping (dict and list overhead) on top of its JSON size
ITEM_OVERHEAD = 64


def json_size(value: Any) -> int:
    return len(msgspec.json.encode(value))


@attrs.frozen
class StoredResponse:
    response: dict[str, Any]
    input_items: list[Item]
    #: the conversation a child continues: earlier Items, this request's input, this output
    conversation: tuple[Item, ...]
    conversation_bytes: int
    preserve_thinking: bool
    transcript: Transcript

    @property
    def nbytes(self) -> int:
        return json_size(self.response) + json_size(self.input_items) + self.conversation_bytes + \
            self.transcript.nbytes


def conversation_bytes(items: Any) -> int:
    return sum(json_size(item) + ITEM_OVERHEAD for item in items)


class StoreCapacityError(InvalidRequestError):
    code = "response_store_capacity_exceeded"


class ResponseStore:
    def __init__(self, max_records: int, max_mib: int):
        self.max_records = max_records
        self.max_bytes = max_mib * MIB
        self.bytes = 0
        self._records: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def check_fits(self, size: int) -> None:
        """Refuse a Response that could never be kept, before or after generating it."""
        if size > self.max_bytes:
            raise StoreCapacityError(
                f"this Response needs about {size / MIB:.1f} MiB but the response store holds "
                f"{self.max_bytes / MIB:g} MiB; send store: false to skip storing it", param="store")

    def put(self, response_id: str, record: StoredResponse) -> None:
        size = record.nbytes
        self.check_fits(size)
        self.delete(response_id)
        while self._records and (len(self._records) >= self.max_records or self.bytes + size > self.max_bytes):
            _, (_, evicted) = self._records.popitem(last=False)
            self.bytes -= evicted
        self._records[response_id] = (record, size)
        self.bytes += size

    def get(self, response_id: str) -> Optional[StoredResponse]:
        """The record, now the most recently used; None when unknown, evicted or deleted."""
        entry = self._records.get(response_id)
        if entry is None:
            return None
        self._records.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry[1]
        return True
