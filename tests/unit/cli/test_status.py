"""``kvserve status`` against a fake gateway that serves a console state built by
the gateway's own `console_state`: the screen it prints, the API key it sends,
and the errors it gives when the gateway refuses or is not there."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvserve.cli.main import main
from kvserve.cli.status import StatusError, fetch_state, render
from libs.protocol.schema import CandidateView, ConductorViewReply, DecisionView, DecodeBeat, Heartbeat, PrefillBeat
from services.gateway.console_data import Served, console_state
from services.gateway.tenant_usage import UsageTotals

KEY = "status-test-key"
NOW = 1_800_000_000.0


def state(**tenants) -> dict:
    decisions = [
        DecisionView(request_id="req-2", at=NOW - 1, policy="cache_aware", prefill_id="prefill-0", decode_id="decode-0",
                     rejected="ttft_slo", why="predicted TTFT 3.100 s on prefill-0 (queue 2.900 s) exceeds the 2.000 s target"),
        DecisionView(request_id="req-1", at=NOW - 2, policy="cache_aware", prefill_id="prefill-0", decode_id="decode-0",
                     predicted_ttft_s=0.25, predicted_tbt_s=0.06, cached_tokens={"device": 48, "dram": 0},
                     candidates=[CandidateView(instance_id="prefill-0", role="prefill", predicted_ttft_s=0.25)]),
    ]  # fmt: skip
    view = ConductorViewReply(instance_id="conductor-0", policy="cache_aware", slo_ttft_s=2.0, slo_tbt_s=0.15,
                              blocks={"prefill-0": {"device": 7}}, decisions=decisions)  # fmt: skip
    heard = [
        (Heartbeat(instance_id="prefill-0", role="prefill", host_id="host-b",
                   payload=PrefillBeat(load=1, capacity=200, free_blocks=150, queued_tokens=512)), 0.3),
        (Heartbeat(instance_id="decode-0", role="decode", host_id="host-a",
                   payload=DecodeBeat(load=2, capacity=100, free_blocks=90, batch_size=2)), 0.4),
    ]  # fmt: skip
    served = [
        Served(request_id="req-0", at=NOW - 30, prefill_id="prefill-0", decode_id="decode-0", num_prompt_tokens=64,
               num_cached_tokens=0, num_completion_tokens=8, ttft_s=3.0, tpot_s=0.05, finish_reason="stop"),
        Served(request_id="req-1", at=NOW - 1, prefill_id="prefill-0", decode_id="decode-0", num_prompt_tokens=64,
               num_cached_tokens=48, num_completion_tokens=8, ttft_s=0.2, tpot_s=0.05, finish_reason="stop",
               tenant="alice"),
    ]  # fmt: skip
    gateway = {"instance_id": "gateway-0", "model": "tiny", "in_flight": 3, "uptime_s": 60.0}
    state = console_state(gateway, heard, [view], [], served, NOW, **tenants)
    return json.loads(json.dumps(state))  # as it crosses HTTP


def test_the_screen_shows_instances_slo_and_decisions():
    screen = render(state(), "http://gw:8000")
    lines = screen.splitlines()
    assert lines[0] == "kvserve at http://gw:8000: tiny, 3 in flight; conductor-0: cache_aware"
    assert lines[1] == ("last 5 min: SLO attained 50.0% (1 of 2; TTFT <= 2.00 s, TPOT <= 150 ms); TTFT p50 200 ms "
                        "p90 3.00 s; TPOT p50 50 ms p90 50 ms; cache hit 37.5%")  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("prefill-0 ", "decode-0 "))}
    assert rows["prefill-0"][:7] == ["prefill-0", "prefill", "host-b", "1", "25.0%", "of", "200"]
    assert list(rows) == ["decode-0", "prefill-0"]  # host by host
    assert "512 tok queued" in screen and "device 7" in screen and "batch 2" in screen
    (accepted,) = [line for line in lines if "req-1" in line]
    assert "prefill-0 -> decode-0" in accepted and "TTFT 250 ms, TBT 60 ms" in accepted
    assert "TTFT 200 ms, 48/64 cached" in accepted and accepted.endswith("device 48")
    (rejected,) = [line for line in lines if "req-2" in line]
    assert "rejected (ttft_slo)" in rejected and "exceeds the 2.000 s target" in rejected


def test_the_screen_shows_a_table_of_the_tenants_it_is_given_and_none_without():
    usage = {"alice": UsageTotals(1, 64, 48, 8, {}),
             "bob": UsageTotals(0, 0, 0, 0, {"requests_per_minute": 2, "fair_share": 1})}  # fmt: skip
    lines = render(state(usage=usage), "http://gw:8000").splitlines()
    at = lines.index("TENANTS (since the gateway started; SLO over the last 5 min)")
    assert lines[at + 1].split() == ["TENANT", "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "REFUSED", "SLO", "MET",
                                     "MISSED"]  # fmt: skip
    assert lines[at + 2].split() == ["alice", "1", "64", "48", "8", "-", "1", "0"]
    assert lines[at + 3].split() == ["bob", "0", "0", "0", "0", "fair_share", "1,", "requests_per_minute", "2", "0",
                                     "0"]  # fmt: skip
    assert len(lines) == at + 4
    untenanted = state()
    for tenants in ([], None):  # no tenant served yet; a gateway from before tenants
        untenanted["tenants"] = tenants
        if tenants is None:
            del untenanted["tenants"]
        assert not any(line.startswith("TENANTS") for line in render(untenanted, "http://gw:8000").splitlines())


class FakeGateway(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._send(401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                       "param": None, "code": "invalid_api_key"}})  # fmt: skip
        else:
            self._send(200, state())

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGateway)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_status_reads_the_key_from_its_file_and_prints_one_screen(gateway, tmp_path, capsys, monkeypatch):
    server, url = gateway
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert main(["status", "--url", url, "--api-key-file", str(key_file)]) == 0
    assert capsys.readouterr().out.startswith(f"kvserve at {url}: tiny, 3 in flight")
    assert server.seen == [("/console/api/state", f"Bearer {KEY}")]
    monkeypatch.setenv("KVSERVE_API_KEY", KEY)  # or from the environment, as every kvserve command
    assert main(["status", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gateway"]["instance_id"] == "gateway-0"


def test_a_refused_key_and_an_absent_gateway_are_one_clear_line(gateway, capsys, monkeypatch):
    server, url = gateway
    with pytest.raises(StatusError, match="wants its API key"):
        fetch_state(url, "wrong")
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    assert main(["status", "--url", url]) == 1
    assert "kvserve: error: the gateway at" in capsys.readouterr().err
    server.shutdown()
    server.server_close()
    with pytest.raises(StatusError, match="cannot reach the gateway"):
        fetch_state(url, KEY)
