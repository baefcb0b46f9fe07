"""``kvserve status``: the console's cluster view on one terminal screen, from the
gateway's ``/console/api/state`` (instances with their load, KV usage and tiers;
the last routing decisions; SLO attainment and latency over the last minutes;
each tenant's use: every tenant's to an admin's key, its own to any other).
``--watch`` redraws it every few seconds."""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

from kvserve.cli.options import positive_float, read_api_key_file
from libs.protocol.errors import KVServeError
from libs.protocol.vocabulary import Role

STATE_PATH = "/console/api/state"
MAX_DECISIONS = 8

DESCRIPTION = """\
Show the cluster on one screen, as the gateway's live console sees it: every instance,
host by host, with its role, load, KV pool usage, queue or batch and the KV blocks it holds by tier;
SLO attainment, TTFT and TPOT over the last five minutes; the last routing decisions,
predicted and measured; with tenants, each tenant's requests, tokens and refusals
since the gateway started and its SLOs met and missed over the last five minutes
(every tenant for an admin's key: `admin = true` in the tenants file, or the one
--api-key; any other tenant's key sees its own row). Read from the gateway's
/console/api/state."""

EPILOG = """\
examples:
  kvserve status
  kvserve status --url http://10.0.0.5:8000 --api-key-file ~/.kvserve-key --watch"""


class StatusError(KVServeError):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help="the cluster at a glance: instances, KV usage, last routing decisions, SLO attainment",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway's base URL (default http://127.0.0.1:8000)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("KVSERVE_API_KEY") or None, metavar="KEY",
        help="sent as 'Authorization: Bearer KEY' (default: $KVSERVE_API_KEY, else none); a key given here is "
        "visible to every local user in the process list: prefer $KVSERVE_API_KEY or --api-key-file",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", type=read_api_key_file, dest="api_key_file", metavar="PATH",
        help="read the API key from the first line of this file",
    )  # fmt: skip
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    parser.add_argument("--interval", type=positive_float, default=2.0, metavar="SECONDS",
                        help="seconds between two redraws with --watch (default 2)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the state as JSON, as the gateway sent it")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    key = args.api_key_file or args.api_key
    if not args.watch:
        state = fetch_state(args.url, key)
        print(json.dumps(state, indent=2) if args.json else render(state, args.url))
        return 0
    try:
        while True:
            try:
                screen = render(fetch_state(args.url, key), args.url)
            except StatusError as e:
                screen = f"kvserve status: {e} (retrying every {args.interval:g} s)"
            sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")  # home, clear: one screen, redrawn
            sys.stdout.flush()
            time.sleep(args.interval)  # the refresh period the user asked for
    except KeyboardInterrupt:
        return 0


def fetch_state(url: str, api_key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """The gateway's console state; StatusError saying why when there is none."""
    request = urllib.request.Request(url.rstrip("/") + STATE_PATH, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise StatusError(f"the gateway at {url} wants its API key (--api-key-file or $KVSERVE_API_KEY)") from None
        raise StatusError(f"the gateway at {url} answered {e.code}: {_error_message(e)}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot reach the gateway at {url}: {reason}") from None
    except ValueError as e:
        raise StatusError(f"the gateway at {url} sent no console state: {e}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return json.load(e)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return e.reason


# --- the screen ------------------------------------------------------------------------------
def render(state: dict[str, Any], url: str) -> str:
    """One screen of text: the header, SLOs, the instances, the last decisions."""
    g = state["gateway"]
    policies = ", ".join(
        f"{c['instance_id']} ({c['error']})" if c.get("error") else f"{c['instance_id']}: {c['policy']}"
        for c in state["conductors"]
    ) or "no conductor"
    lines = [
        f"kvserve at {url}: {g['model']}, {g['in_flight']} in flight; {policies}",
        _slo_line(state["slo"]),
        "",
        *_table(["INSTANCE", "ROLE", "HOST", "LOAD", "KV USED", "QUEUE/BATCH", "KV BLOCKS BY TIER", "HEARD"],
                [_instance_row(i) for i in sorted(state["instances"], key=_by_host)]),  # fmt: skip
        "",
        "LAST DECISIONS" if state["decisions"] else "LAST DECISIONS: none yet",
        *_table(["TIME", "REQUEST", "ROUTE", "PREDICTED", "ACTUAL", "REUSE"],
                [_decision_row(d) for d in state["decisions"][:MAX_DECISIONS]]),  # fmt: skip
    ]
    if tenants := state.get("tenants"):
        minutes = f"{state['slo']['window_s'] / 60:g} min"
        lines += ["", f"TENANTS (since the gateway started; SLO over the last {minutes})",
                  *_table(["TENANT", "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "REFUSED", "SLO MET", "MISSED"],
                          [_tenant_row(t) for t in tenants])]  # fmt: skip
    return "\n".join(lines)


def _tenant_row(t: dict[str, Any]) -> list[str]:
    refused = ", ".join(f"{reason} {n}" for reason, n in sorted(t["refusals"].items())) or "-"
    met, missed = ("-" if v is None else str(v) for v in (t["slo_met"], t["slo_missed"]))
    return [t["tenant"], str(t["requests"]), str(t["prompt_tokens"]), str(t["cached_tokens"]),
            str(t["completion_tokens"]), refused, met, missed]  # fmt: skip


def _slo_line(slo: dict[str, Any]) -> str:
    minutes = f"{slo['window_s'] / 60:g} min"
    if not slo["requests"]:
        return f"no request served in the last {minutes}"
    if slo["attainment"] is None:
        attained = "SLO targets unknown (no conductor answered)"
    else:
        attained = (f"SLO attained {_pct(slo['attainment'])} ({slo['met']} of {slo['requests']}; TTFT <= "
                    f"{_ms(slo['ttft_s'])}, TPOT <= {_ms(slo['tbt_s'])})")  # fmt: skip
    return (f"last {minutes}: {attained}; TTFT p50 {_ms(slo['ttft_p50_s'])} p90 {_ms(slo['ttft_p90_s'])}; "
            f"TPOT p50 {_ms(slo['tpot_p50_s'])} p90 {_ms(slo['tpot_p90_s'])}; cache hit {_pct(slo['cache_hit'])}")  # fmt: skip


def _by_host(i: dict[str, Any]) -> tuple[str, str]:
    return i["host_id"], i["instance_id"]


def _instance_row(i: dict[str, Any]) -> list[str]:
    kv = "-" if i["kv_usage"] is None else f"{_pct(i['kv_usage'])} of {i['kv_capacity_blocks']}"
    work_of = {Role.PREFILL: f"{i['queued_tokens']} tok queued", Role.DECODE: f"batch {i['batch_size']}"}
    work = work_of.get(i["role"], "-")
    tiers = ", ".join(f"{t} {n}" for t, n in i["tiers"].items() if n) or "-"
    return [i["instance_id"], i["role"], i["host_id"], str(i["load"]), kv, work, tiers, f"{i['last_heard_s']:.1f}s ago"]


def _decision_row(d: dict[str, Any]) -> list[str]:
    when = datetime.fromtimestamp(d["at"]).strftime("%H:%M:%S")
    route = f"{d['prefill_id']} -> {d['decode_id']}" + (" (prefill on decode)" if d["prefill_on_decode"] else "")
    if d.get("affinity"):
        route += f" [{d['affinity']}]"
    if d["rejected"]:
        return [when, d["request_id"], f"rejected ({d['rejected']})", d["why"] or "", "-", "-"]
    predicted = f"TTFT {_ms(d['predicted_ttft_s'])}, TBT {_ms(d['predicted_tbt_s'])}"
    a = d["actual"]
    actual = "-" if a is None else f"TTFT {_ms(a['ttft_s'])}, {a['cached_tokens']}/{a['prompt_tokens']} cached"
    reuse = ", ".join(f"{t} {n}" for t, n in d["cached_tokens"].items() if n) or "none"
    return [when, d["request_id"], route, predicted, actual, reuse]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"
