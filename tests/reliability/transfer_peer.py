"""A receiving peer in its own process, for transfer fault tests.

Prints one JSON line — the ticket — then serves until stdin closes or it is
killed. With KVSERVE_FAILPOINTS=transfer.stall_receive it accepts the token and
then stops reading, like a hung process.
"""

import json
import sys

import msgspec

from libs.transfer import SharedSegment, TransferEngine
from libs.transfer.segment import new_segment_name


def main() -> None:
    size = int(sys.argv[1])
    engine = TransferEngine("peer-host", listen="127.0.0.1:0")
    segment = SharedSegment.create(new_segment_name("peer", "rx"), size)
    engine.register(segment)
    ticket = engine.expect(segment.name, [(0, size)], ttl=120)
    print(json.dumps(msgspec.to_builtins(ticket)), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    engine.close()


if __name__ == "__main__":
    main()
