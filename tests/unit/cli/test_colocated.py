"""`kvserve up --prefill 0`: no prefill worker, the decode workers on every core, and the
conductor's policy left to its own settings, which serve a cluster that never had a prefill
worker on its decode workers (stand-in services on a real nats-server)."""

import io
from types import SimpleNamespace

import pytest

from kvserve.cli import up
from kvserve.cli.cpus import plan_cpus
from kvserve.cli.main import build_parser
from libs.common.cpu_share import available_cpus, format_cpu_list
from tests.unit.cli.harness import make_cluster


def counts(prefill: int, decode: int) -> dict[str, int]:
    return {"conductor": 1, "store": 1, "prefill": prefill, "decode": decode, "gateway": 1}


def worker_cores(plan) -> dict[str, str]:
    return {i: format_cpu_list(s.cpus) for i, s in plan.items() if i.startswith(("prefill", "decode"))}


def test_with_no_prefill_worker_the_decode_workers_divide_every_core():
    assert worker_cores(plan_cpus(counts(0, 1), range(2))) == {"decode-0": "0-1"}
    assert plan_cpus(counts(0, 1), range(2))["decode-0"].threads == 2
    assert worker_cores(plan_cpus(counts(0, 2), range(4))) == {"decode-0": "0-1", "decode-1": "2-3"}
    assert worker_cores(plan_cpus(counts(0, 1), range(4), {"decode": (1, 2)})) == {"decode-0": "1-2"}


def test_cores_for_a_role_with_no_worker_are_an_error():
    with pytest.raises(ValueError, match="cores are given to prefill, but the cluster runs no prefill worker"):
        plan_cpus(counts(0, 1), range(2), {"prefill": (0,), "decode": (1,)})


def test_up_takes_prefill_0_but_decode_0_only_where_decode_hosts_join(capsys, monkeypatch):
    assert build_parser().parse_args(["up", "--prefill", "0"]).prefill == 0
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--prefill", "-1"])
    assert exit_.value.code == 2
    assert "must be at least 0, got -1" in capsys.readouterr().err
    monkeypatch.setattr("kvserve.cli.up.LocalCluster", lambda **kwargs: pytest.fail("a cluster was built"))
    args = build_parser().parse_args(["up", "--decode", "0"])
    assert up.run(args) == 2
    assert "--decode 0 needs --listen" in capsys.readouterr().err


def test_up_refuses_cores_for_prefill_with_prefill_0_before_starting_anything(capsys, monkeypatch):
    monkeypatch.setattr("kvserve.cli.up.available_cpus", lambda: (0, 1))
    monkeypatch.setattr("kvserve.cli.up.LocalCluster", lambda **kwargs: pytest.fail("a cluster was built"))
    args = build_parser().parse_args(["up", "--prefill", "0", "--cpus", "prefill=0,decode=1"])
    assert up.run(args) == 2
    assert capsys.readouterr().err.strip() == (
        "kvserve up: error: --cpus gives cores to prefill, but --prefill 0 runs no prefill worker"
    )


def _env(cluster, role: str = "conductor") -> dict[str, str]:
    cluster._nats = SimpleNamespace(public_url="nats://127.0.0.1:1", credentials_file=lambda role: f"/{role}.json")
    return cluster._plan(role, f"{role}-0").env


def _conductor_env(cluster) -> dict[str, str]:
    return _env(cluster, "conductor")


def test_the_cluster_leaves_the_decode_prefix_cache_to_the_workers_own_default(model_dir, monkeypatch):
    monkeypatch.delenv("KVSERVE_ENABLE_PREFIX_CACHE", raising=False)
    for prefill in (0, 1):
        assert "KVSERVE_ENABLE_PREFIX_CACHE" not in _env(make_cluster(model_dir, None, prefill=prefill), "decode")
    off = {"KVSERVE_ENABLE_PREFIX_CACHE": "0"}  # a baseline without it, as kvserve-nocache runs
    assert _env(make_cluster(model_dir, None, prefill=0, env=off), "decode")["KVSERVE_ENABLE_PREFIX_CACHE"] == "0"


def test_the_conductor_policy_is_the_users_whatever_the_prefill_count(model_dir, monkeypatch):
    monkeypatch.delenv("KVSERVE_POLICY", raising=False)
    for prefill in (0, 1):
        assert "KVSERVE_POLICY" not in _conductor_env(make_cluster(model_dir, None, prefill=prefill))
    given = {"KVSERVE_POLICY": "least_loaded"}
    assert _conductor_env(make_cluster(model_dir, None, prefill=0, env=given))["KVSERVE_POLICY"] == "least_loaded"
    with pytest.raises(ValueError, match="at least one decode worker"):
        make_cluster(model_dir, None, prefill=0, decode=0)


def test_a_cluster_with_no_prefill_worker_starts_and_says_how_it_prefills(model_dir, monkeypatch):
    monkeypatch.delenv("KVSERVE_POLICY", raising=False)
    log = io.StringIO()
    with make_cluster(model_dir, log, prefill=0, env={"KVSERVE_NUM_BLOCKS": "64"}) as cluster:
        assert set(cluster.instances) == {"conductor-0", "store-0", "decode-0", "gateway-0"}
        assert cluster.cpu_plan["decode-0"].cpus == tuple(sorted(available_cpus()))  # every core
    assert "no prefill worker: each decode worker prefills its own requests" in log.getvalue()
