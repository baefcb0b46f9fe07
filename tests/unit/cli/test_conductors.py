"""`kvserve up --conductors N`: N conductor replicas, each its own instance."""

import pytest

from kvserve.cli import up
from kvserve.cli.cluster import LocalCluster
from kvserve.cli.main import build_parser
from libs.protocol.vocabulary import Role


def test_up_conductors_starts_that_many_replicas(monkeypatch):
    started = []
    monkeypatch.setattr(up, "serve", lambda cluster, timeout: started.append(cluster) or 0)
    args = build_parser().parse_args(["up", "--conductors", "2", "--dtype", "float32"])
    assert args.run(args) == 0
    assert started[0].counts[Role.CONDUCTOR] == 2
    args = build_parser().parse_args(["up", "--dtype", "float32"])
    args.run(args)
    assert started[1].counts[Role.CONDUCTOR] == 1


def test_a_cluster_needs_a_conductor():
    with pytest.raises(ValueError, match="at least one conductor"):
        LocalCluster(conductors=0, log=None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--conductors", "0"])
