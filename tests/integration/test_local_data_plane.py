"""A cluster on one host moves KV through shared memory only: after a request's
hand-off and its write-back to the store, no worker and no store listens on a port."""

from tests.integration.conftest import metric_value, metrics_of, wait_until
from tests.unit.transfer.proc_net import listening_ports

MODEL = "SmolLM2-135M-Instruct"


def shm_transfers(cluster, instance_id: str) -> float:
    return metric_value(metrics_of(cluster, instance_id), "kvserve_transfers_total", transport="shm")


def test_workers_and_store_on_one_host_open_no_transfer_listener(cluster, openai_client):
    messages = [{"role": "user", "content": "Say something about rivers, in two sentences."}]
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.content
    # the hand-off to the decode worker, then the prompt's full blocks written back to the store
    wait_until(lambda: shm_transfers(cluster, "prefill-0") >= 2, timeout=60)
    data_plane = {i: pid for i, pid in cluster.pids.items() if i.split("-")[0] in ("prefill", "decode", "store")}
    assert {i.split("-")[0] for i in data_plane} == {"prefill", "decode", "store"}
    assert {i: listening_ports(pid) for i, pid in data_plane.items()} == {i: set() for i in data_plane}
