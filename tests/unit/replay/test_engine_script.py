"""bench/engine.py's options that end before anything is measured."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gguf_rows_without_llama_cpp_are_refused_not_written_half():
    # --gguf's rows are kvserve against llama.cpp on one file: --skip-llama would leave no comparison
    out = subprocess.run([sys.executable, "bench/engine.py", "--gguf", "Q4_K_M", "--skip-llama", "--out", "/dev/null"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--skip-llama cannot apply" in out.stderr
