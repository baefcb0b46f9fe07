"""LocalCluster and `kvserve up`'s serve loop, on stand-in services (fake_service.py)
and a real nats-server: readiness, settings, logs, crashes, and clean stops."""

import io
import os
import re
import signal
import socket
import threading

import pytest

from kvserve.cli import up
from kvserve.cli.cluster import STOP_GRACE_SECONDS, ClusterError, LocalCluster
from kvserve.cli.main import build_parser
from libs.protocol.models import DEFAULT_MODEL_ID
from tests.unit.cli.harness import children, is_alive, make_cluster


def settings_of(cluster: LocalCluster, instance_id: str) -> dict[str, str]:
    line = next(line for line in cluster.logs(instance_id) if line.startswith("settings "))
    return dict(item.split("=", 1) for item in line.split()[1:])


@pytest.fixture(scope="module")
def running(model_dir):
    log = io.StringIO()
    cluster = make_cluster(model_dir, log, prefill=2, decode=1, dtype="auto", api_key="k3y",
                           env={"KVSERVE_NUM_BLOCKS": "64"})  # fmt: skip
    cluster.start(timeout=60)
    yield cluster, log
    cluster.stop()


def test_ready_means_every_instance_has_a_heartbeat_and_the_gateway_its_address(running):
    cluster, _ = running
    expected = {"conductor-0", "store-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"}
    assert set(cluster.instances) == expected
    assert {beat.role for beat in cluster.instances.values()} == {"conductor", "store", "prefill", "decode", "gateway"}
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", cluster.gateway_url)
    assert match and int(match.group(1)) != 0  # the real port, not the 0 asked for
    socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=5).close()
    assert cluster.nats_url.startswith("nats://") and "@127.0.0.1:" in cluster.nats_url


def test_every_service_gets_the_same_resolved_settings(running, model_dir):
    cluster, _ = running
    assert cluster.dtype in ("float32", "bfloat16")  # "auto", resolved once here
    assert cluster.quantization == "none"  # "auto" on a HF folder, resolved once here
    host_ids = {beat.host_id for beat in cluster.instances.values()}
    assert host_ids == {socket.gethostname()}
    for instance_id in cluster.instances:
        s = settings_of(cluster, instance_id)
        assert s["DTYPE"] == cluster.dtype
        assert s["QUANTIZATION"] == cluster.quantization
        assert s["MODEL"] == str(model_dir.absolute())
        assert s["API_KEY"] == ("k3y" if instance_id == "gateway-0" else "-")  # the gateway alone uses it
        assert s["NUM_BLOCKS"] == "64"  # env overrides reach every service
    assert settings_of(cluster, "gateway-0")["GATEWAY_PORT"] == "0"
    assert settings_of(cluster, "prefill-0")["GATEWAY_PORT"] == "-"  # gateway settings go to the gateway only


def test_logs_are_prefixed_per_instance_and_kept(running):
    cluster, log = running
    lines = log.getvalue().splitlines()
    assert any(line.startswith("[prefill-1]   settings ") for line in lines)
    prefixed = [line for line in lines if line.startswith("[")]
    assert {len(re.match(r"\[[\w-]+\] +", line).group()) for line in prefixed} == {len("[conductor-0] ")}
    assert any("nats-server listening on nats://127.0.0.1:" in line for line in prefixed)
    assert cluster.nats_url.split("//")[1].split("@")[0] not in log.getvalue()  # the token stays out of logs
    assert cluster.logs("gateway-0")[0].startswith("settings ")


def test_wait_for_and_kill(running):
    cluster, _ = running
    cluster.wait_for(lambda beats: all(b.started_at > 0 for b in beats.values()), timeout=10)
    with pytest.raises(TimeoutError):
        cluster.wait_for(lambda beats: "nobody-0" in beats, timeout=0.2)
    assert cluster.wait_for_exit(timeout=0) is None
    pid = cluster.pids["decode-0"]
    cluster.kill("decode-0")
    assert not is_alive(pid)
    assert cluster.wait_for_exit(timeout=5) == ("decode-0", -signal.SIGKILL)
    cluster.restart("decode-0")
    assert cluster.pids["decode-0"] != pid
    seen = cluster.last_seen["decode-0"]
    cluster.wait_for(lambda beats: cluster.last_seen["decode-0"] > seen, timeout=10)
    with pytest.raises(ClusterError, match="no instance 'decode-7'"):
        cluster.kill("decode-7")


def test_no_store_default_model_and_only_the_given_settings(model_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_MODEL", "/somewhere/else")  # inherited, but not what this cluster runs
    monkeypatch.setenv("KVSERVE_API_KEY", "inherited")
    with make_cluster(model_dir, io.StringIO(), model=None, store=False) as cluster:
        assert set(cluster.instances) == {"conductor-0", "prefill-0", "decode-0", "gateway-0"}
        assert cluster.model_id == DEFAULT_MODEL_ID
        for instance_id in cluster.instances:
            s = settings_of(cluster, instance_id)
            assert (s["MODEL"], s["API_KEY"], s["USE_STORE"]) == ("-", "-", "0")


def test_up_options():
    args = build_parser().parse_args(["up"])
    assert (args.prefill, args.decode, args.port, args.host, args.store) == (1, 1, 8000, "127.0.0.1", True)
    assert (args.model, args.dtype, args.device, args.quantization) == (DEFAULT_MODEL_ID, "auto", "cpu", "auto")
    assert build_parser().parse_args(["up", "--quantization", "int4-g64"]).quantization == "int4-g64"
    args = build_parser().parse_args(["up", "--prefill", "2", "--decode", "3", "--no-store", "--api-key", "k"])
    assert (args.prefill, args.decode, args.store, args.api_key) == (2, 3, False, "k")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--decode", "-1"])
    assert up.run(build_parser().parse_args(["up", "--decode", "0"])) == 2  # only with --listen: decode hosts join


def test_a_crashing_service_fails_start_with_its_name_and_log(model_dir):
    before = children()
    log = io.StringIO()
    cluster = make_cluster(model_dir, log, env={"KVSERVE_FAKE_CRASH": "decode-0"})
    with pytest.raises(ClusterError) as failure:
        cluster.start(timeout=60)
    message = str(failure.value)
    assert message.startswith("decode-0 exited with code 3 before the cluster was ready")
    assert "decode-0: fake crash" in message  # the tail of its log says why
    assert all(not is_alive(pid) for pid in cluster.pids.values())
    assert children() == before  # nats-server included


def test_stop_kills_what_does_not_stop_and_leaves_nothing_behind(model_dir):
    before = children()
    log = io.StringIO()
    with make_cluster(model_dir, log, env={"KVSERVE_FAKE_STUCK": "store-0"}) as cluster:
        pids = cluster.pids
        assert children() - before == set(pids.values()) | {cluster.nats_pid, cluster.reaper_pid}
        cluster.stop(grace=1)
    assert "[kvserve]     store-0 did not stop within 1s; killing it" in log.getvalue()
    assert all(not is_alive(pid) for pid in pids.values())
    assert children() == before


def test_start_times_out_naming_the_silent_services(model_dir):
    before = children()
    # No Python process imports, connects and sends a heartbeat in 10 ms.
    log = io.StringIO()
    cluster = make_cluster(model_dir, log)
    with pytest.raises(ClusterError, match=r"no heartbeat from .* within 0\.01s"):
        cluster.start(timeout=0.01)
    assert children() == before


def _when_up(cluster: LocalCluster, action) -> threading.Thread:
    """Run ``action`` once the cluster has its gateway URL (checked at each heartbeat, with a deadline)."""

    def watch() -> None:
        try:  # woken at each heartbeat the cluster receives
            cluster.wait_for(lambda _: bool(cluster.gateway_url), timeout=60)
        except TimeoutError:
            return
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_serve_restarts_a_service_that_dies_and_stops_only_on_sigterm(model_dir):
    before = children()
    log = io.StringIO()
    cluster = make_cluster(model_dir, log, supervise=True, restart_delays=(0.1, 0.4))
    first = {}

    def kill_then_stop_once_restarted() -> None:
        try:
            first["pid"] = cluster.pids["prefill-0"]
            started = cluster.instances["prefill-0"].started_at
            cluster.kill("prefill-0")
            cluster.wait_for(lambda beats: beats["prefill-0"].started_at > started, timeout=30)
            first["restarted"] = cluster.pids["prefill-0"]
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    _when_up(cluster, kill_then_stop_once_restarted)
    assert up.serve(cluster, timeout=60) == 0
    assert first["restarted"] != first["pid"]
    out = log.getvalue()
    assert f"[kvserve]     prefill-0 (pid {first['pid']}) was killed by SIGKILL after " in out
    assert f"[kvserve]     prefill-0 started again (pid {first['restarted']}" in out  # (from the warm spare, if loaded)
    assert "stopping the cluster" not in out
    assert children() == before


def test_the_stop_grace_outlasts_the_gateway_drain():
    from services.gateway.app import HANDLERS_GRACE
    from services.gateway.generation import HALT_SECONDS
    from services.gateway.settings import DRAIN_TIMEOUT

    assert STOP_GRACE_SECONDS > DRAIN_TIMEOUT + HALT_SECONDS + HANDLERS_GRACE


def test_serve_announces_once_and_stops_cleanly_on_sigterm(model_dir):
    before = children()
    log = io.StringIO()
    cluster = make_cluster(model_dir, log, api_key="s3cret")
    _when_up(cluster, lambda: os.kill(os.getpid(), signal.SIGTERM))
    handler = signal.getsignal(signal.SIGTERM)
    assert up.serve(cluster, timeout=60) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    out = log.getvalue()
    assert out.count("kvserve is up: ") == 1
    url = cluster.gateway_url
    assert f"kvserve is up: {url}/v1\n" in out
    assert "model: tiny-llama (float32, weights none, cpu)\n" in out
    assert (
        f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
        '-H "Authorization: Bearer $KVSERVE_API_KEY" '
        """-d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "What is the capital of France?"}], """
        """"stream": true}'\n"""
    ) in out
    assert "Bearer s3cret" not in out  # the banner never prints the key itself
    assert children() == before


def test_the_api_key_is_read_from_a_file_and_a_missing_or_empty_one_is_refused(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    assert parser.parse_args(["up", "--api-key-file", str(key_file)]).api_key_file == "from-a-file"
    (tmp_path / "empty").write_text("")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", "--api-key-file", str(bad)])
    assert "API key" in capsys.readouterr().err


def test_a_dtype_the_model_cannot_use_stops_the_start_with_a_cluster_error(model_dir):
    cluster = make_cluster(model_dir, None, prefill=1, decode=1, dtype="float8")
    with pytest.raises(ClusterError, match="unknown dtype 'float8'"):
        cluster.start(timeout=5)
    assert not cluster.running
