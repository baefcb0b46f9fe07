"""What holders of KV blocks agree on and grant each other: the KV contract, a write
ticket, a worker's fitted cost model, whose blocks a put stores."""

import msgspec

from libs.protocol.vocabulary import StoreTier


class CacheOwner(msgspec.Struct, frozen=True, kw_only=True):
    """Whose blocks a prompt's are in the stores: a tenant's cache scope, by name (never its
    secret), and the most of a store's DRAM tier its blocks keep when room is needed."""

    name: str  # tenant/<name> or shared/<scope>
    share: float | None = None  # None: no limit


class KVContract(msgspec.Struct, frozen=True, kw_only=True):
    """What two holders of KV blocks must agree on to exchange them byte for byte."""

    model_id: str
    block_size: int
    layout: str  # KVLayout.describe(): shape and dtype of one block
    hash_scheme: str
    quantization: str = "none"  # the weights' precision: KV computed with other weights is other KV

    def mismatch(self, other: "KVContract") -> str | None:
        """None if compatible, else a sentence naming every field that differs."""
        diffs = [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "KV contract mismatch: " + "; ".join(diffs) if diffs else None


class WriteTicket(msgspec.Struct, frozen=True, kw_only=True):
    """A receiver's grant to write into some of its memory, for one transfer.

    Same host: the sender maps ``segment`` (shared memory) and copies. Other host:
    it connects to ``address`` and proves it holds ``token`` (a secret: it never
    crosses the data plane), which the receiver issued for this transfer alone and
    accepts for no other ranges, for each byte once, and no longer than the lease.
    ``address`` is None when the receiver issued it for a writer on its own host.
    A new ticket is needed for every transfer.
    """

    token: str
    host_id: str
    segment: str
    address: str | None = None  # "host:port" of the receiver's TCP listener


class CostCoefficients(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's cost model in seconds, fitted at start-up on its own hardware
    (`libs/engine/cost_model.py` holds the formulas and the calibration).

    prefill(n new tokens after c cached) = base + per_token·n + per_token_context·n·(c + n/2)
    decode step(batch b, total context t) = base + per_seq·b + per_context_token·t
    """

    block_size: int
    prefill_base: float
    prefill_per_token: float
    prefill_per_token_context: float  # per new token per token it attends to
    decode_base: float
    decode_per_seq: float
    decode_per_context_token: float
    transfer_per_block: float  # one KV block copied between shared-memory segments
    load_per_block: dict[StoreTier, float] = msgspec.field(default_factory=dict)  # a store's tiers
