"""A discrete-event simulator of a kvserve cluster, for cluster sizes and traces
this machine cannot run: a Mooncake-format trace is replayed through the live
conductor's own Admitter, policies, KV index and cost model, against simulated
prefill, decode and store instances whose timings come from a cost model."""
