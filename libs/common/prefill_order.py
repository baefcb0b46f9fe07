"""The order prefill work is done in, shared by every prefill worker (which picks
each chunk by it), the conductor (which predicts it to admit) and the simulator.

Goodput counts requests, so a short prompt must not wait behind a long one: the
shortest remaining work goes first, unless that would make an earlier promise
late. A job is *on time* while it can still meet its TTFT deadline on its own.
The plan is built greedily: at each position, the shortest on-time job whose
going next still lets every other on-time job meet its deadline when the rest
run earliest-deadline-first (EDF is optimal for that check on one machine);
when no job passes (the promises cannot all be kept), the shortest. Jobs already
late follow, shortest first; best-effort jobs (no deadline) come last, in
arrival order, so they only use time SLO work does not need. A *favored* job (a
tenant under its weighted share while another is over it: the conductor says so)
goes before the other jobs of its kind, so a light tenant's requests do not queue
behind a flooding tenant's admitted work. `step` cuts the plan into a worker's next
step: a favored job waits only for the step in progress, so while favored work is
about, the other tenants' steps are kept short and a favored step carries no other
tenant's tokens (each would add to the favored job's own step).

Pure functions over plain numbers: the caller's clock, seconds of predicted work.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")

CONTENDED_S = 10.0  # after a favored job, the others' steps stay short this long (fair_share.py's ACTIVE_S)

# Prompt-size bands, in tokens (<128, 128-511, 512-1023, >=1024): admission learns its
# margins per band and the benchmarks report per band.
BAND_EDGES = (128, 512, 1024)
BAND_NAMES = ("<128", "128-511", "512-1023", ">=1024")


def band_of(num_prompt_tokens: int) -> int:
    """The index of the band a prompt of this many tokens is in."""
    return sum(num_prompt_tokens >= edge for edge in BAND_EDGES)


@dataclass(frozen=True)
class Work(Generic[K]):
    key: K
    remaining_s: float  # predicted seconds of prefill left
    deadline: float | None  # when its first token is due (the caller's clock); None: best effort
    arrived: float = 0.0  # tie-breaker, oldest first
    favored: bool = False  # before the other jobs of its kind (on time, late)


def plan(jobs: Iterable[Work[K]], now: float) -> list[Work[K]]:
    """Every job, in the order it is to be computed from ``now``."""
    on_time, late, best_effort = [], [], []
    for job in jobs:
        if job.deadline is None:
            best_effort.append(job)
        elif now + job.remaining_s <= job.deadline:
            on_time.append(job)
        else:
            late.append(job)
    favored = [job for job in on_time if job.favored]
    ordered = _keep_promises(favored, now) if favored else []
    start = now + sum(job.remaining_s for job in ordered)
    ordered += _keep_promises([job for job in on_time if not job.favored] if favored else on_time, start)
    late.sort(key=lambda j: (not j.favored, j.remaining_s, j.arrived))
    best_effort.sort(key=lambda j: j.arrived)
    return ordered + late + best_effort


def contended(favored_at: float | None, now: float) -> bool:
    """Whether a favored job came within CONTENDED_S of ``now`` (``favored_at``: when the last did)."""
    return favored_at is not None and now - favored_at < CONTENDED_S


def step_tokens(max_tokens: int, contended_tokens: int, is_contended: bool, favored: bool = False) -> int:
    """The most prompt tokens of a step that starts with a ``favored`` job or not (`step`)."""
    if is_contended and contended_tokens > 0 and not favored:
        return min(max_tokens, contended_tokens)
    return max_tokens


def step(ordered: Sequence[Work[K]], tokens_left: Callable[[K], int], max_tokens: int,
         contended_tokens: int = 0, contended: bool = False) -> list[tuple[K, int]]:
    """The next step from a plan: up to ``max_tokens`` prompt tokens, the plan's jobs in
    order. ``contended`` (favored work was about lately) with ``contended_tokens`` set:
    a step that starts with a job not favored takes at most ``contended_tokens``, and a
    step of favored jobs takes only favored ones, so a favored job waits at most one
    short step and its own step is its own work. 0: off (every step as if uncontended)."""
    if not ordered:
        return []
    head_favored = ordered[0].favored
    strict = contended and contended_tokens > 0
    budget = step_tokens(max_tokens, contended_tokens, contended, head_favored)
    out: list[tuple[K, int]] = []
    for job in ordered:
        if budget <= 0 or (strict and job.favored != head_favored):
            break
        n = min(tokens_left(job.key), budget)
        if n > 0:
            out.append((job.key, n))
            budget -= n
    return out


def completions(ordered: Sequence[Work[K]], now: float, first_start: float | None = None) -> dict[K, float]:
    """When each job of a plan is predicted to finish, run back to back from ``now``
    (or from ``first_start`` for the second job on, when the first may not be cut:
    a chunk in progress)."""
    out, t = {}, now
    for i, job in enumerate(ordered):
        if i == 1 and first_start is not None:
            t = max(t, first_start)
        t += job.remaining_s
        out[job.key] = t
    return out


def _shortest(job: Work) -> tuple[float, float]:
    return job.remaining_s, job.arrived


def _keep_promises(jobs: list[Work[K]], now: float) -> list[Work[K]]:
    pending = sorted(jobs, key=_shortest)
    by_deadline = sorted(jobs, key=lambda j: (j.deadline, j.arrived))
    ordered: list[Work[K]] = []
    t = now
    while pending:
        pick = next((j for j in pending if _edf_feasible(by_deadline, j, t + j.remaining_s)), pending[0])
        ordered.append(pick)
        pending.remove(pick)
        by_deadline.remove(pick)
        t += pick.remaining_s
    return ordered


def _edf_feasible(by_deadline: list[Work], first: Work, start: float) -> bool:
    """Whether, after ``first`` ends at ``start``, the others in deadline order all make it."""
    t = start
    for job in by_deadline:
        if job is first:
            continue
        t += job.remaining_s
        if t > job.deadline:
            return False
    return True
