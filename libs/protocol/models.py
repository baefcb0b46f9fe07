"""The names models are served under."""

from pathlib import Path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def model_name(spec: str | None) -> str:
    """The name a model spec (KVSERVE_MODEL: None, the default's id, a folder or a
    .gguf file) is served under: the gateway's model id."""
    if spec is None or spec == DEFAULT_MODEL_ID:
        return DEFAULT_MODEL_ID
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name
