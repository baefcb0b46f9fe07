"""Session affinity: a conversation's turns stay on the instances that served its
last turn (whose caches hold its KV) unless the cost model predicts moving is
cheaper. A session is named by the client (the ``x-session-id`` header, or the
OpenAI ``user`` field); the table remembers the most recent sessions only.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from libs.protocol.vocabulary import Role
from services.conductor.predict import AdmitContext
from services.conductor.routers import Route

MAX_SESSIONS = 100_000
E = TypeVar("E")  # a role's estimate for one instance


@dataclass(frozen=True)
class Home:
    prefill_id: str  # where its last turn was prefilled (the decode worker itself under conditional disaggregation)
    decode_id: str


class SessionTable:
    """session id -> the instances of its last admitted turn, least recently used first out."""

    def __init__(self, capacity: int = MAX_SESSIONS) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, Home] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, session_id: str | None) -> Home | None:
        if session_id is None:
            return None
        home = self._homes.get(session_id)
        if home is not None:
            self._homes.move_to_end(session_id)
        return home

    def set(self, session_id: str, home: Home) -> None:
        self._homes[session_id] = home
        self._homes.move_to_end(session_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)


def stay_or_move(ctx: AdmitContext, route: Route, home: Home) -> tuple[Route, str]:
    """The route for a session's new turn, and why: the home instances where they are
    alive and predicted no slower than the router's choice, else the choice."""
    if home.prefill_id == home.decode_id:
        prefill, why_prefill = route.prefill, f"last turn prefilled on its decode worker {home.decode_id}"
    else:
        prefill, why_prefill = _stay_or_move("prefill", ctx.instance(home.prefill_id, Role.PREFILL), home.prefill_id,
                                             route.prefill, ctx.prefill_estimate, _TTFT)  # fmt: skip
    decode, why_decode = _stay_or_move("decode", ctx.instance(home.decode_id, Role.DECODE), home.decode_id,
                                       route.decode, ctx.decode_all, _TBT)  # fmt: skip
    return Route(prefill, decode), f"{why_prefill}; {why_decode}"


@dataclass(frozen=True)
class _Latency:
    """The prediction a role's choice is judged by, and how it is written."""

    name: str
    of: Callable[[Any], float]
    show: Callable[[float], str]


_TTFT = _Latency("TTFT", lambda estimate: estimate.ttft_s, lambda s: f"{s:.3f} s")
_TBT = _Latency("TBT", lambda estimate: estimate.tbt_s, lambda s: f"{s * 1e3:.1f} ms")


def _stay_or_move(role: str, here: Any, home_id: str, choice: E, estimate: Callable[[Any], E],
                  latency: _Latency) -> tuple[E, str]:  # fmt: skip
    """One role's instance for the turn: its home ``here`` (None: gone) where predicted
    no slower than the router's ``choice``, else the choice; and why."""
    if here is None:
        return choice, f"{role} moved from {home_id} (gone) to {choice.instance_id}"
    if here.instance_id == choice.instance_id:
        return choice, f"{role} kept on {here.instance_id}"
    stay = estimate(here)
    ours, theirs = latency.show(latency.of(stay)), latency.show(latency.of(choice))
    if latency.of(stay) <= latency.of(choice):
        return stay, (f"{role} kept on {here.instance_id} (predicted {latency.name} {ours}, "
                      f"{theirs} on {choice.instance_id})")  # fmt: skip
    return choice, (f"{role} moved from {here.instance_id} to {choice.instance_id}: predicted {latency.name} "
                    f"{theirs} there, {ours} on {here.instance_id}")  # fmt: skip
