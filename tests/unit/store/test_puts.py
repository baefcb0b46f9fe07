"""Two-phase puts: a put that never commits gives its slots back; a committed one cannot expire."""

import asyncio

from services.store.puts import PendingPuts
from tests.unit.store.conftest import h


async def test_an_uncommitted_put_expires_and_a_committed_one_does_not():
    expired = asyncio.get_running_loop().create_future()
    puts = PendingPuts(lambda put: expired.set_result(put), grace_s=0.0)
    kept = puts.open([h(1)], [0], pin=False, token="t1", ttl_s=0.0)
    lost = puts.open([h(2)], [1], pin=True, token="t2", ttl_s=0.0)
    assert puts.take(kept.put_id) is kept  # committed before its deadline
    put = await asyncio.wait_for(expired, 5)
    assert (put.put_id, put.slots, put.token) == (lost.put_id, [1], "t2")
    assert len(puts) == 0 and puts.take(lost.put_id) is None  # too late to commit
