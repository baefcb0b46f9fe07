"""Routing policies: given a request and the cluster view, pick a prefill and a
decode instance, or say why none can serve it. Plain classes behind one
interface, importable without NATS, so a simulator can run the same code."""

from dataclasses import dataclass
from typing import Protocol

from libs.common.schema import AdmitRequest
from services.conductor.cluster import ClusterView, Instance


@dataclass(frozen=True)
class Decision:
    prefill_id: str | None = None
    decode_id: str | None = None
    error_code: str | None = None  # no_prefill, no_decode, no_instances
    error_message: str | None = None

    @property
    def admitted(self) -> bool:
        return self.error_code is None


class Policy(Protocol):
    name: str

    def choose(self, request: AdmitRequest, view: ClusterView) -> Decision: ...


def missing_roles(prefills: list[Instance], decodes: list[Instance]) -> Decision | None:
    """The rejection to give when a role has no live instance, else None."""
    if not prefills and not decodes:
        return Decision(error_code="no_instances", error_message="no prefill and no decode instance is alive")
    if not prefills:
        return Decision(error_code="no_prefill", error_message="no prefill instance is alive")
    if not decodes:
        return Decision(error_code="no_decode", error_message="no decode instance is alive")
    return None


class LeastLoaded:
    """The instance of each role with the fewest requests; ties go to the most free
    KV blocks, then to the smallest id (so choices are deterministic)."""

    name = "least_loaded"

    def choose(self, request: AdmitRequest, view: ClusterView) -> Decision:
        prefills, decodes = view.alive("prefill"), view.alive("decode")
        missing = missing_roles(prefills, decodes)
        if missing is not None:
            return missing
        return Decision(prefill_id=_least_loaded(prefills).instance_id, decode_id=_least_loaded(decodes).instance_id)


def _least_loaded(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: (i.load, -i.heartbeat.free_blocks, i.instance_id))


POLICIES: dict[str, type] = {LeastLoaded.name: LeastLoaded}
