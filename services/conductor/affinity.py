"""Session affinity: a conversation's turns stay on the instances that served its
last turn (whose caches hold its KV) unless the cost model predicts moving is
cheaper. A session is named by the client (the ``x-session-id`` header, or the
OpenAI ``user`` field); the table remembers the most recent sessions only.
"""

from collections import OrderedDict
from dataclasses import dataclass

from libs.common.vocabulary import Role
from services.conductor.policies import Route
from services.conductor.predict import AdmitContext

MAX_SESSIONS = 100_000


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
    prefill, decode, said = route.prefill, route.decode, []
    here = ctx.instance(home.prefill_id, Role.PREFILL)
    if home.prefill_id == home.decode_id:
        said.append(f"last turn prefilled on its decode worker {home.decode_id}")
    elif here is None:
        said.append(f"prefill moved from {home.prefill_id} (gone) to {prefill.instance_id}")
    elif here.instance_id == prefill.instance_id:
        said.append(f"prefill kept on {here.instance_id}")
    else:
        stay = ctx.prefill_estimate(here)
        if stay.ttft_s <= prefill.ttft_s:
            said.append(f"prefill kept on {here.instance_id} (predicted TTFT {stay.ttft_s:.3f} s, "
                        f"{prefill.ttft_s:.3f} s on {prefill.instance_id})")  # fmt: skip
            prefill = stay
        else:
            said.append(f"prefill moved from {here.instance_id} to {prefill.instance_id}: predicted TTFT "
                        f"{prefill.ttft_s:.3f} s there, {stay.ttft_s:.3f} s on {here.instance_id}")  # fmt: skip
    there = ctx.instance(home.decode_id, Role.DECODE)
    if there is None:
        said.append(f"decode moved from {home.decode_id} (gone) to {decode.instance_id}")
    elif there.instance_id == decode.instance_id:
        said.append(f"decode kept on {there.instance_id}")
    else:
        stay = ctx.decode_all(there)
        if stay.tbt_s <= decode.tbt_s:
            said.append(f"decode kept on {there.instance_id} (predicted TBT {stay.tbt_s * 1e3:.1f} ms, "
                        f"{decode.tbt_s * 1e3:.1f} ms on {decode.instance_id})")  # fmt: skip
            decode = stay
        else:
            said.append(f"decode moved from {there.instance_id} to {decode.instance_id}: predicted TBT "
                        f"{decode.tbt_s * 1e3:.1f} ms there, {stay.tbt_s * 1e3:.1f} ms on {there.instance_id}")
    return Route(prefill, decode), "; ".join(said)
