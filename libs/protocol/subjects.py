"""Every NATS subject kvserve uses, built in one place.

Layout: ``kvserve.<area>.<...>``. Per-instance subjects carry the instance id;
per-request subjects carry the request id. Ids are validated to be a single
subject token, so no caller can address a subject it was not meant to.
"""

import re

from libs.protocol.ids import InstanceId, RequestId

PREFIX = "kvserve"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _token(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} cannot be used in a NATS subject (letters, digits, '-' and '_' only)")
    return value


# --- cluster membership -------------------------------------------------------
def heartbeat(role: str, instance_id: InstanceId) -> str:
    """An instance publishes its Heartbeat here once a second: the subject names its
    sender, so NATS lets an instance speak only for itself (libs/common/nats_auth.py)."""
    return f"{PREFIX}.heartbeat.{_token(role)}.{_token(instance_id)}"


def heartbeats(role: str) -> str:
    """The heartbeats of every instance of ``role``."""
    return f"{PREFIX}.heartbeat.{_token(role)}.*"


def names_sender(subject: str, role: str, instance_id: InstanceId) -> bool:
    """Whether a `heartbeat` subject names the role and instance a heartbeat says it is from:
    a heartbeat that claims to be another's is not to be believed."""
    return subject == f"{PREFIX}.heartbeat.{role}.{instance_id}"


HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*.*"
# A newly started service asks here (RollCall) and every instance answers at once with
# its heartbeat, so no one has to wait up to a heartbeat interval to see its peers.
ROLL_CALL = f"{PREFIX}.rollcall"

# --- conductor ----------------------------------------------------------------
CONDUCTOR_ADMIT = f"{PREFIX}.conductor.admit"  # request/reply, queue group "conductor"
CONDUCTOR_QUEUE = "conductor"
CONDUCTOR_PROGRESS = f"{PREFIX}.conductor.progress"  # gateway -> every conductor: RequestProgress
CONDUCTOR_ADMITTED = f"{PREFIX}.conductor.admitted"  # conductor -> every conductor replica: ConductorAdmission


def conductor_view(instance_id: InstanceId) -> str:
    """Gateway -> one conductor: its KV map and recent decisions, for the console (request/reply)."""
    return f"{PREFIX}.conductor.{_token(instance_id)}.view"


# --- KV events ------------------------------------------------------------------
def kv_events(instance_id: InstanceId) -> str:
    """A publisher's KV events (KVEventBatch), in sequence order."""
    return f"{PREFIX}.kv.events.{_token(instance_id)}"


KV_EVENTS_ALL = f"{PREFIX}.kv.events.*"


def kv_snapshot(instance_id: InstanceId) -> str:
    """Request/reply: everything a KV event publisher holds (KVSnapshotReply)."""
    return f"{PREFIX}.kv.snapshot.{_token(instance_id)}"


def kv_checkpoint(instance_id: InstanceId) -> str:
    """A publisher's whole contents, now and then (KVSnapshotReply), kept in JetStream for a
    conductor that starts (libs/common/kv_history.py)."""
    return f"{PREFIX}.kv.checkpoint.{_token(instance_id)}"


KV_CHECKPOINT_ALL = f"{PREFIX}.kv.checkpoint.*"
# The JetStream streams that keep them: the last checkpoint of each publisher, and the events since.
KV_CHECKPOINTS_STREAM = "KVSERVE_KV_CHECKPOINTS"
KV_EVENTS_STREAM = "KVSERVE_KV_EVENTS"


def kv_history_api() -> tuple[str, ...]:
    """The JetStream API subjects a conductor uses on those two streams: make them (or check
    them), and read them through a consumer of its own that it deletes when done."""
    api = []
    for stream in (KV_CHECKPOINTS_STREAM, KV_EVENTS_STREAM):
        api += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*"]  # fmt: skip
    return tuple(api)


# --- prefill workers ----------------------------------------------------------
def prefill_submit(instance_id: InstanceId) -> str:
    """Gateway -> one prefill worker: a request to prefill (request/reply ack)."""
    return f"{PREFIX}.prefill.{_token(instance_id)}.submit"


# --- decode workers -----------------------------------------------------------
def decode_reserve(instance_id: InstanceId) -> str:
    """Prefill -> decode: lease blocks for a request's KV (request/reply)."""
    return f"{PREFIX}.decode.{_token(instance_id)}.reserve"


def decode_admit(instance_id: InstanceId) -> str:
    """Prefill -> decode: the KV is in place, start decoding (request/reply)."""
    return f"{PREFIX}.decode.{_token(instance_id)}.admit"


def decode_prefill(instance_id: InstanceId) -> str:
    """Gateway -> decode worker: prefill this request here (conditional disaggregation; request/reply ack)."""
    return f"{PREFIX}.decode.{_token(instance_id)}.prefill"


def decode_release(instance_id: InstanceId) -> str:
    """Prefill -> decode: give a lease back unused (publish)."""
    return f"{PREFIX}.decode.{_token(instance_id)}.release"


def decode_resend(instance_id: InstanceId) -> str:
    """Gateway -> decode worker: publish a request's tokens again from an index, those a NATS
    outage lost (request/reply ack)."""
    return f"{PREFIX}.decode.{_token(instance_id)}.resend"


# --- store --------------------------------------------------------------------
STORE_OPS = ("exists", "get", "put", "commit", "remove", "stats")


def store_op(instance_id: InstanceId, op: str) -> str:
    """One store instance's batched block operations (request/reply): see STORE_OPS."""
    return f"{PREFIX}.store.{_token(instance_id)}.{_token(op)}"


def store_ops(instance_id: InstanceId) -> str:
    """Every operation subject of one store instance, known or not (the store answers an unknown one)."""
    return f"{PREFIX}.store.{_token(instance_id)}.*"


def metrics(instance_id: InstanceId) -> str:
    """Request/reply: the instance's metrics in the Prometheus text format."""
    return f"{PREFIX}.metrics.{_token(instance_id)}"


# --- per request ----------------------------------------------------------------
CANCEL = f"{PREFIX}.cancel"  # broadcast: every worker drops the request


def tokens(request_id: RequestId, instance_id: InstanceId) -> str:
    """Worker ``instance_id`` -> gateway: the request's generated tokens, in TokenChunks.
    The subject names its publisher, so NATS lets an instance publish only its own (see
    libs/common/nats_auth.py) and the gateway can tell which instance a chunk came from."""
    return f"{PREFIX}.tokens.{_token(request_id)}.{_token(instance_id)}"


def request_tokens(request_id: RequestId) -> str:
    """The gateway's subscription: the request's tokens from any instance (it keeps only the
    placed instances' chunks, named by `token_publisher`)."""
    return f"{PREFIX}.tokens.{_token(request_id)}.*"


def tokens_from(instance_id: InstanceId) -> str:
    """Every token subject one instance may publish on (its NATS permission)."""
    return f"{PREFIX}.tokens.*.{_token(instance_id)}"


def token_publisher(subject: str) -> str:
    """The instance a `tokens` subject names as its publisher."""
    return subject.rsplit(".", 1)[1]


# --- patterns: one subject of every instance or request (wildcard subscriptions, NATS permissions)
METRICS_ALL = f"{PREFIX}.metrics.*"
CONDUCTOR_VIEW_ALL = f"{PREFIX}.conductor.*.view"
KV_SNAPSHOT_ALL = f"{PREFIX}.kv.snapshot.*"
PREFILL_SUBMIT_ALL = f"{PREFIX}.prefill.*.submit"
DECODE_RESERVE_ALL = f"{PREFIX}.decode.*.reserve"
DECODE_ADMIT_ALL = f"{PREFIX}.decode.*.admit"
DECODE_PREFILL_ALL = f"{PREFIX}.decode.*.prefill"
DECODE_RELEASE_ALL = f"{PREFIX}.decode.*.release"
DECODE_RESEND_ALL = f"{PREFIX}.decode.*.resend"
STORE_OPS_ALL = f"{PREFIX}.store.*.*"
TOKENS_ALL = f"{PREFIX}.tokens.*.*"
