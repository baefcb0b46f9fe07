"""How `kvserve up` shares the host's cores: --cpus parsed, the default plan, what each
process is started with, and a worker applying its share to every one of its threads."""

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.cli.cpus import IO_SHARE, CpuShare, divide, parse_cpus_option, plan_cpus
from kvserve.cli.main import build_parser
from kvserve.cli.up import banner
from libs.common.cpu_share import LOW_PRIORITY_NICE, format_cpu_list, parse_cpu_list
from libs.common.settings import ModelSettings
from tests.unit.cli.harness import ROOT, make_cluster


def counts(prefill: int, decode: int) -> dict[str, int]:
    return {"conductor": 1, "store": 1, "prefill": prefill, "decode": decode, "gateway": 1}


def workers(plan: dict[str, CpuShare]) -> dict[str, tuple[str, int]]:
    """The workers' shares as (core list, threads)."""
    return {i: (format_cpu_list(s.cpus), s.threads) for i, s in plan.items() if i.split("-")[0] in ("prefill", "decode")}


def test_core_lists_parse_and_format_as_linux_writes_them():
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list(" 5 , 1-2,2") == (1, 2, 5)
    assert format_cpu_list((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    assert format_cpu_list({4}) == "4"
    for bad in ("", "a", "3-1", "-1", "1-", "0,,1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_cpus_option_names_each_role_s_cores():
    host = range(8)
    assert parse_cpus_option("prefill=0,decode=1", host) == {"prefill": (0,), "decode": (1,)}
    assert parse_cpus_option("prefill=0-3,decode=4-7", host) == {"prefill": (0, 1, 2, 3), "decode": (4, 5, 6, 7)}
    assert parse_cpus_option("prefill=0,2,4-5,decode=1", host) == {"prefill": (0, 2, 4, 5), "decode": (1,)}
    assert parse_cpus_option("decode=7", host) == {"decode": (7,)}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("gateway=0", "'gateway' is not a worker role"),
        ("0-3", "start with a role"),
        ("prefill=0,prefill=1", "prefill is given cores twice"),
        ("prefill=", "is not a core list"),
        ("decode=3-1", "not a core or an ascending range"),
        ("prefill=0,decode=9", "decode: no core 9 here (this process may run on 0-7)"),
    ],
)
def test_a_bad_cpus_option_exits_2_with_one_line_saying_why(spec, says, capsys, monkeypatch):
    with pytest.raises(ValueError) as failure:
        parse_cpus_option(spec, range(8))
    assert says in str(failure.value)
    monkeypatch.setattr("kvserve.cli.up.available_cpus", lambda: tuple(range(8)))
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--cpus", spec])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("kvserve up: error: argument --cpus: ") and says in line


@pytest.mark.parametrize(
    ("cores", "prefill", "decode", "expected"),
    [
        # this machine: one prefill and one decode worker get a core each
        (2, 1, 1, {"prefill-0": ("0", 1), "decode-0": ("1", 1)}),
        # more workers than cores: all share every core, one thread each
        (2, 1, 2, {"prefill-0": ("0-1", 1), "decode-0": ("0-1", 1), "decode-1": ("0-1", 1)}),
        (2, 2, 2, {f"{r}-{i}": ("0-1", 1) for r in ("prefill", "decode") for i in range(2)}),
        (4, 1, 1, {"prefill-0": ("0-1", 2), "decode-0": ("2-3", 2)}),
        # uneven: prefill first gets the larger share
        (4, 1, 2, {"prefill-0": ("0-1", 2), "decode-0": ("2", 1), "decode-1": ("3", 1)}),
        (4, 2, 2, {"prefill-0": ("0", 1), "prefill-1": ("1", 1), "decode-0": ("2", 1), "decode-1": ("3", 1)}),
        (4, 1, 3, {"prefill-0": ("0", 1), "decode-0": ("1", 1), "decode-1": ("2", 1), "decode-2": ("3", 1)}),
        (16, 1, 1, {"prefill-0": ("0-7", 8), "decode-0": ("8-15", 8)}),
        (16, 2, 1, {"prefill-0": ("0-5", 6), "prefill-1": ("6-10", 5), "decode-0": ("11-15", 5)}),
        (16, 1, 3, {"prefill-0": ("0-3", 4), "decode-0": ("4-7", 4), "decode-1": ("8-11", 4), "decode-2": ("12-15", 4)}),
        (16, 2, 2, {"prefill-0": ("0-3", 4), "prefill-1": ("4-7", 4), "decode-0": ("8-11", 4), "decode-1": ("12-15", 4)}),
    ],
)
def test_the_default_plan_divides_the_host_among_the_workers(cores, prefill, decode, expected):
    plan = plan_cpus(counts(prefill, decode), range(cores))
    assert workers(plan) == expected
    for io_role in ("conductor-0", "store-0", "gateway-0"):
        assert plan[io_role] == IO_SHARE == CpuShare(cpus=None, threads=1)


def test_the_host_is_the_cores_this_process_may_run_on_not_their_numbers():
    plan = plan_cpus(counts(1, 1), (3, 5, 6, 7))
    assert workers(plan) == {"prefill-0": ("3,5", 2), "decode-0": ("6-7", 2)}


def test_explicit_cores_are_divided_among_the_role_s_workers_and_a_role_left_out_gets_the_rest():
    plan = plan_cpus(counts(2, 1), range(8), {"prefill": (0, 1, 2, 3), "decode": (4,)})
    assert workers(plan) == {"prefill-0": ("0-1", 2), "prefill-1": ("2-3", 2), "decode-0": ("4", 1)}
    plan = plan_cpus(counts(1, 2), range(8), {"prefill": (0, 1)})
    assert workers(plan) == {"prefill-0": ("0-1", 2), "decode-0": ("2-4", 3), "decode-1": ("5-7", 3)}
    plan = plan_cpus(counts(1, 1), range(2), {"prefill": (0, 1)})  # nothing left: decode shares them
    assert workers(plan) == {"prefill-0": ("0-1", 2), "decode-0": ("0-1", 2)}
    plan = plan_cpus(counts(1, 1), range(2), {"prefill": (0,), "decode": (0,)})  # overlapping on purpose
    assert workers(plan) == {"prefill-0": ("0", 1), "decode-0": ("0", 1)}


def test_only_the_shared_prefill_workers_run_at_low_priority():
    low = lambda plan: {i for i, share in plan.items() if share.low_priority}  # noqa: E731
    assert low(plan_cpus(counts(1, 1), range(2))) == set()  # a core each
    assert low(plan_cpus(counts(2, 2), range(4))) == set()
    # more workers than cores: every one on every core, at its own priority
    assert low(plan_cpus(counts(1, 2), range(2))) == set()
    assert low(plan_cpus(counts(2, 2), range(2))) == set()
    assert low(plan_cpus(counts(1, 1), range(2), {"prefill": (0, 1), "decode": (1,)})) == set()  # the user's shares
    assert low(plan_cpus(counts(2, 1), range(2), shared_prefill=1)) == {"prefill-1"}
    assert CpuShare((1,), 1, low_priority=True).env()["KVSERVE_LOW_PRIORITY"] == "1"
    assert "KVSERVE_LOW_PRIORITY" not in CpuShare((1,), 1).env()
    assert CpuShare((1,), 1, low_priority=True).describe() == "cores 1, 1 thread at low priority"


def test_shared_prefill_workers_take_the_decode_workers_cores():
    plan = plan_cpus(counts(2, 1), range(2), shared_prefill=1)
    assert workers(plan) == {"prefill-0": ("0", 1), "decode-0": ("1", 1), "prefill-1": ("1", 1)}
    assert [i for i, share in plan.items() if share.low_priority] == ["prefill-1"]
    plan = plan_cpus(counts(3, 2), range(8), shared_prefill=1)  # the others divide the host as before
    assert workers(plan) == {"prefill-0": ("0-1", 2), "prefill-1": ("2-3", 2), "decode-0": ("4-5", 2),
                             "decode-1": ("6-7", 2), "prefill-2": ("4-7", 4)}  # fmt: skip
    assert [i for i, share in plan.items() if share.low_priority] == ["prefill-2"]
    with pytest.raises(ValueError):
        plan_cpus(counts(1, 1), range(2), shared_prefill=2)


@pytest.mark.parametrize(
    ("argv", "cores", "prefill", "low"),
    [
        ([], 2, 2, ["prefill-1"]),  # this machine's default: prefill-1 on the decode worker's core
        ([], 1, 1, []),  # one core: the workers share it already
        (["--shared-prefill", "0"], 2, 1, []),
        (["--shared-prefill", "2", "--decode", "2"], 8, 3, ["prefill-1", "prefill-2"]),
        (["--cpus", "prefill=0,decode=1"], 2, 1, []),  # the shares are the user's
        (["--prefill", "0"], 2, 0, []),
        (["--prefill", "2", "--decode", "1"], 2, 2, []),  # fewer cores than workers: none is added
    ],
)
def test_kvserve_up_adds_a_shared_prefill_worker_where_the_workers_have_cores_of_their_own(
    argv, cores, prefill, low, monkeypatch
):
    from kvserve.cli import up

    monkeypatch.setattr("kvserve.cli.up.available_cpus", lambda: tuple(range(cores)))
    monkeypatch.setattr("kvserve.cli.cluster.available_cpus", lambda: tuple(range(cores)))
    started = []
    monkeypatch.setattr(up, "serve", lambda cluster, timeout: started.append(cluster) or 0)
    args = build_parser().parse_args(["up", "--dtype", "float32", *argv])
    assert args.run(args) == 0
    (cluster,) = started
    assert cluster.counts["prefill"] == prefill
    assert [i for i, share in cluster.cpu_plan.items() if share.low_priority] == low


def test_divide_is_disjoint_and_covers_every_core_when_there_are_enough():
    for cores in range(1, 17):
        for n in range(1, cores + 1):
            plan = divide(range(cores), [f"w{i}" for i in range(n)])
            taken = [c for share in plan.values() for c in share.cpus]
            assert sorted(taken) == list(range(cores))
            assert all(share.threads == len(share.cpus) for share in plan.values())


def test_a_share_becomes_environment_variables():
    assert CpuShare((0, 1, 2, 5), 4).env() == {
        "KVSERVE_CPUS": "0-2,5", "KVSERVE_THREADS": "4", "OMP_NUM_THREADS": "4", "GOMP_SPINCOUNT": "1000",
    }  # fmt: skip
    assert IO_SHARE.env() == {"KVSERVE_THREADS": "1", "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "1000"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_every_process_of_a_cluster_is_started_with_its_share(model_dir):
    host = os.sched_getaffinity(0)
    with make_cluster(model_dir, io.StringIO(), env={"KVSERVE_NUM_BLOCKS": "64"}) as cluster:
        for instance_id, pid in cluster.pids.items():
            env = _environ(pid)
            share = cluster.cpu_plan[instance_id]
            assert env["GOMP_SPINCOUNT"] == "1000" and "OMP_WAIT_POLICY" not in env
            assert env["KVSERVE_THREADS"] == env["OMP_NUM_THREADS"] == str(share.threads)
            if instance_id.startswith(("prefill", "decode")):
                assert parse_cpu_list(env["KVSERVE_CPUS"]) == share.cpus
                assert set(share.cpus) <= host
            else:
                assert "KVSERVE_CPUS" not in env and share.threads == 1
        prefill, decode = set(cluster.cpu_plan["prefill-0"].cpus), set(cluster.cpu_plan["decode-0"].cpus)
        assert prefill.isdisjoint(decode) or len(host) < 2


def test_threads_asked_for_in_the_cluster_s_environment_win_over_the_plan(model_dir):
    cluster = make_cluster(model_dir, None, env={"OMP_NUM_THREADS": "3"})
    cluster._nats = SimpleNamespace(public_url="nats://127.0.0.1:1", credentials_file=lambda role: f"/{role}.json")
    env = cluster._plan("prefill", "prefill-0").env
    assert (env["KVSERVE_THREADS"], env["OMP_NUM_THREADS"]) == ("3", "3")
    assert env["KVSERVE_CPUS"] == format_cpu_list(cluster.cpu_plan["prefill-0"].cpus)  # still pinned


def test_a_worker_s_settings_refuse_cores_it_may_not_run_on(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPUS", "4096")
    with pytest.raises(ValueError, match="KVSERVE_CPUS names cores this process may not run on: 4096"):
        ModelSettings.from_env()
    monkeypatch.setenv("KVSERVE_CPUS", "0-x")
    with pytest.raises(ValueError, match="KVSERVE_CPUS: '0-x' is not a core list"):
        ModelSettings.from_env()
    monkeypatch.setenv("KVSERVE_CPUS", "")
    monkeypatch.setenv("KVSERVE_THREADS", "-2")
    with pytest.raises(ValueError, match="KVSERVE_THREADS must be at least 1"):
        ModelSettings.from_env()
    monkeypatch.setenv("KVSERVE_THREADS", "3")
    monkeypatch.setenv("KVSERVE_CPUS", format_cpu_list(os.sched_getaffinity(0)))
    settings = ModelSettings.from_env()
    assert (settings.cpus, settings.threads) == (tuple(sorted(os.sched_getaffinity(0))), 3)


def test_a_worker_pins_every_thread_it_has_and_sets_torch_s_threads():
    core = max(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os, threading
        from libs.common.cpu_share import apply_cpu_share
        started, stop = threading.Event(), threading.Event()
        threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True).start()
        started.wait()
        cpus, threads = apply_cpu_share(({core},), None)
        import torch
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
        print(cpus, threads, torch.get_num_threads(), len(tasks), {{frozenset(os.sched_getaffinity(t)) for t in tasks}})
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cpus, threads, torch_threads, num_tasks, affinities = out.stdout.split(" ", 4)
    assert (cpus, threads, torch_threads) == (f"({core},)", "1", "1")
    assert int(num_tasks) >= 2  # the thread started before the share was applied is pinned too
    assert affinities.strip() == f"{{frozenset({{{core}}})}}"


@pytest.mark.parametrize("own_session", [True, False])
def test_an_engine_thread_at_low_priority_leaves_the_process_s_other_threads_as_they_were(own_session):
    script = textwrap.dedent("""
        import os, threading
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from libs.common.cpu_share import compute_at_low_priority
        torch.set_num_threads(2)
        before = {int(t) for t in os.listdir("/proc/self/task")}
        engine = ThreadPoolExecutor(max_workers=1, initializer=compute_at_low_priority)
        work = lambda: (torch.mm(torch.ones(512, 512), torch.ones(512, 512)), threading.get_native_id())[1]
        engine_tid = engine.submit(work).result()
        started = {int(t) for t in os.listdir("/proc/self/task")} - before - {engine_tid}
        nice = lambda t: os.getpriority(os.PRIO_PROCESS, t)
        # empty where the session is in no autogroup of its own (init's, as a CI runner's may be) or the file is absent
        autogroup = (open("/proc/self/autogroup").read().split() if os.path.exists("/proc/self/autogroup") else [])
        autogroup = autogroup[-1] if autogroup else "-"
        print(nice(engine_tid), sorted({nice(t) for t in started}), sorted({nice(t) for t in before}), autogroup)
    """)  # fmt: skip
    # in a session of its own, as kvserve up starts a worker; else in this test's session
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         start_new_session=own_session)  # fmt: skip
    assert out.returncode == 0, out.stderr
    engine, team, others, autogroup = out.stdout.split()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert int(engine) == LOW_PRIORITY_NICE
    assert team == f"[{LOW_PRIORITY_NICE}]"  # torch's OpenMP thread, started by the engine thread, inherits it
    assert others == f"[{mine}]"  # the main thread (the event loop) keeps its priority
    if autogroup != "-":  # the kernel groups threads by session: the worker's own gets the same nice
        assert autogroup == (str(LOW_PRIORITY_NICE) if own_session else "0")  # never a session it shares (this test's)


def test_the_banner_lists_each_worker_s_cores(model_dir):
    cluster = make_cluster(model_dir, None, prefill=1, decode=2)
    cluster.gateway_url, cluster.model_id = "http://127.0.0.1:8000", "tiny"
    line = next(line for line in banner(cluster).splitlines() if line.startswith("cores: "))
    shares = [f"{i} {cluster.cpu_plan[i].describe()}" for i in ("prefill-0", "decode-0", "decode-1")]
    assert line == "cores: " + "; ".join(shares)
    assert CpuShare((0, 1), 2).describe() == "cores 0-1, 2 threads" and CpuShare((3,), 1).describe() == "cores 3, 1 thread"
