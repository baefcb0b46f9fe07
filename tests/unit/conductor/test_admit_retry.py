"""The gateway asks for an admission again when no conductor replica answers in time,
so a replica that dies holding the request costs one attempt, not the request."""

import nats.errors
import pytest

from libs.protocol.schema import AdmitReply
from services.gateway.dispatch import ADMIT_ATTEMPT_TIMEOUT, RequestRun
from services.gateway.errors import ServiceUnavailableError
from tests.unit.gateway.test_dispatch_errors import PREPARED, FakeService


class SilentFirst(FakeService):
    """The first ``silent`` admissions get no answer (their replica died); the timeouts asked are kept."""

    def __init__(self, silent: int) -> None:
        super().__init__()
        self.silent = silent
        self.timeouts: list[float] = []

    async def request(self, subject: str, message: object, kind: type, timeout: float = 5.0) -> object:
        if kind is AdmitReply:
            self.timeouts.append(timeout)
            if len(self.timeouts) <= self.silent:
                raise nats.errors.TimeoutError
        return await super().request(subject, message, kind, timeout)


async def test_an_unanswered_admission_is_asked_again_within_the_control_timeout():
    service = SilentFirst(silent=1)
    async with RequestRun(service, PREPARED, token_timeout=1.0, control_timeout=5.0) as run:
        assert (run.prefill_id, run.decode_id) == ("p0", "d0")
    assert len(service.timeouts) == 2 and all(t <= ADMIT_ATTEMPT_TIMEOUT for t in service.timeouts)
    assert sum(service.timeouts) * 4 / 2 == pytest.approx(5.0)  # four attempts of 1.25 s fill the 5 s


async def test_no_answer_to_any_attempt_is_the_conductors_503():
    service = SilentFirst(silent=100)
    with pytest.raises(ServiceUnavailableError) as e:
        async with RequestRun(service, PREPARED, token_timeout=1.0, control_timeout=5.0):
            pass
    assert len(service.timeouts) == 4 and e.value.code == "no_conductor"
    assert "no answer within 5s" in str(e.value)
