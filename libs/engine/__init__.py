"""The inference engine: the model and its forward pass (``model/``), the host that runs
it beside a service's event loop, the KV contract a worker offers, the calibrated cost
model, and the engine's token output and metrics."""
