"""The ``kvserve`` command: one entry point, a subcommand per task."""

import argparse
import logging
import sys

from libs.protocol.errors import KVServeError


def build_parser() -> argparse.ArgumentParser:
    from kvserve.cli import bench, chat, join, model, nats_config, simulate, status, tenants, up

    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a KVCache-centric, disaggregated LLM serving platform.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (chat, model, up, join, status, bench, simulate, nats_config, tenants):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except KVServeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
