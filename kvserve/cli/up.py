"""``kvserve up``: a whole local cluster in the foreground, until Ctrl-C.

The command line and the terminal only; starting, watching and stopping the
processes is LocalCluster's job.
"""

import argparse
import ipaddress
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable

from kvserve.cli.cluster import STOP_GRACE_SECONDS, ClusterError, LocalCluster
from kvserve.cli.cpus import cpus_argument, default_shared_prefill
from kvserve.cli.options import add_model_options, count, port, positive_int, read_api_key_file
from kvserve.cli.supervisor import HEALTHY_AFTER_SECONDS, RESTART_DELAY_FIRST, RESTART_DELAY_MAX
from libs.common import tenants as tenants_file
from libs.common.cpu_share import available_cpus
from libs.common.tenants import TenantsFileError

DESCRIPTION = f"""\
Run a kvserve cluster on this machine, in the foreground: nats-server, a conductor,
a KV store, prefill and decode workers and the OpenAI-compatible gateway, each its
own process, their logs interleaved here with a [service-N] prefix. The model is
prepared first (once, with a progress bar). When every service is ready, the URL
and a curl command to try are printed. Ctrl-C (or SIGTERM) stops everything
cleanly (each service gets {STOP_GRACE_SECONDS:g} s to drain, then is killed).

A process that dies once the cluster is up (a service instance or nats-server) is
started again, with the same id, port and settings, {RESTART_DELAY_FIRST:g} s later; the delay
doubles, up to {RESTART_DELAY_MAX:g} s, while it keeps dying within {HEALTHY_AFTER_SECONDS:g} s of starting. The rest
of the cluster keeps serving meanwhile. Every process it started dies with kvserve
up, however kvserve up ends (kill -9 included), and a watchdog then removes their shared
memory and the cluster's runtime directory (its NATS credentials included).

Each prefill and decode worker runs on its own share of this machine's cores (pinned,
with one torch thread per core, threads sleeping when idle), so workers do not fight
over cores: with as many cores as workers, disjoint runs of cores, split evenly (prefill
first when uneven); with fewer, every worker on every core with one thread. The
gateway, conductor and store use one thread each, unpinned. --cpus sets the shares.
One more prefill worker (--shared-prefill) runs on the decode workers' cores at low
priority (nice 5): it prefills with all of the core while decoding leaves it idle and
a quarter of it while the decode worker steps, and reports the quarter's speed, so the
conductor's promises on it hold either way.

--prefill 0 runs no prefill worker: each decode worker prefills its own requests
between its decode steps (conditional disaggregation taken all the way), and the
decode workers divide every core and keep a prefix cache; the conductor, having never
heard from a prefill worker, has the decode workers prefill every request whatever its
policy ($KVSERVE_POLICY), and admission counts each prefill's stall of the decode batch.
On 2 cores it served less than the default pair (bench/results/capacity-capped-warm.md:
capacity 1.54 against 5.17 requests/s)."""

EPILOG = """\
examples:
  kvserve up                              one worker of each kind on http://127.0.0.1:8000/v1
  kvserve up --prefill 2 --decode 2       more workers
  kvserve up --prefill 0                  one decode worker on every core, prefilling its own requests
  kvserve up --conductors 2               two conductor replicas: either may die
  kvserve up --host 0.0.0.0 --api-key s3cret
  kvserve up --model path/to/hf-folder --dtype float32
  kvserve up --cpus prefill=0-5,decode=6,7  cores 0-5 to prefill, 6 and 7 to decode
  kvserve up --listen 10.0.0.1 --write-join-bundle join.json
                                          other hosts join with: kvserve join 10.0.0.1 --bundle join.json ...
  kvserve up --listen 10.0.0.1 --nats-cluster 3 --write-join-bundle join.json --write-control-bundle control.json
                                          and one runs a second control plane: kvserve join 10.0.0.1 --bundle
                                          control.json --control-plane ..."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "up",
        help="run a local cluster (nats, conductor, store, prefill, decode, gateway) until Ctrl-C",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prefill", type=count, default=1, metavar="N",
        help="prefill workers (default 1). 0: none; each decode worker prefills its own requests, the decode "
        "workers divide every core and the conductor sends them every request whatever its policy",
    )  # fmt: skip
    parser.add_argument(
        "--decode", type=count, default=1, metavar="M",
        help="decode workers (default 1; 0 only with --listen, when decode hosts join)",
    )  # fmt: skip
    parser.add_argument(
        "--conductors", type=positive_int, default=1, metavar="N",
        help="conductor replicas, active-active: each answers admissions and books the others', so one "
        "that dies loses no request (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--nats-cluster", type=positive_int, default=1, metavar="N", dest="nats_servers",
        help="run N nats-servers routed to one another, every service given every server's URL: when one "
        "dies, its clients move to another (default 1: one nats-server, restarted when it dies)",
    )  # fmt: skip
    parser.add_argument("--port", type=port, default=8000, help="gateway port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1; 0.0.0.0 for every interface)"
    )
    parser.add_argument(
        "--no-store", dest="store", action="store_false",
        help="run without the KV store: prefix reuse stays within each prefill worker",
    )  # fmt: skip
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every request but the health probes and /openapi.json "
        "(default: $KVSERVE_API_KEY, else none). A key given here is visible to every local user in the "
        "process list: prefer $KVSERVE_API_KEY or --api-key-file",
    )
    parser.add_argument(
        "--api-key-file", type=read_api_key_file, dest="api_key_file", metavar="PATH",
        help="read the API key from the first line of this file (keep it mode 0600)",
    )  # fmt: skip
    parser.add_argument(
        "--tenants", default=os.environ.get("KVSERVE_TENANTS_FILE") or None, metavar="FILE",
        help="the tenants file: each tenant's API keys, weight, quotas and cache scope (edit it with "
        "'kvserve tenants'; the gateway re-reads it when it changes). Default: $KVSERVE_TENANTS_FILE, else none",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="SECONDS",
        help="how long every service has to become ready (default 120; preparing the model is not counted)",
    )  # fmt: skip
    parser.add_argument(
        "--cpus", type=cpus_argument(available_cpus()), metavar="ROLE=CORES,...",
        help="the cores of each worker role, as Linux core lists: prefill=0-3,decode=4-7 (a role's workers "
        "divide its cores; a role left out gets the cores left). Default: the workers divide this machine's "
        "cores evenly, prefill first",
    )  # fmt: skip
    parser.add_argument(
        "--shared-prefill", type=count, metavar="N",
        help="prefill workers on the decode workers' cores at low priority: they prefill with a quarter of a "
        "core while decoding runs there and all of it while decoding leaves it idle (default: 1 where the "
        "prefill and decode workers have cores of their own and --cpus is not given, else 0; on 2 cores: 1-3%% "
        "more goodput at equal loads, capacity 3.37 against 2.83 requests/s, bench/results/shared-prefill.md)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-port", type=port, metavar="PORT",
        help="also serve each service's own /metrics and /healthz (on 127.0.0.1), on ports from PORT up: "
        "conductor, store, prefill workers, decode workers, gateway (default: none; the gateway's /metrics "
        "has every instance's metrics)",
    )  # fmt: skip
    parser.add_argument(
        "--no-standby", dest="standby", action="store_false",
        help="keep no warm spare worker per role (default: one prefill and one decode process with the model "
        "loaded, waiting to replace the next worker of its role that dies: a restart in well under a second "
        "instead of ~4 s, for ~1 GB of memory each with the default model; the first ones load before the URL is "
        "printed, ~9 s more of start-up, so that they do not slow the first requests)",
    )  # fmt: skip
    hosts = parser.add_argument_group("several hosts (README: Several machines)")
    hosts.add_argument(
        "--listen", metavar="ADDR",
        help="this host's address on the network the hosts share: nats-server and the workers' data plane "
        "listen there (not on 127.0.0.1), so other hosts can join with 'kvserve join'. An address, not 0.0.0.0: "
        "the workers tell their peers where to reach them",
    )  # fmt: skip
    hosts.add_argument(
        "--write-join-bundle", metavar="PATH", dest="join_bundle",
        help="with --listen: write what another host needs to join (NATS credentials, a TLS certificate and "
        "key of the cluster's CA, the model's dtype) to PATH, 0600. Copy it to the other hosts like a key",
    )  # fmt: skip
    hosts.add_argument(
        "--write-control-bundle", metavar="PATH", dest="control_bundle",
        help="with --listen and --nats-cluster 2 or more: also write what another host needs to run a second "
        "control plane (kvserve join --control-plane: a nats-server routed into this one's NATS cluster, a "
        "conductor replica, a gateway), so that this host is no single point of failure, to PATH, 0600. It "
        "holds every key of the cluster (the NATS users, the CA's key, the API key)",
    )  # fmt: skip
    hosts.add_argument(
        "--no-tls", dest="tls", action="store_false",
        help="with --listen: NATS and KV between hosts in clear, for a network you trust (default: mutual TLS "
        "1.3 on both, from a CA this cluster makes; on the data plane it cost 50-69%% of TCP's throughput at "
        "4-64 MiB transfers on 2 cores, bench/results/transfer.md). Within a host KV moves through shared memory "
        "either way",
    )  # fmt: skip
    hosts.add_argument(
        "--host-id", metavar="ID",
        help="this host's name in the cluster (default: its host name); hosts with one name would be taken "
        "for one and try shared memory",
    )  # fmt: skip
    add_model_options(parser)
    parser.set_defaults(run=run)


def shared_prefill(args: argparse.Namespace) -> int:
    """--shared-prefill, or its default: none beside --cpus (the shares are the user's)."""
    if args.shared_prefill is not None:
        return args.shared_prefill
    return 0 if args.cpus else default_shared_prefill(args.prefill, args.decode, available_cpus())


def run(args: argparse.Namespace) -> int:
    if args.decode == 0 and args.listen is None:
        print("kvserve up: error: --decode 0 needs --listen: with no decode worker here, one must join", file=sys.stderr)
        return 2
    if args.join_bundle is not None and args.listen is None:
        print("kvserve up: error: --write-join-bundle needs --listen: the address the other hosts reach this one at",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.control_bundle is not None and (args.listen is None or args.nats_servers < 2):
        print("kvserve up: error: --write-control-bundle needs --listen and --nats-cluster 2 or more (3 survives "
              "one lost): the other host's nats-server routes into this host's NATS cluster", file=sys.stderr)  # fmt: skip
        return 2
    if args.listen is not None and (why := unusable_listen_address(args.listen)):
        print(f"kvserve up: error: --listen {args.listen}: {why}", file=sys.stderr)
        return 2
    if args.prefill == 0 and args.cpus and "prefill" in args.cpus:
        print("kvserve up: error: --cpus gives cores to prefill, but --prefill 0 runs no prefill worker",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.tenants is not None:
        try:
            tenants_file.read(args.tenants)  # the gateway reads it again; a bad file stops here, before anything starts
        except TenantsFileError as e:
            print(f"kvserve up: error: --tenants {args.tenants}: {e}", file=sys.stderr)
            return 2
    cluster = LocalCluster(
        prefill=args.prefill,
        decode=args.decode,
        conductors=args.conductors,
        store=args.store,
        gateway_port=args.port,
        gateway_host=args.host,
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        api_key=args.api_key_file or args.api_key,
        tenants_file=args.tenants,
        supervise=True,
        standby=args.standby,
        cpus=args.cpus,
        shared_prefill=shared_prefill(args),
        metrics_port=args.metrics_port,
        nats_servers=args.nats_servers,
        listen=args.listen,
        tls=args.tls,
        join_bundle=args.join_bundle,
        host_id=args.host_id,
        control_bundle=args.control_bundle,
    )
    return serve(cluster, timeout=args.timeout)


def serve(cluster: LocalCluster, timeout: float, announce: Callable[[LocalCluster], str] | None = None) -> int:
    """Start ``cluster`` (supervised: it restarts what dies), announce it (``announce``:
    what to print once it is ready; default `banner`), and hold it up: 0 after Ctrl-C or
    SIGTERM, 1 if its supervisor fails. A cluster that cannot start raises ClusterError."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start(timeout=timeout)
        cluster.echo((announce or banner)(cluster))
        try:
            cluster.join()  # until Ctrl-C or SIGTERM
        except ClusterError as e:
            cluster.echo(f"{e}; stopping the cluster", label="kvserve")
            return 1
        return 0
    except KeyboardInterrupt:
        cluster.echo("stopping (Ctrl-C again to kill at once)", label="kvserve")
        return 0
    finally:
        try:
            cluster.stop()
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            cluster.stop(grace=0)
        finally:
            signal.signal(signal.SIGTERM, previous)


def banner(cluster: LocalCluster) -> str:
    """What to call, printed once the cluster is ready."""
    url = f"{cluster.gateway_url}/v1"
    body = {
        "model": cluster.model_id,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "stream": True,
    }
    curl = shlex.join(["curl", "-N", f"{url}/chat/completions", "-H", "Content-Type: application/json"])
    if cluster.api_key or cluster.tenants_file:  # never the key itself: this goes to the terminal and to logs
        curl += ' -H "Authorization: Bearer $KVSERVE_API_KEY"'
    curl += " -d " + shlex.quote(json.dumps(body))
    needs_key = cluster.api_key or cluster.tenants_file
    key_note = "(with KVSERVE_API_KEY set to the API key in your shell)\n" if needs_key else ""
    ports = cluster.metrics_ports()
    metrics = f"metrics: {url.removesuffix('/v1')}/metrics" + (
        "; per service: " + ", ".join(f"{i} :{port}" for i, port in ports.items()) if ports else "") + "\n"
    cores = "; ".join(f"{i} {share.describe()}" for i, share in cluster.cpu_plan.items() if share.cpus is not None)
    hosts = ""
    if cluster.listen is not None:
        between = "mutual TLS" if cluster.tls else "in clear (--no-tls)"
        hosts = f"other hosts join at {cluster.listen} (NATS and KV between hosts: {between})"
        if cluster.join_bundle is not None:
            hosts += f":\n  kvserve join {cluster.listen} --bundle {cluster.join_bundle} --decode 1"
        if cluster.control_bundle is not None:
            hosts += (f"\na second control plane (nats-server, conductor, gateway) on another host:\n"
                      f"  kvserve join {cluster.listen} --bundle {cluster.control_bundle} --control-plane --decode 1")
        hosts += "\n"
    return (
        f"\nkvserve is up: {url}\n"
        f"model: {cluster.model_id} ({cluster.dtype}, weights {cluster.quantization}, {cluster.device})\n"
        f"cores: {cores}\n"
        f"{metrics}"
        f"{hosts}"
        f"try it:\n  {curl}\n{key_note}"
        f"Ctrl-C stops the cluster.\n"
    )


def unusable_listen_address(address: str) -> str | None:
    """Why ``address`` cannot be this host's address for the others; None when it can."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # a host name: the others resolve it
    if ip.is_unspecified:
        return "every interface is no address the other hosts can be told: give this host's own"
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster exactly as Ctrl-C does
