"""Command-line options several kvserve commands share."""

import argparse

from libs.common.model.default_model import DEFAULT_MODEL_ID


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL_ID,
        help=f"HF checkpoint folder, .gguf file, or {DEFAULT_MODEL_ID} (default, prepared on first use)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype; auto picks the faster of bfloat16 and float32 here (default)",
    )
