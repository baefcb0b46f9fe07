"""Trace replay: Mooncake-format traces in, client-side latencies and goodput out.

``trace`` reads the trace, ``prompts`` turns its hash ids into token ids,
``client`` replays it open-loop against any OpenAI-compatible endpoint into
``records``, ``metrics`` reduces records to percentiles, SLO attainment and
goodput, ``report`` and ``plots`` write them down; ``sweep`` runs a window at
several loads, and ``capacity`` searches the load for the highest one that still
meets the SLOs. Nothing here knows kvserve's services: the same code measures
llama.cpp's server.
"""
