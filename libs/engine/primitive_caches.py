"""Bounds on the caches that keep oneDNN's compiled matmuls, in a process that serves a model.

A bf16 (or fp16) matmul on the CPU runs a oneDNN primitive built for its exact shape,
and two caches keep every primitive built: oneDNN's own, per process
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), and ideep's, per thread (``LRU_CACHE_CAPACITY``),
1024 entries each by default. A prefill-sized batch multiplies by a layer's dense
weight (quant.py) with as many rows as the step computes tokens, so each new token
count in a step adds an entry per weight shape (four in a Llama layer) to both, about
0.3 MB each: 2.6 MB a new count, and up to ~650 MB for the 248 counts a 256-token
chunk can have. A steady load stops bringing new counts after a few minutes; each
restart of a decode worker brings a few (failed hand-offs, requests moved with the
tokens they had, prompts of new lengths), which is how the prefill worker grew about
3 MB a restart and never gave it back (bench/results/soak.md).

Bounded, a count that is no longer cached costs building its primitives again: about
0.3 ms per weight shape, once per step (the layers share them), under 1% of a step.
"""

import os

CACHE_CAPACITY = 64  # entries in each cache: 16 token counts of a Llama layer's 4 weight shapes
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_primitive_caches(capacity: int = CACHE_CAPACITY) -> None:
    """Bound both caches to ``capacity`` entries, unless the environment already sets
    them. Call it before the process's first matmul: each cache reads its capacity once,
    when it is first used (ideep's: in each thread, at that thread's first matmul)."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(capacity))
