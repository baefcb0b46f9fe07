"""Stopping a cluster stops every service cleanly: each drains and exits 0 on SIGTERM,
none ends in a traceback (an attribute shadowing a service's stop() once did)."""

from tests.integration.conftest import start_cluster


def test_every_service_exits_zero_when_the_cluster_stops(smollm):
    cluster = start_cluster()
    cluster.stop()
    codes = cluster.exit_codes()
    assert {"prefill-0", "decode-0", "conductor-0", "gateway-0"} <= codes.keys()
    assert codes == {instance: 0 for instance in codes}
