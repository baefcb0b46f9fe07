"""A warm spare's handshake (libs/common/standby.py): it loads first, says so, and takes
the environment the launcher sends as its own; anything else is refused or ends it."""

import json
import subprocess
import sys

import pytest

from libs.common import standby
from libs.common.standby import AssignmentError, parse_assignment

SPARE = """
import os, sys
from libs.common import standby
standby.wait_for_assignment(lambda: print("preloaded", flush=True))
print("instance", os.environ.get("KVSERVE_INSTANCE_ID"), os.environ.get(standby.STANDBY_ENV), flush=True)
"""


def start_spare(root) -> subprocess.Popen:
    env = {"PYTHONPATH": str(root), standby.STANDBY_ENV: "1", "KVSERVE_INSTANCE_ID": "decode-spare"}
    return subprocess.Popen([sys.executable, "-c", SPARE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_an_assignment_is_an_object_of_strings_and_not_another_spare():
    assert parse_assignment('{"KVSERVE_INSTANCE_ID": "decode-0"}\n') == {"KVSERVE_INSTANCE_ID": "decode-0"}
    for bad in ("not json", "[1, 2]", '{"A": 1}', json.dumps({standby.STANDBY_ENV: "1"})):
        with pytest.raises(AssignmentError):
            parse_assignment(bad)


def test_a_spare_preloads_then_becomes_the_instance_it_is_sent(pytestconfig):
    spare = start_spare(pytestconfig.rootpath)
    assert spare.stdout.readline() == "preloaded\n"
    assert spare.stdout.readline() == standby.READY_LINE + "\n"
    out, _ = spare.communicate(json.dumps({"KVSERVE_INSTANCE_ID": "decode-0", "PATH": "/usr/bin"}) + "\n", timeout=30)
    assert out == "instance decode-0 None\n"  # the whole environment replaced: no longer a spare
    assert spare.returncode == 0


def test_a_spare_that_is_never_needed_exits_cleanly_and_a_bad_assignment_exits_2(pytestconfig):
    unneeded = start_spare(pytestconfig.rootpath)
    out, _ = unneeded.communicate("", timeout=30)  # end of input
    assert (unneeded.returncode, "instance" in out) == (0, False)
    garbled = start_spare(pytestconfig.rootpath)
    out, err = garbled.communicate("[1]\n", timeout=30)
    assert garbled.returncode == 2 and "bad assignment" in err and "instance" not in out
