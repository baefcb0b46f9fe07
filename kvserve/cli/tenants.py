"""``kvserve tenants``: edit a tenants file (see libs/common/tenants.py).

A new key is printed once, on stdout, and stored only as its sha256; a running
gateway picks each change up by itself (it watches the file), or on SIGHUP.
"""

import argparse
import os
import sys
from dataclasses import replace

from libs.common import tenants as tenants_file
from libs.common.tenants import Quotas, Tenant, Tenants, TenantsFileError

DEFAULT_FILE_ENV = "KVSERVE_TENANTS_FILE"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tenants", help="add, list, re-key or remove the tenants of a tenants file",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def file_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--file", default=os.environ.get(DEFAULT_FILE_ENV) or None, metavar="F",
                       required=not os.environ.get(DEFAULT_FILE_ENV),
                       help=f"the tenants file (default: ${DEFAULT_FILE_ENV})")  # fmt: skip

    add = actions.add_parser("add", help="add a tenant and print its first API key (once)")
    add.add_argument("name")
    file_option(add)
    add.add_argument("--weight", type=float, default=1.0, help="its share under overload, relative (default 1)")
    add.add_argument("--requests-per-minute", type=int, metavar="N")
    add.add_argument("--tokens-per-minute", type=int, metavar="N", help="prompt and completion tokens")
    add.add_argument("--max-concurrent", type=int, metavar="N")
    add.add_argument("--max-prompt-tokens", type=int, metavar="N")
    add.add_argument("--cache-scope", metavar="NAME",
                     help="share KV cache with every tenant in this named scope (default: its own scope)")
    add.add_argument("--admin", action="store_true",
                     help="its keys see every tenant's usage in /console and `kvserve status` (default: its own only)")
    add.set_defaults(run=run_add)

    listing = actions.add_parser("list", help="the tenants, their weights, quotas and number of keys")
    file_option(listing)
    listing.set_defaults(run=run_list)

    rotate = actions.add_parser("rotate-key", help="replace a tenant's keys with a new one, printed once")
    rotate.add_argument("name")
    file_option(rotate)
    rotate.add_argument("--keep-old", action="store_true", help="keep the old keys too (remove them later)")
    rotate.set_defaults(run=run_rotate)

    remove = actions.add_parser("remove", help="remove a tenant (its keys stop working)")
    remove.add_argument("name")
    file_option(remove)
    remove.set_defaults(run=run_remove)


def _load(path: str, create: bool = False) -> Tenants:
    if create and not os.path.exists(path):
        return Tenants({}, tenants_file.new_secret())
    try:
        found = tenants_file.read(path)
    except TenantsFileError as e:
        raise SystemExit(f"kvserve tenants: error: {path}: {e}") from None
    return found if found.scope_secret else replace(found, scope_secret=tenants_file.new_secret())


def _existing(tenants: Tenants, name: str) -> Tenant:
    if name not in tenants.tenants:
        raise SystemExit(f"kvserve tenants: error: no tenant {name!r}")
    return tenants.tenants[name]


def run_add(args: argparse.Namespace) -> int:
    tenants = _load(args.file, create=True)
    if args.name in tenants.tenants:
        raise SystemExit(f"kvserve tenants: error: tenant {args.name!r} exists (rotate-key gives it a new key)")
    key = tenants_file.new_key()
    quotas = Quotas(args.requests_per_minute, args.tokens_per_minute, args.max_concurrent, args.max_prompt_tokens)
    tenant = Tenant(args.name, (tenants_file.hash_key(key),), args.weight, quotas, args.cache_scope, admin=args.admin)
    _save(args.file, tenants_file.with_tenant(tenants, tenant))
    _print_key(args.name, key)
    return 0


def run_list(args: argparse.Namespace) -> int:
    tenants = _load(args.file)
    print(f"{'TENANT':<20} {'WEIGHT':>6} {'KEYS':>4}  {'SCOPE':<16} QUOTAS")
    for t in tenants.tenants.values():
        quotas = ", ".join(f"{k}={v}" for k, v in vars(t.quotas).items() if v is not None) or "-"
        state = (" (admin)" if t.admin else "") + (" (disabled)" if t.disabled else "")
        print(f"{t.name:<20} {t.weight:>6g} {len(t.key_hashes):>4}  {t.cache_scope or '(own)':<16} {quotas}{state}")
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    tenants = _load(args.file)
    tenant = _existing(tenants, args.name)
    key = tenants_file.new_key()
    kept = tenant.key_hashes if args.keep_old else ()
    _save(args.file, tenants_file.with_tenant(tenants, replace(tenant, key_hashes=(*kept, tenants_file.hash_key(key)))))
    _print_key(args.name, key)
    return 0


def run_remove(args: argparse.Namespace) -> int:
    tenants = _load(args.file)
    _existing(tenants, args.name)
    rest = {name: t for name, t in tenants.tenants.items() if name != args.name}
    _save(args.file, replace(tenants, tenants=rest))
    print(f"removed tenant {args.name}", file=sys.stderr)
    return 0


def _save(path: str, tenants: Tenants) -> None:
    try:
        tenants_file.parse(tenants_file.dumps(tenants))  # what it writes, it can read back
    except TenantsFileError as e:
        raise SystemExit(f"kvserve tenants: error: {e}") from None
    tenants_file.write(path, tenants)


def _print_key(name: str, key: str) -> None:
    print(f"the API key of tenant {name} (shown this once; only its hash is stored):", file=sys.stderr)
    print(key)
