"""``kvserve nats-config``: nats-server's users and each role's credentials file, for a
cluster run by something other than ``kvserve up`` (docker compose runs it first)."""

import argparse

from libs.common.errors import KVServeError
from libs.common.nats_auth import (
    CREDENTIALS,
    MIN_SECRET_LENGTH,
    SERVER_CONFIG,
    USERS,
    NatsAuthError,
    derived_passwords,
    write_auth_files,
)
from libs.common.settings import env_str

DESCRIPTION = f"""\
Write nats-server's configuration, with one NATS user per kvserve role (gateway,
conductor, prefill, decode, store, plus observer and admin for tools) and only the
subjects each role needs, and one credentials file per user:

  {"DIR/" + str(SERVER_CONFIG):<29}for nats-server -c
  {"DIR/<user>/" + CREDENTIALS:<29}for KVSERVE_NATS_CREDENTIALS of that role's services

Passwords are derived from KVSERVE_NATS_SECRET (at least {MIN_SECRET_LENGTH} characters, read
from the environment only), so writing again gives the same files. Folders are 0700,
files 0600; give each service its own role's file only."""

EPILOG = """\
example:
  export KVSERVE_NATS_SECRET=$(openssl rand -hex 32)
  kvserve nats-config /etc/kvserve/auth"""


class NatsConfigError(KVServeError):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "nats-config",
        help="write nats-server's per-role users and each role's credentials file",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", metavar="DIR", help="where to write (created 0700 if missing)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    secret = env_str("NATS_SECRET", "")
    if not secret:
        raise NatsConfigError(f"set KVSERVE_NATS_SECRET (at least {MIN_SECRET_LENGTH} characters) in the environment")
    try:
        files = write_auth_files(args.directory, derived_passwords(secret))
    except NatsAuthError as e:
        raise NatsConfigError(str(e)) from None
    except OSError as e:
        raise NatsConfigError(f"cannot write to {args.directory}: {e.strerror}") from None
    print(f"wrote {files.server_config}")
    for user in USERS:
        print(f"wrote {files.credentials(user)}")
    return 0
