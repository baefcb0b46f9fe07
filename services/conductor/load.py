"""What the conductor predicts each instance is busy with, between heartbeats.

`PrefillLoad` plays the work booked on a prefill instance forward in the order
the instance computes it (shortest first, keeping earlier promises), so the wait
of the next request and the promises it would break are known at once; each
first token takes its job off. `DecodeLoad` keeps,
per request sent to a decode instance, when it is predicted to start decoding
and how many tokens it is expected to generate, so the batch can be read now
or forecast for any moment at the instance's current step time, and how much
prefill the instance has been booked to run beside each request (its stall), so a
new local prefill can be kept within what every member's TBT promise has left.
Pure bookkeeping: times are whatever clock the caller uses.
"""

from dataclasses import dataclass

from libs.common.prefill_order import Work, completions, plan
from libs.protocol.ids import RequestId


@dataclass(frozen=True)
class Served:
    """A prefill reported done: how long it was predicted to take by the instance's
    cost model alone, and how long it took (None: other work shared the instance
    meanwhile, so its own service time is not known)."""

    predicted_s: float
    measured_s: float | None


@dataclass
class Booked:
    remaining_s: float  # predicted seconds of work left (the instance's learned slowness applied)
    model_s: float  # what the cost model alone predicted for the whole job
    deadline: float | None  # when its first token is due; None: best effort
    added: float
    work_s: float = 0.0  # the whole job, as booked
    favored: bool = False  # goes before the other jobs of its kind (prefill_order.py)


@dataclass(frozen=True)
class Placement:
    """A job placed into an instance's predicted order: when it is predicted to be done,
    and the earlier promises it would break (jobs predicted on time without it, late with it)."""

    done_at: float
    breaks: tuple[str, ...] = ()


class PrefillLoad:
    """The work booked on one prefill instance, played forward in the order the
    instance computes it (`libs/common/prefill_order.py`): shortest first unless an
    earlier promise would break, late jobs next, best effort last. The job in
    progress is cut only at a chunk boundary (``chunk_s``: the instance's chunk
    time; None: never cut), so a new plan starts after what is left of its chunk
    (taken as a whole chunk: where in it the worker is, is not known). Each first
    token takes its job off; a heartbeat saying the instance is idle clears the rest."""

    def __init__(self) -> None:
        self._jobs: dict[str, Booked] = {}
        self._pinned: tuple[str, float] | None = None  # the running job and what is left of its chunk
        self._order: list[str] = []  # the plan after the pinned chunk, as of ``_at``
        self._at = 0.0
        self._alone_since: float | None = None  # a job has had the instance to itself since
        self.chunk_s: float | None = None

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def about_idle(self, now: float) -> bool:
        """Whether what is booked ends within one chunk: a new job then waits no longer
        than it would behind a job just started on an idle instance (the instance cuts
        work only between chunks), and a job done by the plan whose first token is still
        on its way holds nothing up. Without chunks, only an empty instance is."""
        if not self._jobs:
            return True
        return self.chunk_s is not None and self.backlog(now) <= self.chunk_s

    def backlog(self, now: float) -> float:
        """Predicted seconds of work booked and not yet done."""
        self._advance(now)
        return sum(job.remaining_s for job in self._jobs.values())

    def wait(self, seconds: float, now: float, deadline: float | None = 0.0) -> float:
        """How long a new job of ``seconds`` would wait before it starts: the chunk in
        progress, then every SLO job no longer than it (all the work for best effort,
        ``deadline`` None). Cheap: routing compares it on every candidate."""
        self._advance(now)
        if deadline is None:
            return self.backlog(now)
        head, uncut = self._head()
        waited = uncut
        for key, job in self._jobs.items():
            left = job.remaining_s - (uncut if key == head else 0.0)
            if job.deadline is not None and 0 < left and (left <= seconds or now + job.remaining_s > job.deadline):
                waited += left
        return waited

    def imposed(self, seconds: float, now: float) -> float:
        """The delay a new SLO job of ``seconds`` would add to the SLO jobs it goes ahead
        of (those longer than it): what routing it here costs everyone else."""
        self._advance(now)
        longer = sum(1 for job in self._jobs.values() if job.deadline is not None and job.remaining_s > seconds)
        return longer * seconds

    def place(self, key: str, seconds: float, now: float, deadline: float | None, favored: bool = False) -> Placement:
        """Where a new job would land in the instance's order (nothing is booked): its
        predicted end, and the jobs predicted to meet their deadline before it came and
        to miss it with it (a ``favored`` one's: only the favored jobs)."""
        self._advance(now)
        before = self._ends(now, {})
        after = self._ends(now, {key: Booked(seconds, seconds, deadline, now, favored=favored)})
        # a favored job may make the others' jobs late: their tenants are further over their shares
        broken = tuple(k for k, job in self._jobs.items()
                       if job.deadline is not None and (job.favored or not favored) and before[k] <= job.deadline + 1e-9
                       and after[k] > job.deadline + 1e-9)  # fmt: skip
        return Placement(after[key], broken)

    def add(self, request_id: RequestId, seconds: float, now: float, speed: float = 1.0, deadline: float | None = None,
            favored: bool = False) -> None:  # fmt: skip
        """Book a job predicted to take ``seconds`` (the cost model's prediction times
        ``speed``, the instance's learned slowness), due at ``deadline``."""
        self._advance(now)
        self._alone_since = now if not self._jobs else None
        self._jobs[request_id] = Booked(seconds, seconds / speed if speed > 0 else seconds, deadline, now, seconds,
                                        favored)  # fmt: skip
        self._replan(now)

    def sync(self, progress: dict[str, float], now: float) -> None:
        """What the instance says is left of each job it holds (a share of the job, 1: not
        started): the jobs the plan had run ahead of or behind the instance are set right."""
        self._advance(now)
        changed, started = False, None
        for key, job in self._jobs.items():
            share = progress.get(key)
            if share is not None and job.work_s > 0:
                job.remaining_s = min(1.0, max(0.0, share)) * job.work_s
                changed = True
                if 0.0 < share < 1.0 and started is None:  # partly computed: the one in progress
                    started = key
        if changed:
            self._pinned = None
            if started is not None:
                left = self._jobs[started].remaining_s
                self._pinned = (started, left if self.chunk_s is None else min(left, self.chunk_s))
            self._replan(now)

    def done(self, request_id: RequestId, now: float) -> Served | None:
        """The request's prefill finished at ``now``."""
        self._advance(now)
        job = self._jobs.pop(request_id, None)
        if job is None:
            return None
        measured = now - self._alone_since if self._alone_since is not None and not self._jobs else None
        self._alone_since = None
        if self._pinned is not None and self._pinned[0] == request_id:
            self._pinned = None
        self._replan(now)
        return Served(job.model_s, measured)

    def clear(self, now: float) -> None:
        """The instance says it is idle: forget requests it never reported done."""
        self._jobs.clear()
        self._order = []
        self._pinned = None
        self._alone_since = None
        self._at = now

    # --- playing the order forward --------------------------------------------------
    def _head(self) -> tuple[str | None, float]:
        """The job in progress and what is left of its chunk (0: none)."""
        if self._pinned is not None and self._pinned[1] > 0:
            return self._pinned
        return None, 0.0

    def _replan(self, now: float) -> None:
        """Pin the chunk in progress (the plan's head, a whole chunk of it), plan the rest after it."""
        if self._head()[0] is None:
            first = next((k for k in self._order if k in self._jobs and self._jobs[k].remaining_s > 0), None)
            if first is None:
                first = next((k for k in self._jobs if self._jobs[k].remaining_s > 0), None)
            if first is not None:
                left = self._jobs[first].remaining_s
                self._pinned = (first, left if self.chunk_s is None else min(left, self.chunk_s))
        head, uncut = self._head()
        self._order = [w.key for w in plan(self._work(head, uncut), now + uncut)]
        self._at = now

    def _work(self, head: str | None, uncut: float) -> list[Work[str]]:
        return [Work(k, j.remaining_s - (uncut if k == head else 0.0), j.deadline, j.added, j.favored)
                for k, j in self._jobs.items() if j.remaining_s - (uncut if k == head else 0.0) > 0]  # fmt: skip

    def _advance(self, now: float) -> None:
        """Take the time since the last look off the jobs: the pinned chunk first, then
        in plan order. A job the plan has finished but whose first token has not come
        stays, with nothing left."""
        elapsed = now - self._at
        if elapsed <= 0:
            return
        self._at = now
        head, uncut = self._head()
        if head is not None:
            took = min(uncut, elapsed)
            self._jobs[head].remaining_s = max(0.0, self._jobs[head].remaining_s - took)
            self._pinned = (head, uncut - took)
            elapsed -= took
        for key in self._order:
            if elapsed <= 0:
                break
            job = self._jobs.get(key)
            if job is None:
                continue
            took = min(job.remaining_s, elapsed)
            job.remaining_s -= took
            elapsed -= took

    def _ends(self, now: float, extra: dict[str, Booked]) -> dict[str, float]:
        """When every job (and ``extra``) is predicted to end: the pinned chunk first, then
        the jobs already late, then the order re-planned from there. The instance runs late
        jobs after those that can still make it; admission counts them first all the same,
        keeping room for them, or a stream of short prompts would starve them."""
        head, uncut = self._head()
        start, ends = now + uncut, {}
        if head is not None and self._jobs[head].remaining_s <= uncut:
            ends[head] = start
        work = self._work(head, uncut) + [Work(k, j.remaining_s, j.deadline, j.added, j.favored) for k, j in extra.items()]
        for w in work:
            if w.key in self._jobs and w.key not in ends and w.deadline is not None and start + w.remaining_s > w.deadline:
                start += w.remaining_s
                ends[w.key] = start
        ends.update(completions(plan([w for w in work if w.key not in ends], start), start))
        for key in self._jobs:  # finished in the plan, not yet reported: due now
            ends.setdefault(key, now)
        return ends


@dataclass
class DecodeRecord:
    prompt_tokens: int
    start: float  # predicted (then actual) first token
    tokens: int  # tokens it may decode at most (its max_tokens)
    expected: int  # tokens it is expected to decode
    decoding: bool = False
    sequences: int = 1  # n: each a member of the batch
    stall_s: float = 0.0  # prefill its decode instance was booked to run while it is in the batch

    def stall_room(self, step_s: float, limit_s: float) -> float:
        """Seconds of prefill this record's batch may still stall before its mean time
        between tokens, over the gaps between the tokens it is expected to decode, passes
        ``limit_s`` (inf: one token or none, no gap to keep)."""
        gaps = self.expected - 1
        return gaps * (limit_s - step_s) - self.stall_s if gaps > 0 else float("inf")

    def end(self, step_s: float) -> float:
        """The latest it should end: after ``tokens`` steps."""
        return self.start + self.tokens * step_s

    def context_at(self, at: float, step_s: float) -> int:
        """The context its sequences attend to at ``at``: the prompt and the tokens generated
        by then, for each sequence."""
        return (self.prompt_tokens + min(self.tokens, max(0, int((at - self.start) / step_s)))) * self.sequences


class DecodeLoad:
    """Sums are kept as records come and go, so reading the batch now is O(1);
    a forecast walks the records."""

    def __init__(self) -> None:
        self.records: dict[str, DecodeRecord] = {}
        self.modelled_s = 0.0  # the integral over time of the step time the cost model gives the batch
        self._step = 0.0  # ... since ``_step_at``, until the batch changes
        self._step_at: float | None = None
        self._prompts = 0  # of every record's sequences
        self._sequences = 0  # of every record
        self._decoding = 0  # sequences
        self._decoding_prompts = 0
        self._decoding_starts = 0.0

    @property
    def num_records(self) -> int:
        return len(self.records)

    @property
    def num_decoding(self) -> int:
        return self._decoding

    @property
    def decoding_prompt_tokens(self) -> int:
        return self._decoding_prompts

    def advance(self, now: float) -> float:
        """``modelled_s`` at ``now``: what a sequence decoding through it all would have
        taken a token, summed, if every step took what the cost model says (settles a
        request's TBT against the model, whatever joined its batch after it was admitted)."""
        if self._step_at is not None and now > self._step_at:
            self.modelled_s += self._step * (now - self._step_at)
        self._step_at = now
        return self.modelled_s

    def set_step(self, step_s: float) -> None:
        """The batch changed: from now on the model gives it steps of ``step_s``."""
        self._step = step_s

    def add(self, request_id: RequestId, prompt_tokens: int, start: float, tokens: int, expected: int,
            sequences: int = 1) -> None:  # fmt: skip
        self.done(request_id)
        self.records[request_id] = DecodeRecord(prompt_tokens, start, tokens, expected, sequences=sequences)
        self._prompts += prompt_tokens * sequences
        self._sequences += sequences

    def started(self, request_id: RequestId, now: float) -> None:
        record = self.records.get(request_id)
        if record is None or record.decoding:
            return
        record.start, record.decoding = now, True
        n = record.sequences
        self._decoding += n
        self._decoding_prompts += record.prompt_tokens * n
        self._decoding_starts += now * n

    def done(self, request_id: RequestId) -> bool:
        record = self.records.pop(request_id, None)
        if record is None:
            return False
        n = record.sequences
        self._prompts -= record.prompt_tokens * n
        self._sequences -= n
        if record.decoding:
            self._decoding -= n
            self._decoding_prompts -= record.prompt_tokens * n
            self._decoding_starts -= record.start * n
        return True

    def current(self, now: float, step_s: float) -> tuple[int, int]:
        """(sequences, context tokens) decoding now: prompts plus the tokens generated
        since each started, at ``step_s`` a step."""
        if not self._decoding:
            return 0, 0
        generated = max(0.0, self._decoding * now - self._decoding_starts) / step_s
        return self._decoding, self._decoding_prompts + int(generated)

    def total(self, now: float, step_s: float) -> tuple[int, int]:
        """(sequences, context tokens) decoding now or on their way (in prefill)."""
        count, context = self.current(now, step_s)
        coming = self.coming()
        return count + coming[0], context + coming[1]

    def at_least(self, batch_size: int, context_tokens: int) -> tuple[int, int]:
        """No more than `total` with a heartbeat's batch (``batch_size``, ``context_tokens``)
        where it says more, read without the clock: the records' prompts and those on
        their way, the tokens generated since left out."""
        return (max(self._decoding, batch_size) + self._sequences - self._decoding,
                max(self._decoding_prompts, context_tokens) + self._prompts - self._decoding_prompts)  # fmt: skip

    def coming(self) -> tuple[int, int]:
        """(sequences, prompt tokens) on their way to the batch (in prefill)."""
        return self._sequences - self._decoding, self._prompts - self._decoding_prompts

    def forecast(self, at: float, now: float, step_s: float) -> tuple[int, int]:
        """(sequences, context tokens) predicted to be in the batch from ``at`` on, if
        every step takes ``step_s``: those that cannot have finished by then (a
        request is taken to end only once its max_tokens could be done: a departure
        counted too early admits a request the batch has no room for), and every
        request still in prefill (one landing a little later shares the batch all
        the same). A record past that end but not reported done is taken to end now."""
        count = context = 0
        for r in self.records.values():
            if at < r.end(step_s) or (r.decoding and at <= now):
                count += r.sequences
                context += r.context_at(at, step_s)
        return count, context

    def add_stall(self, seconds: float) -> None:
        """The instance was booked to prefill ``seconds`` of a prompt between its decode
        steps: every request in its batch, or on its way to it, waits that long."""
        for r in self.records.values():
            r.stall_s += seconds

    def stall_room(self, step_s: float, limit_s: float) -> float:
        """The least prefill stall any of its requests can still take and keep a mean
        time between tokens within ``limit_s`` at steps of ``step_s`` (inf: none)."""
        return min((r.stall_room(step_s, limit_s) for r in self.records.values()), default=float("inf"))

    def expected_ends(self, now: float, step_s: float) -> list[float]:
        """When every record is expected to end, soonest first (past ends read as now)."""
        return sorted(max(r.start + r.expected * step_s, now) for r in self.records.values())
