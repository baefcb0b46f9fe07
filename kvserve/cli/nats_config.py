"""``kvserve nats-config``: nats-server's users and each user's credentials file, for a
cluster run by something other than ``kvserve up`` (docker compose runs it first)."""

import argparse

from libs.common.nats_auth import (
    CLUSTER_CONFIG,
    CLUSTER_PORT,
    CREDENTIALS,
    MIN_SECRET_LENGTH,
    SERVER_CONFIG,
    SERVICE_ROLES,
    NatsAuthError,
    cluster_config,
    derived_passwords,
    derived_route_password,
    instance_identities,
    role_identities,
    write_auth_files,
    write_private,
)
from libs.common.settings import env_str
from libs.protocol.errors import KVServeError

DESCRIPTION = f"""\
Write nats-server's configuration, with one NATS user per kvserve role (gateway,
conductor, prefill, decode, store, plus observer and admin for tools) and only the
subjects each role needs, and one credentials file per user:

  {"DIR/" + str(SERVER_CONFIG):<29}for nats-server -c
  {"DIR/<user>/" + CREDENTIALS:<29}for KVSERVE_NATS_CREDENTIALS of that user's services
  {"DIR/" + str(CLUSTER_CONFIG):<29}with --routes: for each nats-server of a cluster

--routes HOST:PORT,... names every server of a NATS cluster by where it takes routes
(its own entry included: nats-server skips a route to itself). Each server then runs
with -c cluster.conf, which includes nats.conf and routes to the others as a route
user whose password is derived from the same secret; give every service every
server's URL (KVSERVE_NATS_URL, comma-separated) or one name that reaches them all.
cluster.conf also turns JetStream on (its state under --jetstream-dir; give each server
its own name with --server_name): the KV history a starting conductor catches up from
(kept in memory, at most 512 MiB per server, each stream on three servers), instead of
asking every instance for a snapshot at once.

A role's user may use the subjects of every instance of the role: it is for instances
whose ids are drawn at start (docker compose --scale, a Kubernetes Deployment). An
instance whose id is fixed (KVSERVE_INSTANCE_ID) can have a user of its own, named
after it, that may use only that instance's subjects: --instance ROLE:ID.

Passwords are derived from KVSERVE_NATS_SECRET (at least {MIN_SECRET_LENGTH} characters, read
from the environment only), so writing again gives the same files. Folders are 0700,
files 0600; give each service its own file only."""

EPILOG = """\
examples:
  export KVSERVE_NATS_SECRET=$(openssl rand -hex 32)
  kvserve nats-config /etc/kvserve/auth --instance store:store-0
  kvserve nats-config /etc/kvserve/auth --routes nats-0:6222,nats-1:6222,nats-2:6222"""


JETSTREAM_DIR = "/data/jetstream"  # in the nats-server container (compose, Kubernetes)


class NatsConfigError(KVServeError):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "nats-config",
        help="write nats-server's per-role (and per-instance) users and each user's credentials file",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", metavar="DIR", help="where to write (created 0700 if missing)")
    parser.add_argument("--instance", action="append", default=[], metavar="ROLE:ID", type=_instance,
                        help="also a user of its own for instance ID of ROLE (repeatable)")  # fmt: skip
    parser.add_argument("--routes", type=_routes, default=None, metavar="HOST:PORT,...",
                        help="also write cluster.conf, for the servers of a NATS cluster at these route addresses")
    parser.add_argument("--cluster-listen", default=f"0.0.0.0:{CLUSTER_PORT}", metavar="HOST:PORT",
                        help="with --routes: where each server takes routes (default %(default)s)")  # fmt: skip
    parser.add_argument("--jetstream-dir", default=JETSTREAM_DIR, metavar="PATH",
                        help="with --routes: where each server keeps its JetStream state (default %(default)s; "
                        "an empty string leaves JetStream off)")  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    secret = env_str("NATS_SECRET", "")
    if not secret:
        raise NatsConfigError(f"set KVSERVE_NATS_SECRET (at least {MIN_SECRET_LENGTH} characters) in the environment")
    try:
        instances = dict(args.instance)
        identities = role_identities() + [i for i in instance_identities(instances) if i.instance_id is not None]
        files = write_auth_files(args.directory, identities, derived_passwords(secret, identities))
        cluster = None
        if args.routes is not None:
            cluster = files.directory / CLUSTER_CONFIG
            text = cluster_config(SERVER_CONFIG.name, args.cluster_listen, derived_route_password(secret), args.routes,
                                  jetstream_dir=args.jetstream_dir or None)  # fmt: skip
            write_private(cluster, text)
    except NatsAuthError as e:
        raise NatsConfigError(str(e)) from None
    except OSError as e:
        raise NatsConfigError(f"cannot write to {args.directory}: {e.strerror}") from None
    print(f"wrote {files.server_config}")
    if cluster is not None:
        print(f"wrote {cluster}")
    for user in files.users:
        print(f"wrote {files.credentials(user)}")
    return 0


def _instance(text: str) -> tuple[str, str]:
    """``ROLE:ID`` -> (ID, ROLE)."""
    role, _, instance_id = text.partition(":")
    if role not in SERVICE_ROLES or not instance_id:
        raise argparse.ArgumentTypeError(f"{text!r}: ROLE:ID, ROLE one of {', '.join(SERVICE_ROLES)}")
    return instance_id, role


def _routes(text: str) -> list[str]:
    """``HOST:PORT,...`` -> the addresses, each checked."""
    routes = [one.strip() for one in text.split(",") if one.strip()]
    for route in routes:
        host, _, port = route.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{route!r}: HOST:PORT, the port 1-65535")
    if not routes:
        raise argparse.ArgumentTypeError("name at least one server, HOST:PORT")
    return routes
