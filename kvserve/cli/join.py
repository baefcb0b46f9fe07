"""``kvserve join``: this host's workers in a cluster another host runs, in the
foreground, until Ctrl-C. The command line only; LocalCluster starts and supervises
the processes, as for `kvserve up`."""

import argparse
import socket
import sys

from kvserve.cli.cluster import STOP_GRACE_SECONDS, LocalCluster, instance_tag
from kvserve.cli.cpus import cpus_argument
from kvserve.cli.join_bundle import JoinBundle, read_bundle
from kvserve.cli.options import count, port
from kvserve.cli.up import serve, unusable_listen_address
from libs.common import tenants as tenants_file
from libs.common.cpu_share import available_cpus
from libs.common.tenants import TenantsFileError

DESCRIPTION = f"""\
Start prefill and decode workers (and a KV store, with --store) on this host, as part
of the kvserve cluster another host runs with

  kvserve up --listen ADDR --write-join-bundle join.json

Copy join.json here first, like a key (scp; keep it 0600): it holds the cluster's NATS
credentials for joining workers and a TLS key of the cluster's CA. The workers register
with the first host's conductor and serve its gateway's requests. NATS and the KV moving
to and from other hosts (over TCP) speak mutual TLS from the bundle's CA (unless the first
host runs with --no-tls); within this host KV moves through shared memory. They run as under `kvserve up`:
each pinned to its share of this host's cores, started again when it dies, a warm spare
per role; Ctrl-C stops them (each gets {STOP_GRACE_SECONDS:g} s to drain). The dtype and weight
precision are the first host's (the bundle says which): the KV every worker shares is in
them.

With --control-plane (and a control-plane bundle: kvserve up ... --nats-cluster 3
--write-control-bundle control.json) this host also runs a control plane of its own, so
that the first host is no single point of failure: a nats-server routed into the first
host's NATS cluster (this host's services and the other hosts' workers move to it when the
first host's servers are out of reach), a conductor replica (active-active with the first
host's) and an OpenAI-compatible gateway (--host, --port) that checks the first host's
API key or tenants file. The control-plane bundle holds every key of the cluster: copy
it only to hosts you would run the first host's services on."""

EPILOG = """\
examples:
  kvserve join 10.0.0.1 --bundle join.json --decode 1
  kvserve join 10.0.0.1 --bundle join.json --prefill 1 --decode 1 --store
  kvserve join head.lan --bundle join.json --decode 2 --listen 10.0.0.7 --host-id rack2-node7
  kvserve join 10.0.0.1 --bundle control.json --control-plane --host 0.0.0.0 --decode 1"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "join",
        help="run workers on this host in a cluster another host started with 'kvserve up --listen'",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("host", metavar="HOST", help="the first host's address, as this host reaches it")
    parser.add_argument(
        "--bundle", required=True, metavar="PATH",
        help="the join bundle the first host wrote (kvserve up --write-join-bundle PATH)",
    )  # fmt: skip
    parser.add_argument("--prefill", type=count, default=0, metavar="N", help="prefill workers (default 0)")
    parser.add_argument("--decode", type=count, default=0, metavar="M", help="decode workers (default 0)")
    parser.add_argument("--store", action="store_true", help="also run a KV store on this host")
    control = parser.add_argument_group("a second control plane (README: Several machines)")
    control.add_argument(
        "--control-plane", action="store_true",
        help="also run a nats-server routed into the first host's, a conductor replica and a gateway here, so "
        "the cluster serves while the first host is out of reach (needs a control-plane bundle: kvserve up "
        "--write-control-bundle)",
    )  # fmt: skip
    control.add_argument("--port", type=port, metavar="PORT",
                         help="with --control-plane: the gateway's port (default 8000; 0 picks a free one)")
    control.add_argument("--host", dest="gateway_host", metavar="ADDR",
                         help="with --control-plane: the gateway's listen address (default 127.0.0.1; 0.0.0.0 for "
                         "every interface)")  # fmt: skip
    control.add_argument(
        "--tenants", metavar="FILE",
        help="with --control-plane: the tenants file this host's gateway checks (default: the first host's, as "
        "it was when the bundle was written)",
    )  # fmt: skip
    parser.add_argument(
        "--listen", metavar="ADDR",
        help="this host's address, where the other hosts reach its workers' data plane (default: the address "
        "this host reaches HOST from)",
    )  # fmt: skip
    parser.add_argument(
        "--host-id", metavar="ID",
        help="this host's name in the cluster (default: its host name); it must differ from every other host's",
    )  # fmt: skip
    parser.add_argument(
        "--model", metavar="PATH",
        help="where the first host's model is on this host (default: the bundle's path, or the default model)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--cpus", type=cpus_argument(available_cpus()), metavar="ROLE=CORES,...",
        help="the cores of each worker role on this host, as under 'kvserve up' (default: divided evenly)",
    )  # fmt: skip
    parser.add_argument(
        "--no-standby", dest="standby", action="store_false",
        help="keep no warm spare worker per role (default: one per role, as under 'kvserve up')",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="SECONDS",
        help="how long the workers have to report to the cluster (default 120; preparing the model is not counted)",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not (args.prefill or args.decode or args.store or args.control_plane):
        print("kvserve join: error: nothing to run here: give --prefill N, --decode M, --store or --control-plane",
              file=sys.stderr)  # fmt: skip
        return 2
    bundle = read_bundle(args.bundle)  # a JoinBundleError is a KVServeError: one line, exit 1
    given = [option for option, value in (("--port", args.port), ("--host", args.gateway_host),
                                          ("--tenants", args.tenants)) if value is not None]  # fmt: skip
    if given and not args.control_plane:
        print(f"kvserve join: error: {', '.join(given)}: only with --control-plane (this host runs no gateway "
              "otherwise)", file=sys.stderr)  # fmt: skip
        return 2
    if args.control_plane and bundle.control is None:
        print(f"kvserve join: error: --control-plane needs a control-plane bundle; {args.bundle} is a join bundle "
              "(on the first host: kvserve up ... --nats-cluster 3 --write-control-bundle PATH)", file=sys.stderr)  # fmt: skip
        return 2
    if args.tenants is not None:
        try:
            tenants_file.read(args.tenants)
        except TenantsFileError as e:
            print(f"kvserve join: error: --tenants {args.tenants}: {e}", file=sys.stderr)
            return 2
    host_id = args.host_id or socket.gethostname()
    if instance_tag(host_id) == instance_tag(bundle.host_id):
        print(f"kvserve join: error: this host is called {host_id!r}, as is the first host: give it another "
              "name with --host-id", file=sys.stderr)  # fmt: skip
        return 2
    try:
        listen = args.listen or address_towards(args.host)
    except OSError as e:
        print(f"kvserve join: error: cannot reach {args.host}: {e.strerror or e}", file=sys.stderr)
        return 2
    if why := unusable_listen_address(listen):
        print(f"kvserve join: error: --listen {listen}: {why}", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        prefill=args.prefill, decode=args.decode, store=args.store, member=bundle, member_host=args.host,
        listen=listen, host_id=host_id, model=args.model or bundle.model.spec, dtype=bundle.model.dtype,
        quantization=bundle.model.quantization, device=args.device, supervise=True, standby=args.standby,
        cpus=args.cpus, control_plane=args.control_plane, gateway_port=8000 if args.port is None else args.port,
        gateway_host=args.gateway_host or "127.0.0.1",
        tenants_file=args.tenants,
    )  # fmt: skip
    return serve(cluster, timeout=args.timeout, announce=lambda c: joined(c, bundle, args.host))


def address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def joined(cluster: LocalCluster, bundle: JoinBundle, host: str) -> str:
    """What to print once this host's workers have reported to the cluster."""
    between = "mutual TLS" if cluster.tls else "in clear"
    if cluster.control_plane:
        serving = (f"this host's gateway: {cluster.gateway_url}/v1 (the first host's serves too); "
                   "Ctrl-C stops this host's services.\n")  # fmt: skip
    else:
        serving = "requests go to the first host's gateway; Ctrl-C stops this host's workers.\n"
    return (
        f"\nthis host ({cluster.host_id}, {cluster.listen}) joined the cluster at {host}: "
        f"{', '.join(cluster.instance_ids)}\n"
        f"model: {cluster.model_id} ({cluster.dtype}, weights {cluster.quantization}, {cluster.device}); "
        f"NATS and KV between hosts: {between}\n"
        + serving
    )
