"""A process that serves a model keeps a bounded number of oneDNN matmul primitives:
a bf16 matmul of each new row count (a prefill step's token count) must not add
memory that stays for the life of the process (libs/engine/primitive_caches.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libs.engine import engine_host
from libs.engine.primitive_caches import VARIABLES, bound_primitive_caches

ROOT = Path(__file__).resolve().parents[3]

# In a fresh process (each cache reads its capacity once): bf16 matmuls of a Llama
# layer's four weight shapes (SmolLM2-135M's) at 100 row counts, as 100 prefill steps
# of different token counts make; prints the resident memory they added, in MB.
MATMULS = """
import ctypes, gc, os, sys
import torch
{setup}
torch.set_num_threads(1)

def rss_mb():
    for line in open(f"/proc/{{os.getpid()}}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

weights = [torch.randn(k, n, dtype=torch.bfloat16) for k, n in ((576, 960), (576, 576), (576, 3072), (1536, 576))]
rows = {{w.shape[0]: torch.randn(256, w.shape[0], dtype=torch.bfloat16) for w in weights}}
for w in weights:
    rows[w.shape[0]][:8] @ w
before = rss_mb()
for m in range(9, 109):
    for w in weights:
        rows[w.shape[0]][:m] @ w
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(rss_mb() - before)
"""


def _grown_mb(setup: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run([sys.executable, "-c", MATMULS.format(setup=setup)], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout  # fmt: skip
    return float(out.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN bf16 matmuls on Linux only")  # fmt: skip
def test_new_row_counts_do_not_keep_memory():
    grown = _grown_mb("from libs.engine.primitive_caches import bound_primitive_caches; bound_primitive_caches()")
    # unbounded (1024 entries in each cache): ~2.6 MB a row count, ~260 MB here; bounded: ~40 MB
    assert grown < 100, f"100 new row counts kept {grown:.0f} MB"


def test_an_explicit_capacity_is_kept(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    bound_primitive_caches(64)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"


def test_a_worker_bounds_the_caches_before_loading_its_model(monkeypatch):
    """A warm spare's preload and a worker's engine host both bound the caches first:
    loading may run a matmul (resolve_dtype times one), and each cache reads its
    capacity at its first use."""
    order = []
    monkeypatch.setattr(engine_host, "bound_primitive_caches", lambda: order.append("bound"))
    monkeypatch.setattr(engine_host, "load_model", lambda *a, **k: order.append("load"))
    settings = engine_host.ModelSettings(model=None, device="cpu", dtype="auto", block_size=16, num_blocks=8,
                                         max_model_len=None)  # fmt: skip
    engine_host.preload_model(settings)
    engine_host._preloaded.clear()
    assert order == ["bound", "load"]
