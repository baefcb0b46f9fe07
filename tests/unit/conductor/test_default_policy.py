"""The default policy is the one the README documents."""

import re
from pathlib import Path

from services.conductor.admission_policy import build_policy
from services.conductor.settings import DEFAULT_POLICY, ConductorSettings

README = Path(__file__).resolve().parents[3] / "README.md"


def test_the_default_policy_is_what_the_readme_says():
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `KVSERVE_INSTANCE_TIMEOUT`, `KVSERVE_POLICY`"))
    assert re.search(r"\| 3 s, `([^`]+)`", row).group(1) == DEFAULT_POLICY
    assert f"`{DEFAULT_POLICY}` is the default" in text
    settings = ConductorSettings(role="conductor", nats_url="nats://127.0.0.1:4222", instance_id="c", host_id="h")
    assert settings.policy == DEFAULT_POLICY
    assert build_policy(DEFAULT_POLICY).name == "cache_aware+predictive_rejection"
