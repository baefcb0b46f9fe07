"""The console in a real browser: Playwright drives the system's Chromium (never a
browser Playwright downloads) against a local cluster with an API key. The page
takes the key in its form, then shows a request's routing decision with the
instances that served it, after the same prompt again a non-zero cache hit, and the
key's tenant in the tenants table.
A screenshot is saved under the test's tmp dir. Where no Chromium can be had
(`make test` installs it with apt where it can), that test skips saying so.
`kvserve status` reads the same cluster's state and shows a request's route."""

import re
import shutil
import tempfile

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.cli.status import StatusError, fetch_state, render
from tests.integration.conftest import CLUSTER_ENV, STARTED, wait_until

CHROMIUM = shutil.which("chromium")
KEY = "console-browser-test-key"
WAIT_MS = 30_000  # the longest any one thing may take to appear on the page
PROMPT = ("You are looking at the kvserve console. Explain in one sentence why a prefix cache makes a "
          "repeated prompt faster, and name the two kinds of worker that serve a request.")  # fmt: skip

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(prefill=1, decode=1, gateway_port=0, dtype="float32", env=CLUSTER_ENV, log=None, api_key=KEY,
                     store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"))  # fmt: skip
    STARTED.append(c)
    c.start(timeout=90)
    yield c
    c.stop()


def chat(client):
    """One short greedy completion of PROMPT: (its id, the instances named in its headers, cached tokens)."""
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
    )
    completion = raw.parse()
    served = (raw.headers["x-kvserve-prefill-instance"], raw.headers["x-kvserve-decode-instance"])
    return completion.id, served, completion.usage.prompt_tokens_details.cached_tokens


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (Debian: apt-get install -y chromium)")
def test_the_console_shows_a_requests_decision_and_the_cache_hit_of_its_repeat(cluster, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: pip install -e '.[test]'")
    from openai import OpenAI

    client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key=KEY, max_retries=0)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(cluster.gateway_url + "/console")
            sync_api.expect(page.locator("#key-form")).to_be_visible(timeout=WAIT_MS)  # the data needs the key
            page.fill("#key", KEY)
            page.click("#key-form button")
            sync_api.expect(page.locator("#feed")).to_have_text("live", timeout=WAIT_MS)
            sync_api.expect(page.locator("#key-form")).to_be_hidden()
            sync_api.expect(page.locator("#policy")).to_have_text(re.compile(r"^\w"))  # the conductor's view came

            # while the page watches, so the conductor keeps every candidate of its decisions
            first_id, (prefill_id, decode_id), _ = chat(client)
            repeat_id, _, cached = chat(client)
            assert cached > 0  # the prompt's blocks were cached by the first request

            decision = page.locator(f'#decisions tr[data-request-id="{first_id}"]')
            sync_api.expect(decision.locator("td.prefill")).to_have_text(prefill_id, timeout=WAIT_MS)
            sync_api.expect(decision.locator("td.decode")).to_have_text(decode_id)
            sync_api.expect(decision.locator(".candidates .chosen").first).to_contain_text(prefill_id)
            repeat = page.locator(f'#requests tr[data-request-id="{repeat_id}"]')
            sync_api.expect(repeat.locator("td.cached")).to_have_text(str(cached), timeout=WAIT_MS)
            sync_api.expect(page.locator("#cache-hit")).to_have_text(re.compile(r"^(?!0%)\d+(\.\d)?%$"))
            sync_api.expect(page.locator(f'#instances tr[data-instance="{prefill_id}"]')).to_contain_text("prefill")
            tenant = page.locator('#tenants tr[data-tenant="default"]')  # the one --api-key: an admin's view
            sync_api.expect(tenant.locator("td").nth(1)).to_have_text(re.compile(r"^[1-9]\d*$"), timeout=WAIT_MS)

            shot = tmp_path / "console.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"console screenshot: {shot}")
        finally:
            browser.close()


def test_kvserve_status_shows_the_cluster_and_a_requests_route(cluster):
    from openai import OpenAI

    with pytest.raises(StatusError, match="wants its API key"):
        fetch_state(cluster.gateway_url, None)
    client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key=KEY, max_retries=0)
    request_id, (prefill_id, decode_id), _ = chat(client)
    screens = []

    def shows_the_request() -> bool:  # the gateway asks the conductor for its view at most once a second
        screens.append(render(fetch_state(cluster.gateway_url, KEY), cluster.gateway_url))
        return request_id in screens[-1]

    wait_until(shows_the_request, timeout=WAIT_MS / 1000, interval=0.2)
    screen = screens[-1]
    (route,) = [line for line in screen.splitlines() if request_id in line]
    assert f"{prefill_id} -> {decode_id}" in route
    for instance in ("conductor-0", "store-0", prefill_id, decode_id):
        assert any(line.startswith(instance + " ") for line in screen.splitlines()), instance
