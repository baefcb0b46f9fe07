"""The README's metrics table and the code agree: every metric the code declares is in
the table, and the table names no metric the code does not declare."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def declared() -> set[str]:
    names = set()
    for folder in ("libs", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r'"(kvserve_[a-z0-9_]+)"', path.read_text()))
    return names


def documented() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Metrics") :]
    section = section[: section.index("\n### ")]
    rows = [line for line in section.splitlines() if line.startswith("| `kvserve_")]
    return {name for row in rows for name in re.findall(r"`(kvserve_[a-z0-9_]+)`", row.split(" | ")[0])}


def test_every_declared_metric_is_in_the_readme_table_and_only_those():
    code, readme = declared(), documented()
    assert "kvserve_time_to_first_token_seconds" in code and "kvserve_store_blocks" in readme
    assert not code - readme, f"declared but not in the README's metrics table: {sorted(code - readme)}"
    assert not readme - code, f"in the README's metrics table but declared nowhere: {sorted(readme - code)}"
