import json
from pathlib import Path

import pytest

from tests.unit.cli.harness import TINY_CONFIG


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder
