"""Keeping a local cluster's processes alive, and none of them alive without it.

Every child is forked on one long-lived thread with PR_SET_PDEATHSIG set, so the kernel
kills it when the launcher dies, however it dies (kill -9 included); the gateway it stops
(SIGTERM), and it ends its streams within its drain. The kernel ties that
signal to the *thread* that forked, hence one thread for every fork, restarts included.
Once told to watch a child, the same thread starts it again whenever it exits, after an
exponential backoff. It knows processes, not services: LocalCluster says how to check,
start and report each one.
"""

import ctypes
import functools
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

RESTART_DELAY_FIRST = 0.5  # seconds before the first restart of a child that exited
RESTART_DELAY_MAX = 10.0  # the delay doubles at each exit in a row, up to this
HEALTHY_AFTER_SECONDS = 30.0  # a child that ran this long starts again from the first delay
CRASH_LOOP_EXITS = 3  # this many exits in a row, each before it ran healthily: a crash loop
CHECK_INTERVAL = 1.0  # exits are reported as they happen (wake); this bounds one that is not
SHM_DIR = Path("/dev/shm")  # segments are named kvserve-<pid>-... (libs/transfer/segment.py)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WAKE = object()


def die_with_launcher(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for Popen: the child gets ``sig`` when the thread that forked it
    ends (with it, the launcher's death), and exits at once if the launcher was already
    gone before that was set. None off Linux, where there is no such signal.

    SIGKILL by default: with the launcher gone, nothing would kill a service stuck in
    its drain. The shared memory a killed service leaves is removed by the cluster's
    watchdog (kvserve/cli/reaper.py). SIGTERM only for a child whose stop is bounded by
    its own timers: the gateway, which ends its streams (an error, then [DONE])."""
    prctl = _prctl()
    if prctl is None:
        return None
    launcher = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec
        if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:  # the launcher died before prctl: no signal will come
            os._exit(1)

    return preexec


@functools.cache
def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def remove_segments_of(pid: int) -> list[str]:
    """Unlink the shared-memory segments process ``pid`` created (call once it has exited); return their names."""
    removed = []
    for path in SHM_DIR.glob(f"kvserve-{pid}-*"):
        try:
            if path.stat().st_uid == os.getuid():
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:  # its owner, or another sweep, was first
            continue
    return removed


@dataclass
class Backoff:
    """Restart delays: ``first``, doubling at each exit in a row up to ``longest``; a child
    that ran ``healthy_after`` seconds before it exited starts again from ``first``."""

    first: float = RESTART_DELAY_FIRST
    longest: float = RESTART_DELAY_MAX
    healthy_after: float = HEALTHY_AFTER_SECONDS
    failures: int = 0  # exits in a row, each before the child had run healthy_after seconds

    def next_delay(self, ran_for: float) -> float:
        if ran_for >= self.healthy_after:
            self.failures = 0
        delay = min(self.first * 2 ** min(self.failures, 32), self.longest)
        self.failures += 1
        return delay

    @property
    def crash_looping(self) -> bool:
        return self.failures >= CRASH_LOOP_EXITS


@dataclass(frozen=True)
class Exit:
    """A watched child that exited, and when it starts again."""

    name: str
    code: int  # negative: killed by that signal
    ran_for: float  # seconds since it was started
    delay: float  # seconds until it is started again
    failures: int  # exits in a row, this one included, each before it ran healthily
    crash_looping: bool


@dataclass
class _Watch:
    name: str
    exit_code: Callable[[], int | None]
    start: Callable[[], None]
    on_exit: Callable[[Exit], None]
    backoff: Backoff
    started_at: float
    due: float | None = None  # monotonic time of the scheduled restart, once it has exited


class Supervisor(threading.Thread):
    """The thread that forks every child of a cluster (``call``) and restarts the watched
    ones (``watch``) when they exit. ``report`` receives a line when a restart fails.
    Runs until ``stop()``; children still alive then are killed with it (PR_SET_PDEATHSIG)."""

    def __init__(self, report: Callable[[str], None]) -> None:
        super().__init__(name="kvserve-supervisor", daemon=True)
        self._report = report
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._watches: dict[str, _Watch] = {}
        self.error: BaseException | None = None  # what ended the thread, if not stop()
        # Set when run() ends. Waited on instead of join() or is_alive(): Python 3.11
        # marks a thread stopped when a signal handler interrupts a join() of it.
        self.ended = threading.Event()
        self._ending = threading.Lock()  # no call is queued after the last one is failed

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on this thread and return its result (or raise its exception)."""
        if threading.current_thread() is self:
            return fn(*args)
        future: Future = Future()
        with self._ending:
            if self.ended.is_set():
                raise RuntimeError("the supervisor thread is not running")
            self._tasks.put((future, fn, args))
        return future.result()

    def watch(
        self,
        name: str,
        exit_code: Callable[[], int | None],
        start: Callable[[], None],
        on_exit: Callable[[Exit], None],
        backoff: Backoff,
        started_at: float,
    ) -> None:
        """From now on, call ``start()`` (on this thread) ``backoff`` after ``exit_code()``
        is no longer None, and ``on_exit`` at once, for as long as it is watched."""
        watch = _Watch(name, exit_code, start, on_exit, backoff, started_at)
        self.call(self._watches.__setitem__, name, watch)

    def unwatch_all(self) -> None:
        """Restart nothing from now on (the cluster is stopping)."""
        if not self.ended.is_set():
            self.call(self._watches.clear)

    def wake(self) -> None:
        """Check the watched children now (a child's exit was just noticed)."""
        self._tasks.put(_WAKE)

    def stop(self) -> None:
        self._tasks.put(None)
        if threading.current_thread() is not self:
            self.ended.wait()

    def run(self) -> None:
        try:
            while True:
                try:
                    task = self._tasks.get(timeout=self._until_next_check())
                except queue.Empty:
                    task = _WAKE
                if task is None:
                    return
                if task is not _WAKE:
                    future, fn, args = task
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(*args))
                        except BaseException as e:  # handed to the caller, who raises it
                            future.set_exception(e)
                self._check()
        except BaseException as e:
            self.error = e
            raise
        finally:
            with self._ending:
                self.ended.set()
                self._fail_pending()

    def _until_next_check(self) -> float | None:
        if not self._watches:
            return None  # nothing to restart: sleep until asked
        now = time.monotonic()
        due = [w.due - now for w in self._watches.values() if w.due is not None]
        return max(0.0, min([CHECK_INTERVAL, *due]))

    def _check(self) -> None:
        for watch in list(self._watches.values()):
            now = time.monotonic()
            if watch.due is None:
                code = watch.exit_code()
                if code is not None:
                    self._schedule(watch, code, now - watch.started_at)
            elif now >= watch.due:
                watch.due = None
                watch.started_at = now
                try:
                    watch.start()
                except Exception as e:  # retried like an exit: a port taken, a fork that failed
                    delay = watch.backoff.next_delay(0.0)
                    watch.due = time.monotonic() + delay
                    self._report(f"{watch.name} could not be started again: {e}; retrying in {delay:g}s")

    def _schedule(self, watch: _Watch, code: int, ran_for: float) -> None:
        delay = watch.backoff.next_delay(ran_for)
        watch.due = time.monotonic() + delay
        failures, looping = watch.backoff.failures, watch.backoff.crash_looping
        watch.on_exit(Exit(watch.name, code, ran_for, delay, failures, looping))

    def _fail_pending(self) -> None:
        """Callers still waiting on a call must not hang once this thread has ended."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return
            if task is not None and task is not _WAKE:
                task[0].set_exception(RuntimeError("the supervisor thread has stopped"))
