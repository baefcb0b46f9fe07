"""Active-active conductor replicas: what one replica admits, every other books.

Each replica builds the cluster view from the same heartbeats and the KV index
from the same KV event streams (no queue group on either), and the gateways'
progress reports reach them all, so the only state one replica would otherwise
miss is the load its peers' admissions add. Each admission is published as a
ConductorAdmission and booked by every peer into its scheduler the way it books
its own, to be settled by the same progress reports (or, if no report ever
comes, forgotten at the same age). Pure conversion and bookkeeping: the NATS
side is `app.py`'s.
"""

from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema import ConductorAdmission
from services.conductor.admitter import Admitter, Booking


def to_message(booking: Booking, conductor_id: str) -> ConductorAdmission:
    b = booking
    return ConductorAdmission(
        conductor_id=InstanceId(conductor_id), request_id=b.request_id, prefill_id=b.prefill_id,
        decode_id=b.decode_id, work_s=b.work_s, prefill_speed=b.prefill_speed, num_prompt_tokens=b.num_prompt_tokens,
        max_tokens=b.max_tokens, expected_output_tokens=b.expected_output_tokens,
        predicted_ttft_s=b.predicted_ttft_s, predicted_tbt_s=b.predicted_tbt_s, session_id=b.session_id,
        deadline_in_s=b.deadline_in_s, moved=b.moved, num_sequences=b.num_sequences, favored=b.favored,
    )  # fmt: skip


def to_booking(m: ConductorAdmission) -> Booking:
    return Booking(
        m.request_id, m.prefill_id, m.decode_id, m.work_s, m.prefill_speed, m.num_prompt_tokens, m.max_tokens,
        m.expected_output_tokens, m.predicted_ttft_s, m.predicted_tbt_s, m.session_id, m.deadline_in_s, m.moved,
        max(1, m.num_sequences), m.favored,
    )  # fmt: skip


class Replicas:
    """One replica's side of the sharing: its admissions out, its peers' in."""

    def __init__(self, conductor_id: str, scheduler: Admitter) -> None:
        self.conductor_id = conductor_id
        self.scheduler = scheduler
        self.num_peer_bookings = 0  # peers' admissions booked here

    def shared(self, request_id: RequestId) -> ConductorAdmission | None:
        """The message that tells the peers of this replica's admission of ``request_id``."""
        record = self.scheduler.admitted.get(request_id)
        if record is None or record.origin is not None:
            return None
        return to_message(record.booking, self.conductor_id)

    def on_peer_admission(self, message: ConductorAdmission) -> bool:
        """Book a peer's admission (its own, echoed back, is ignored); False: not booked."""
        if message.conductor_id == self.conductor_id:
            return False
        booked = self.scheduler.book(to_booking(message), self.scheduler.view.clock(), origin=message.conductor_id)
        self.num_peer_bookings += booked
        return booked
