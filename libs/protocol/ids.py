"""The names kvserve gives requests, instances and KV blocks, as distinct types.

Each is a `NewType` over the base type it travels as, so a message carries plain
strings and integers while a reader (and a type checker) can tell a request id
from an instance id. A block's content hash, `BlockHash`, is defined with the
scheme that computes it, in `libs/protocol/hashing.py`.
"""

from typing import NewType

RequestId = NewType("RequestId", str)  # chosen by the gateway, unique per request
InstanceId = NewType("InstanceId", str)  # one running service process, unique in the cluster
BlockId = NewType("BlockId", int)  # a block's index in one worker's paged KV pool
