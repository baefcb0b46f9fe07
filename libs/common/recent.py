"""A bounded set of recently seen request ids (e.g. cancelled ones), oldest forgotten first."""

from collections import OrderedDict

from libs.protocol.ids import RequestId


class RecentIds:
    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: RequestId) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._ids
