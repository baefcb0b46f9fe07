"""Supervision, on stand-in services (fake_service.py) and a real nats-server: what dies
is started again (nats-server on its port), what a dead child leaves in shared memory
is removed, a crash loop is retried ever more slowly, and nothing outlives the launcher:
no process, no segment, no credential."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.cli.reaper import reap
from kvserve.cli.supervisor import SHM_DIR, Backoff, die_with_launcher, remove_segments_of
from libs.common.nats_auth import TOOLS
from tests.integration.conftest import wait_until
from tests.unit.cli.harness import ROOT, children, is_alive, kill_leftovers, make_cluster

DELAYS = (0.1, 0.4)  # first and longest restart delay: quick tests


def segments_of(pid: int) -> list[str]:
    return sorted(path.name for path in SHM_DIR.glob(f"kvserve-{pid}-*"))


@pytest.fixture(scope="module")
def supervised(model_dir, tmp_path_factory):
    crash_file = tmp_path_factory.mktemp("crash") / "crashing"
    log = io.StringIO()
    env = {"KVSERVE_FAKE_SEGMENT": "1", "KVSERVE_FAKE_CRASH_FILE": str(crash_file)}
    cluster = make_cluster(model_dir, log, prefill=2, supervise=True, restart_delays=DELAYS, env=env)
    cluster.start(timeout=60)
    yield cluster, log, crash_file
    cluster.stop()


def restarted(cluster, instance_id: str, started_at: float, timeout: float = 30) -> None:
    """Wait for a heartbeat from a process of ``instance_id`` started after ``started_at``."""
    cluster.wait_for(lambda beats: beats[instance_id].started_at > started_at, timeout=timeout)


def test_start_returns_once_the_first_spares_have_loaded(model_dir):
    """Their load would otherwise share the cores with the first requests."""
    cluster = make_cluster(model_dir, None, supervise=True, env={"KVSERVE_FAKE_PRELOAD_S": "1.5"})
    cluster.start(timeout=60)
    try:
        assert cluster.loaded_spares == {"prefill", "decode"}
    finally:
        cluster.stop()


def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_run():
    backoff = Backoff(first=0.5, longest=10.0, healthy_after=30.0)
    assert [backoff.next_delay(ran_for=1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.crash_looping
    assert backoff.next_delay(ran_for=30.0) == 0.5
    assert (backoff.failures, backoff.crash_looping) == (1, False)


def test_a_killed_service_is_restarted_with_its_segments_removed_and_the_others_untouched(supervised):
    cluster, log, _ = supervised
    cluster.wait_for_spares(timeout=30)
    spare = cluster.spare_pids["prefill"]
    pids = cluster.pids
    old = pids["prefill-0"]
    assert segments_of(old)  # the stand-in holds one, as a worker holds its KV pool
    started = cluster.instances["prefill-0"].started_at
    os.kill(old, signal.SIGKILL)
    restarted(cluster, "prefill-0", started)
    new = cluster.pids["prefill-0"]
    assert new == spare and is_alive(new)  # the warm spare became prefill-0
    assert cluster.pids == pids | {"prefill-0": new}  # nobody else was restarted
    assert segments_of(old) == []  # SIGKILL gave it no chance to remove its own
    assert segments_of(new)
    out = log.getvalue()
    assert f"[kvserve]     prefill-0 (pid {old}) was killed by SIGKILL after " in out
    assert f"; restarting it in {DELAYS[0]:g}s\n" in out
    assert f"[kvserve]     prefill-0 started again (pid {new}, the warm spare)\n" in out
    assert "settings MODEL=" in "".join(line for line in out.splitlines(True) if line.startswith("[prefill-0]"))
    assert cluster.wait_for_exit(timeout=0) is None


def test_a_restarted_gateway_listens_on_the_port_it_announced(supervised):
    cluster, log, _ = supervised
    url, port = cluster.gateway_url, int(cluster.gateway_url.rsplit(":", 1)[1])  # asked for port 0
    started = cluster.instances["gateway-0"].started_at
    cluster.kill("gateway-0")
    restarted(cluster, "gateway-0", started)
    assert cluster.instances["gateway-0"].address == url
    socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_nats_server_is_restarted_on_the_same_port_and_every_service_reconnects(supervised):
    cluster, log, _ = supervised
    pids, old, port, url = cluster.pids, cluster.nats_pid, cluster._nats.servers[0].port, cluster.nats_url
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: cluster.nats_pid != old, timeout=30)
    back = time.monotonic()
    # Every instance heard from through the new server (the launcher's own watcher reconnected, too).
    cluster.wait_for(lambda _: all(seen > back for seen in cluster.last_seen.values()), timeout=30)
    assert (cluster._nats.servers[0].port, cluster.nats_url) == (port, url)
    assert cluster.pids == pids  # the services rode it out
    out = log.getvalue()
    assert f"[kvserve]     nats-server (pid {old}) was killed by SIGKILL after " in out
    assert f"; restarting it on port {port} in " in out
    assert f"nats-server started again on nats://127.0.0.1:{port} (pid {cluster.nats_pid})" in out


def test_a_crash_loop_is_retried_with_growing_delays_until_it_recovers(supervised):
    cluster, log, crash_file = supervised
    crash_file.write_text("decode-0\n")
    started = cluster.instances["decode-0"].started_at
    try:
        cluster.kill("decode-0")
        wait_until(lambda: "decode-0 (pid" in log.getvalue() and "it is crash-looping" in log.getvalue(), 60)
    finally:
        crash_file.write_text("")
    restarted(cluster, "decode-0", started)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("[kvserve]     decode-0 (pid")]
    assert " was killed by SIGKILL after " in lines[0]
    assert [line.rsplit(" in ", 1)[1] for line in lines[:3]] == ["0.1s", "0.2s", "0.4s"]
    assert " exited with code 3 after " in lines[1]
    assert "it is crash-looping (3 exits in a row, each within 30s of starting)" in lines[2]
    assert "decode-0: fake crash" in log.getvalue()  # its last lines, printed with the warning


def test_killing_the_launcher_kills_every_process_it_started_and_leaves_nothing_behind(model_dir, tmp_path):
    # Its temporary directories go to tmp_path, so that whatever it left there is seen.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.cli.supervised_cluster", str(model_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    # A live process's segment, as another cluster's: not this cluster's to remove.
    others = SHM_DIR / f"kvserve-{os.getpid()}-prefill-0-kv-0123456789ab"
    others.write_bytes(b"x")
    pids: dict[str, int] = {}
    try:
        line = launcher.stdout.readline()  # once its cluster is ready
        assert line.startswith("pids "), f"the launcher exited first ({launcher.poll()})"
        pids = json.loads(line.split(" ", 1)[1])
        runtime = Path(launcher.stdout.readline().removeprefix("runtime ").strip())
        assert set(pids) == {"conductor-0", "store-0", "prefill-0", "decode-0", "gateway-0", "nats-server", "reaper"}
        assert all(is_alive(pid) for pid in pids.values())
        services = [pid for name, pid in pids.items() if name not in ("nats-server", "reaper")]
        assert all(segments_of(pid) for pid in services)  # each holds one, as a worker holds its KV pool
        credentials = sorted(runtime.glob("kvserve-nats-auth-*/*/credentials.json"))
        # one per NATS user: each service instance's own, and the tools'
        assert runtime.parent == tmp_path
        assert {path.parent.name for path in credentials} == set(pids) - {"nats-server", "reaper"} | set(TOOLS)
        launcher.kill()
        launcher.wait()
        # The watchdog exits last, once it has cleaned up.
        wait_until(lambda: not any(is_alive(pid) for pid in pids.values()), timeout=30)
        assert [name for pid in pids.values() for name in segments_of(pid)] == []
        assert not runtime.exists() and list(tmp_path.iterdir()) == []  # no credential, no runtime directory
        assert others.exists()
    finally:
        others.unlink(missing_ok=True)
        kill_leftovers(launcher, pids.values())
        for pid in pids.values():
            remove_segments_of(pid)  # likewise, what they left


def test_a_child_whose_launcher_is_already_gone_exits_before_exec():
    # die_with_launcher()'s check, with the "launcher" a process that is not the parent:
    # here the real parent is a forked copy, as when the launcher died before prctl ran.
    script = """if True:
        import os, subprocess, sys
        from kvserve.cli.supervisor import die_with_launcher
        preexec = die_with_launcher()
        if os.fork() == 0:
            child = subprocess.Popen([sys.executable, "-c", "print('exec ran')"], preexec_fn=preexec)
            os._exit(child.wait())
        print("exit", os.waitstatus_to_exitcode(os.wait()[1]))
        ok = subprocess.run([sys.executable, "-c", "print('exec ran')"], preexec_fn=preexec, capture_output=True)
        print("control", ok.returncode, ok.stdout.decode().strip())
    """
    before = children()
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["exit 1", "control 0 exec ran"], out.stderr
    assert children() == before
    assert die_with_launcher() is not None  # Linux: the signal is set


def test_segments_are_removed_by_owner_pid_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    mine = SHM_DIR / f"kvserve-{pid}-prefill-0-kv-0123456789ab"
    other = SHM_DIR / f"kvserve-{pid}1-prefill-0-kv-0123456789ab"  # another pid that starts with the same digits
    for path in (mine, other):
        path.write_bytes(b"x")
    try:
        assert remove_segments_of(pid) == [mine.name]
        assert not mine.exists() and other.exists()
    finally:
        for path in (mine, other):
            path.unlink(missing_ok=True)


def test_the_reaper_cleans_up_after_the_processes_named_to_it_and_not_the_forgotten_ones(tmp_path):
    ended = [subprocess.Popen([sys.executable, "-c", ""]) for _ in range(2)]
    for proc in ended:
        proc.wait()
    watched, forgotten = (proc.pid for proc in ended)
    made = [SHM_DIR / f"kvserve-{pid}-prefill-0-kv-0123456789ab" for pid in (watched, forgotten)]
    runtime = tmp_path / "kvserve-cluster-x"
    (runtime / "kvserve-nats-auth-y" / "store").mkdir(parents=True)
    (runtime / "kvserve-nats-auth-y" / "store" / "credentials.json").write_text("{}")
    try:
        for path in made:
            path.write_bytes(b"x")
        lines = [f"watch {watched}\n", f"watch {forgotten}\n", "nonsense\n", f"forget {forgotten}\n"]
        reap([line.encode() for line in lines], runtime)  # the launcher's lines, then the end of its pipe
        assert [path.exists() for path in made] == [False, True]  # a forgotten one's are the launcher's to remove
        assert not runtime.exists()
    finally:
        for path in made:
            path.unlink(missing_ok=True)
