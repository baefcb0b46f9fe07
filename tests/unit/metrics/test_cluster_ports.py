"""`kvserve up --metrics-port`: each service of a local cluster gets a port of its own,
in a fixed order, so a Prometheus on the same host can list them."""

import argparse

from kvserve.cli import up
from kvserve.cli.cluster import LocalCluster


def test_each_instance_gets_its_own_port_from_the_first_up():
    cluster = LocalCluster(prefill=2, decode=1, metrics_port=9400, log=None)
    assert cluster.metrics_ports() == {"conductor-0": 9400, "store-0": 9401, "prefill-0": 9402, "prefill-1": 9403,
                                       "decode-0": 9404, "gateway-0": 9405}  # fmt: skip
    assert LocalCluster(log=None).metrics_ports() == {}  # none asked: none served


def test_kvserve_up_takes_the_first_port():
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    assert parser.parse_args(["up", "--metrics-port", "9500"]).metrics_port == 9500
    assert parser.parse_args(["up"]).metrics_port is None
