"""`kvserve up --prefill 0` live: no prefill worker, one decode worker on every core
prefilling its own requests under a policy without +local_prefill (the conductor never
heard from a prefill worker), streaming the
one-process engine's answer token for token."""

import json
import urllib.request

from libs.common.cpu_share import available_cpus
from tests.integration.conftest import CALIBRATED, start_cluster, wait_until
from tests.integration.test_gateway_http import get
from tests.integration.test_one_request import MODEL, reference


def test_a_cluster_with_no_prefill_worker_streams_a_chat_completion(smollm):
    cluster = start_cluster(prefill=0, env={"KVSERVE_POLICY": "cache_aware+predictive_rejection", **CALIBRATED})
    try:
        assert {beat.role for beat in cluster.instances.values()} == {"conductor", "store", "decode", "gateway"}
        assert cluster.cpu_plan["decode-0"].cpus == tuple(sorted(available_cpus()))  # every core
        # ready with no prefill instance: the conductor says it prefills on decode workers
        wait_until(lambda: get(cluster.gateway_url + "/health/ready")[0] == 200, 30.0)
        messages = [{"role": "user", "content": "Name three things that are red."}]
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
                           "stream": True}).encode()  # fmt: skip
        request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        pieces = []
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.headers["x-kvserve-prefill-on-decode"] == "1"
            assert response.headers["x-kvserve-prefill-instance"] == response.headers["x-kvserve-decode-instance"]
            for line in response:
                data = line.decode().strip().removeprefix("data: ")
                if not line.startswith(b"data: ") or data == "[DONE]":
                    continue
                pieces += [choice["delta"].get("content") or "" for choice in json.loads(data)["choices"]]
        assert len([p for p in pieces if p]) > 3  # it streamed, not one lump
        assert "".join(pieces) == reference(smollm, messages, 24)
    finally:
        cluster.stop()
