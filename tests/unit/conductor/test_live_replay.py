"""The simulator and the live conductor decide alike: a sequence the simulator drove
its scheduler with, replayed into the conductor service's message handlers, gets the
same admissions, routes, refusals and predictions."""

import asyncio
import random

import pytest

from libs.protocol.schema import AdmitReply, AdmitRequest, ErrorReply, RequestProgress
from services.conductor.app import Conductor
from services.conductor.settings import DEFAULT_POLICY, ConductorSettings
from services.conductor.simulator.simulation import SimConfig, Simulation
from services.conductor.simulator.trace import TraceRequest
from tests.unit.conductor.helpers import Clock


def mixed_load(n: int = 160, seed: int = 5) -> list[TraceRequest]:
    """Unrelated prompts, mostly short with a long tail, faster than one prefill instance serves."""
    rng = random.Random(seed)
    sizes = [rng.choice((300, 800, 1500, 3000, 6000, 12000, 30000)) for _ in range(n)]
    return [TraceRequest(i, i * 0.25, size, rng.randint(2, 200), (50_000 + i,)) for i, size in enumerate(sizes)]


def record(sim: Simulation) -> list[tuple]:
    """Every input the simulation gives its scheduler, with the simulated time, and each decision."""
    events: list[tuple] = []
    observe, admit = sim.view.observe, sim.scheduler.admit
    first_token, finished = sim.scheduler.first_token, sim.scheduler.finished

    def on_observe(heartbeat):
        events.append(("beat", sim.now, heartbeat))
        return observe(heartbeat)

    def on_admit(request: AdmitRequest):
        decision = admit(request)
        events.append(("admit", sim.now, request, decision))
        return decision

    def on_first(request_id, ttft_s=None):
        events.append(("first", sim.now, request_id, ttft_s))
        first_token(request_id, ttft_s)

    def on_finished(request_id, num_output_tokens=0):
        events.append(("finished", sim.now, request_id, num_output_tokens))
        finished(request_id, num_output_tokens)

    sim.view.observe, sim.scheduler.admit = on_observe, on_admit
    sim.scheduler.first_token, sim.scheduler.finished = on_first, on_finished
    return events


def test_the_live_conductor_takes_the_simulators_decisions_on_a_recorded_sequence():
    sim = Simulation(SimConfig(1, 1, DEFAULT_POLICY, store_blocks=0), mixed_load())
    events = record(sim)
    result = sim.run()
    assert {r.outcome for r in result.requests} >= {"rejected", "done"}  # refusals and admissions both

    clock = Clock()
    settings = ConductorSettings(role="conductor", nats_url="nats://127.0.0.1:4222", instance_id="c", host_id="h",
                                 policy=DEFAULT_POLICY, block_size=512)  # fmt: skip
    conductor = Conductor(settings)
    conductor.view.clock = lambda: clock.now

    async def no_publish(subject, message) -> None:  # the replica announcement: no peers here
        return None

    conductor.publish = no_publish

    async def replay() -> int:
        compared = 0
        for kind, at, *args in events:
            clock.now = at
            if kind == "beat":
                await conductor.on_heartbeat(args[0], None)
            elif kind == "first":
                await conductor.on_progress(RequestProgress(request_id=args[0], kind="first_token", ttft_s=args[1]), None)
            elif kind == "finished":
                await conductor.on_progress(RequestProgress(request_id=args[0], kind="finished",
                                                            num_output_tokens=args[1]), None)  # fmt: skip
            else:
                request, decision = args
                reply = await conductor.on_admit(request, None)
                if decision.admitted:
                    assert isinstance(reply, AdmitReply), (request.request_id, reply)
                    assert (reply.prefill_id, reply.decode_id) == (decision.prefill_id, decision.decode_id)
                    assert reply.predicted_ttft_s == pytest.approx(decision.predicted_ttft_s)
                else:
                    assert isinstance(reply, ErrorReply), (request.request_id, decision)
                    assert (reply.code, reply.reason) == (decision.error_code, decision.reason)
                    assert reply.predicted_ttft_s == pytest.approx(decision.predicted_ttft_s)
                compared += 1
        return compared

    assert asyncio.run(replay()) == len(result.requests)
