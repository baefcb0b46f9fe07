"""A disk that fails every write (full) is logged without a flood: its first failure
at once, then one line with the count, the bytes and the first error, when a write
lands again, when the run has lasted its time, or when the tier closes."""

import errno
import logging
import os

import pytest

from services.store.block_files import HEADER, BlockFiles
from tests.integration.conftest import wait_until_async
from tests.unit.store.conftest import BLOCK, h, put

FULL = os.strerror(errno.ENOSPC)
FILE_NBYTES = HEADER.size + BLOCK


class FullFiles(BlockFiles):
    """Block files on a disk that is full while ``full`` is set."""

    def __init__(self, files: BlockFiles) -> None:
        super().__init__(files.directory, files.contract, files.block_nbytes)
        self.set_full(True)

    def set_full(self, full: bool) -> None:
        object.__setattr__(self, "full", full)  # BlockFiles is frozen

    def _write_temp(self, block_hash, payload):
        if self.full:
            raise OSError(errno.ENOSPC, FULL)
        return super()._write_temp(block_hash, payload)


@pytest.fixture
def errors(caplog):
    caplog.set_level(logging.ERROR, logger="services.store.disk")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "services.store.disk"]


def first_line(number: int) -> str:
    return (f"could not write block {h(number).hex()} to disk: [Errno {errno.ENOSPC}] {FULL} "
            "(further failures for 3600s are summed up in one line)")  # fmt: skip


def summary(num_blocks: int) -> str:
    return (f"could not write {num_blocks} blocks ({num_blocks * FILE_NBYTES} bytes) to disk; "
            f"the first error: [Errno {errno.ENOSPC}] {FULL}")  # fmt: skip


async def full_store(make_store, slots: int):
    store = make_store(slots=slots, disk_blocks=64)
    await store.start()
    store.disk.files = FullFiles(store.disk.files)
    store.disk.write_failures.summary_after_s = 3600.0  # no test waits on it but the one that shortens it
    return store


async def test_a_flush_to_a_full_disk_logs_the_first_failure_and_one_summary_at_close(make_store, errors):
    store = await full_store(make_store, slots=40)
    store.flush_batch = 8  # five batches, as a flush of many blocks makes
    await put(store, list(range(1, 41)))
    assert await store.flush() == 0
    assert errors() == [first_line(1)]
    store.disk.close()
    assert errors() == [first_line(1), summary(40)]


async def test_a_write_that_lands_again_ends_the_run_with_its_summary(make_store, errors):
    store = await full_store(make_store, slots=2)
    await put(store, [1, 2])
    for i in (3, 4, 5):  # each evicts a block not yet written behind: written on its way out, and fails
        await put(store, [i])
    assert errors() == [first_line(1)]
    store.disk.files.set_full(False)
    assert await store.flush() == 2  # 4 and 5 land
    assert errors() == [first_line(1), summary(3)]
    store.disk.close()
    assert errors() == [first_line(1), summary(3)]  # nothing more to sum up


async def test_a_long_run_is_summed_up_after_its_time(make_store, errors):
    store = await full_store(make_store, slots=4)
    store.disk.write_failures.summary_after_s = 0.01
    await put(store, [1, 2, 3, 4])
    assert await store.flush() == 0
    await wait_until_async(lambda: len(errors()) == 2, 10.0, "no summary")
    assert errors()[1] == summary(4)
