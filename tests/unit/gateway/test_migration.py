"""Moving a request whose worker died, with fake attempts: what each new attempt
is asked to run (prompt, max_tokens, id, exclusions), how its chunks continue
the stream, and when it gives up."""

import pytest

from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenChunk
from services.gateway.migration import MigratingRun
from services.gateway.served_model import PreparedRequest
from services.gateway.text_stream import TextStream, stream_deltas
from services.gateway.upstream_errors import WorkerLostError

PROMPT = [1, 2, 3, 4, 5]
ORIGINAL = PreparedRequest("req", PROMPT, SamplingParams(max_tokens=10, temperature=0.0), [b"h1"], hash_root=b"tenant-root")


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: id = byte


def lost(instance_id: str, role: str = "decode") -> WorkerLostError:
    return WorkerLostError(f"{role} instance {instance_id} is gone", instance_id, role)


class FakeAttempt:
    """An attempt that yields scripted batches of chunks, or raises what the script says."""

    def __init__(self, prepared: PreparedRequest, exclude: frozenset[str], script: list, route: tuple[str, str],
                 enter_error: Exception | None = None, cancels_on_error: bool = False) -> None:  # fmt: skip
        self.prepared, self.exclude, self.script = prepared, exclude, list(script)
        self.cancelled = False
        self.cancels_on_error = cancels_on_error  # as a real one whose admission went unanswered
        self.request_id = prepared.request_id
        self.prefill_id, self.decode_id = route
        self.serving_decode_id = None
        self.admission = None
        self.ttft_s = 0.25
        self.finished = False
        self.enter_error = enter_error
        self.closed: list[str] = []
        self.cancels: list[str] = []

    async def __aenter__(self) -> "FakeAttempt":
        if self.enter_error is not None:
            self.closed.append("error")
            self.cancelled = self.cancels_on_error
            raise self.enter_error
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.closed.append("exit")

    async def close(self, reason: str) -> None:
        self.closed.append(reason)

    async def cancel(self, reason: str) -> None:
        self.cancels.append(reason)

    async def next_chunks(self) -> list[TokenChunk]:
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        for chunk in step:
            if chunk.index > 0:
                self.serving_decode_id = chunk.instance_id
            self.finished = self.finished or chunk.finish_reason is not None
        return step


def chunk(index: int, text: str, finish: str | None = None, instance: str = "", cached: int = 0) -> TokenChunk:
    return TokenChunk(request_id="x", index=index, token_ids=ids(text), finish_reason=finish, instance_id=instance,
                      num_cached_tokens=cached)  # fmt: skip


class Cluster:
    """Hands out the scripted attempts in order and records what each was asked to run."""

    def __init__(self, *attempts: dict) -> None:
        self.plans = list(attempts)
        self.attempts: list[FakeAttempt] = []
        self.hashed: list[list[int]] = []

    def new_attempt(self, prepared: PreparedRequest, exclude: frozenset[str]) -> FakeAttempt:
        plan = self.plans.pop(0)
        attempt = FakeAttempt(prepared, exclude, plan.get("script", []), plan["route"], plan.get("enter_error"),
                              plan.get("cancels", False))  # fmt: skip
        self.attempts.append(attempt)
        return attempt

    async def block_hashes(self, token_ids: list[int], root: bytes) -> list[bytes]:
        assert root == ORIGINAL.hash_root  # a moved request stays in its cache scope
        self.hashed.append(token_ids)
        return [b"rehashed"]

    def run(self, max_attempts: int = 3, prepared: PreparedRequest = ORIGINAL) -> MigratingRun:
        return MigratingRun(prepared, self.new_attempt, self.block_hashes, max_attempts)


async def read_all(run: MigratingRun) -> list[TokenChunk]:
    out: list[TokenChunk] = []
    while not out or out[-1].finish_reason is None:
        out += await run.next_chunks()
    return out


async def test_a_dead_decode_worker_resumes_with_the_streamed_tokens_in_the_prompt():
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0", cached=4)], [chunk(1, "el", instance="d0")],
                                           lost("d0")]},
        {"route": ("p0", "d1"), "script": [[chunk(0, "l", instance="p0")], [chunk(1, "o!", "stop", instance="d1")]]},
    )  # fmt: skip
    async with cluster.run() as run:
        chunks = await read_all(run)
    first, second = cluster.attempts
    resumed = second.prepared
    assert resumed.request_id == "req-m1" and second.exclude == {"d0"}
    assert resumed.prompt_token_ids == PROMPT + ids("Hel") and resumed.sampling.max_tokens == 10 - 3
    assert resumed.block_hashes == [b"rehashed"] and cluster.hashed == [PROMPT + ids("Hel")]
    assert resumed.hash_root == ORIGINAL.hash_root
    assert resumed.sampling.temperature == 0.0  # everything else as asked
    assert resumed.num_prior_output_tokens == 3  # the workers count "Hel" as generated (penalties, seeds)
    assert [(c.index, bytes(c.token_ids).decode()) for c in chunks] == [(0, "H"), (1, "el"), (3, "l"), (4, "o!")]
    assert first.closed == ["moved elsewhere: d0 is gone"] and second.closed == ["exit"]
    assert run.served_by() == {"prefill_instances": ["p0"], "decode_instances": ["d0", "d1"], "migrations": 1}


async def test_min_tokens_comes_off_with_the_tokens_delivered():
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0")], [chunk(1, "el", instance="d0")], lost("d0")]},
        {"route": ("p0", "d1"), "script": [[chunk(0, "l", instance="p0")], [chunk(1, "o!", "stop", instance="d1")]]},
    )  # fmt: skip
    original = PreparedRequest("req", PROMPT, SamplingParams(max_tokens=10, min_tokens=5, presence_penalty=1.0),
                               [b"h1"], hash_root=ORIGINAL.hash_root)  # fmt: skip
    async with cluster.run(prepared=original) as run:
        await read_all(run)
    resumed = cluster.attempts[1].prepared
    assert (resumed.sampling.min_tokens, resumed.sampling.max_tokens, resumed.num_prior_output_tokens) == (2, 7, 3)
    assert resumed.sampling.presence_penalty == 1.0


async def test_a_dead_prefill_worker_gets_the_request_admitted_again_as_it_came():
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [lost("p0", "prefill")]},
        {"route": ("p1", "d0"), "script": [[chunk(0, "ok", "length", instance="p1")]]},
    )
    async with cluster.run() as run:
        chunks = await read_all(run)
    again = cluster.attempts[1]
    assert (again.prepared.request_id, again.exclude) == ("req-m1", {"p0"})
    assert (again.prepared.prompt_token_ids, again.prepared.sampling) == (PROMPT, ORIGINAL.sampling)
    assert again.prepared.block_hashes == ORIGINAL.block_hashes and cluster.hashed == []
    assert [c.index for c in chunks] == [0]
    assert run.served_by() == {"prefill_instances": ["p0", "p1"], "decode_instances": ["d0"], "migrations": 1}


async def test_a_worker_gone_before_it_took_the_request_is_passed_over_at_once():
    cluster = Cluster(
        {"route": ("p0", "d0"), "enter_error": lost("p0", "prefill")},  # no responders on its submit subject
        {"route": ("p1", "d0"), "script": [[chunk(0, "ok", "length", instance="p1")]]},
    )
    async with cluster.run() as run:
        assert run.prefill_id == "p1"  # what the response headers will say
        await read_all(run)
    assert cluster.attempts[1].exclude == {"p0"}
    assert run.served_by() == {"prefill_instances": ["p1"], "decode_instances": ["d0"], "migrations": 1}


async def test_attempts_run_out_and_the_last_loss_is_raised_after_every_gone_instance_was_excluded():
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0")], lost("d0")]},
        {"route": ("p0", "d1"), "script": [[chunk(0, "i", instance="p0")], lost("d1")]},
        {"route": ("p0", "d2"), "script": [lost("p0", "prefill")]},
    )
    with pytest.raises(WorkerLostError, match="prefill instance p0 is gone; the request was given up after 3 attempts"):
        async with cluster.run(max_attempts=3) as run:
            await read_all(run)
    assert [a.exclude for a in cluster.attempts] == [set(), {"d0"}, {"d0", "d1"}]
    assert [a.prepared.request_id for a in cluster.attempts] == ["req", "req-m1", "req-m2"]
    assert cluster.attempts[2].prepared.prompt_token_ids == PROMPT + ids("Hi")
    assert cluster.attempts[2].closed == ["moved elsewhere: p0 is gone"]
    assert run.migrations == 2


async def test_one_attempt_only_means_the_first_loss_ends_the_request():
    cluster = Cluster({"route": ("p0", "d0"), "script": [lost("d0")]})
    with pytest.raises(WorkerLostError, match="given up after 1 attempts"):
        async with cluster.run(max_attempts=1) as run:
            await run.next_chunks()


async def test_the_text_of_a_migrated_stream_counts_from_the_original_prompt(served_model):
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "Hel", instance="p0", cached=4)], lost("d0")]},
        {"route": ("p0", "d1"), "script": [[chunk(0, "lo wor", instance="p0", cached=16)],
                                           [chunk(6, "ld", instance="d1")]]},
    )  # fmt: skip
    text = TextStream(served_model.tokenizer, ORIGINAL.sampling, served_model.max_model_len, len(PROMPT))
    async with cluster.run() as run:
        deltas = [d async for d in stream_deltas(run, [text])]
    assert "".join(d.text for d in deltas) == "Hello worl" and deltas[-1].finish_reason == "length"
    assert (text.num_prompt_tokens, text.num_completion_tokens, text.num_cached_tokens) == (5, 10, 4)
    assert cluster.attempts[1].cancels == ["stop"]  # max_tokens reached here: the workers are told to stop


def test_the_number_of_attempts_comes_from_the_environment_and_is_checked(monkeypatch):
    from services.gateway.settings import GatewaySettings

    monkeypatch.setenv("KVSERVE_GATEWAY_MAX_ATTEMPTS", "5")
    assert GatewaySettings.from_env().max_attempts == 5
    monkeypatch.setenv("KVSERVE_GATEWAY_MAX_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="KVSERVE_GATEWAY_MAX_ATTEMPTS: a request needs at least one attempt"):
        GatewaySettings.from_env()



async def test_a_stream_cut_by_a_nats_outage_continues_on_the_same_workers_excluding_none():
    cut = WorkerLostError("the stream was cut by a NATS outage", None, "nats")
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0")], [chunk(1, "i", instance="d0")], cut]},
        {"route": ("p0", "d0"), "script": [[chunk(0, "!", "stop", instance="p0")]]},
    )
    async with cluster.run() as run:
        chunks = await read_all(run)
    first, second = cluster.attempts
    assert second.exclude == frozenset()  # every worker may still serve: only messages were lost
    assert second.prepared.prompt_token_ids == PROMPT + ids("Hi") and second.prepared.sampling.max_tokens == 8
    assert [(c.index, bytes(c.token_ids).decode()) for c in chunks] == [(0, "H"), (1, "i"), (2, "!")]
    assert first.closed == ["moved elsewhere: NATS cut the stream"]
    assert run.migrations == 1


@pytest.mark.parametrize(
    "message, cancels, max_attempts, request_ids",
    [
        # no conductor running: the same attempt is asked again under its own id, spending no attempt
        ("conductor unavailable: no conductor is running", False, 2, ["req", "req-m1", "req-m1", "req-m1"]),
        # a conductor took the admission but its answer was lost (a host out of reach): the attempt
        # cancelled its id on every worker, so asking again under it would be dropped: a new id each time
        ("conductor unavailable: no conductor answered", True, 3, ["req", "req-m1", "req-m2", "req-m3"]),
    ],
    ids=["no-conductor-same-id", "cancelled-id-renamed"],
)
async def test_a_moved_request_asks_again_while_no_conductor_answers(
    monkeypatch, message, cancels, max_attempts, request_ids
):
    from services.gateway import migration
    from services.gateway.errors import ServiceUnavailableError

    monkeypatch.setattr(migration, "ADMIT_RETRY_DELAY", 0.0)
    no_answer = ServiceUnavailableError(message, "no_conductor")
    cut = WorkerLostError("the stream was cut by a NATS outage", None, "nats")
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0")], cut]},
        {"route": ("p0", "d0"), "enter_error": no_answer, "cancels": cancels},
        {"route": ("p0", "d0"), "enter_error": no_answer, "cancels": cancels},
        {"route": ("p0", "d0"), "script": [[chunk(0, "i", "stop", instance="p0")]]},
    )
    async with cluster.run(max_attempts=max_attempts) as run:
        chunks = await read_all(run)
    assert [bytes(c.token_ids).decode() for c in chunks] == ["H", "i"]
    assert [a.prepared.request_id for a in cluster.attempts] == request_ids
    assert run.migrations == 1


async def test_a_first_attempt_with_no_conductor_fails_at_once():
    from services.gateway.errors import ServiceUnavailableError

    cluster = Cluster({"route": ("p0", "d0"), "enter_error": ServiceUnavailableError("no conductor", "no_conductor")})
    with pytest.raises(ServiceUnavailableError):
        async with cluster.run():
            pass


async def test_a_moved_request_waits_for_a_restarted_worker_and_no_longer_excludes_it(monkeypatch):
    from services.gateway import migration
    from services.gateway.errors import ServiceUnavailableError

    monkeypatch.setattr(migration, "ADMIT_RETRY_DELAY", 0.0)
    starts = {"d0": 100.0}
    no_decode = ServiceUnavailableError("no decode instance is alive", "no_decode")
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [[chunk(0, "H", instance="p0")], lost("d0")]},
        {"route": ("p0", "d0"), "enter_error": no_decode},  # d0 is dead, the only decode worker
        {"route": ("p0", "d0"), "script": [[chunk(0, "i", "stop", instance="p0")]]},  # d0 restarted
    )
    attempts = []

    def new_attempt(prepared, exclude):
        attempts.append(exclude)
        if len(attempts) == 2:
            starts["d0"] = 200.0  # the supervisor's restart, heard from while the request waited
        return cluster.new_attempt(prepared, exclude)

    run = MigratingRun(ORIGINAL, new_attempt, cluster.block_hashes, 2, started_at=starts.get)
    async with run:
        chunks = await read_all(run)
    assert [bytes(c.token_ids).decode() for c in chunks] == ["H", "i"]
    assert attempts == [frozenset(), {"d0"}, frozenset()]
    assert run.migrations == 1


async def test_a_worker_seen_restarted_is_excluded_only_as_the_process_that_died():
    # The watch saw d0 restarted: the directory already holds the new process's start time,
    # which must not be mistaken for the dead one's, or the restarted worker is never used again.
    starts = {"p0": 200.0}  # heard from the restarted process by the time the loss is noted
    restarted = WorkerLostError("prefill instance p0 is gone (restarted)", "p0", "prefill", started_at=100.0)
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [restarted]},
        {"route": ("p0", "d0"), "script": [[chunk(0, "i", "stop", instance="p0")]]},
    )
    run = MigratingRun(ORIGINAL, cluster.new_attempt, cluster.block_hashes, 2, started_at=starts.get)
    async with run:
        await read_all(run)
    assert [a.exclude for a in cluster.attempts] == [frozenset(), frozenset()]


async def test_a_decode_worker_a_hand_off_found_silent_is_passed_over_until_it_is_heard_again(monkeypatch):
    from services.gateway import migration
    from services.gateway.errors import ServiceUnavailableError

    monkeypatch.setattr(migration, "ADMIT_RETRY_DELAY", 0.0)
    heard = {"d0": 50}
    no_decode = ServiceUnavailableError("no decode instance is alive", "no_decode")
    handoff_lost = WorkerLostError("p0 failed: decode worker d0 did not answer", "d0", "decode", started_at=100.0,
                                   until_heard=True)  # fmt: skip
    cluster = Cluster(
        {"route": ("p0", "d0"), "script": [handoff_lost]},
        {"route": ("p0", "d0"), "enter_error": no_decode},  # d0 excluded: the only decode worker
        {"route": ("p0", "d0"), "script": [[chunk(0, "i", "stop", instance="p0")]]},
    )
    attempts = []

    def new_attempt(prepared, exclude):
        attempts.append(exclude)
        if len(attempts) == 2:
            heard["d0"] = 51  # its next heartbeat: the same process, alive
        return cluster.new_attempt(prepared, exclude)

    run = MigratingRun(ORIGINAL, new_attempt, cluster.block_hashes, 2, started_at={"d0": 100.0}.get,
                       beats_heard=heard.get)  # fmt: skip
    async with run:
        await read_all(run)
    assert attempts == [frozenset(), {"d0"}, frozenset()]
    assert run.migrations == 1  # the wait for d0 spent no attempt


@pytest.mark.parametrize("code", ["no_decode", "no_prefill", "no_instances", "no_conductor"])
async def test_a_new_request_waits_for_a_role_heard_from_lately_and_not_for_one_never_heard(monkeypatch, code):
    from services.gateway import migration
    from services.gateway.errors import ServiceUnavailableError

    monkeypatch.setattr(migration, "ADMIT_RETRY_DELAY", 0.0)
    missing = ServiceUnavailableError("its role is missing", code)
    restarting = Cluster(
        {"route": ("p0", "d0"), "enter_error": missing},
        {"route": ("p0", "d0"), "script": [[chunk(0, "i", "stop", instance="p0")]]},
    )
    silences = {"conductor": 2.0, "prefill": 2.0, "decode": 2.0}  # each last heard 2 s ago (being restarted)
    run = MigratingRun(ORIGINAL, restarting.new_attempt, restarting.block_hashes, 1, silent_for=silences.get)
    async with run:
        chunks = await read_all(run)
    assert [bytes(c.token_ids).decode() for c in chunks] == ["i"]
    assert [a.prepared.request_id for a in restarting.attempts] == ["req", "req"]

    # never heard; gone long ago; gone for longer than a window set shorter (KVSERVE_GATEWAY_ADMIT_RETRY_WINDOW)
    for silences, window in (({}, 15.0), ({"conductor": 60.0, "prefill": 60.0, "decode": 60.0}, 15.0),
                             ({"conductor": 2.0, "prefill": 2.0, "decode": 2.0}, 1.0)):  # fmt: skip
        absent = Cluster({"route": ("p0", "d0"), "enter_error": missing})
        with pytest.raises(ServiceUnavailableError):
            async with MigratingRun(ORIGINAL, absent.new_attempt, absent.block_hashes, 1, silent_for=silences.get,
                                    retry_window=window):  # fmt: skip
                pass
        assert len(absent.attempts) == 1
