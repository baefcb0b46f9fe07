"""Command-line options several kvserve commands share."""

import argparse

from libs.common.model.default_model import DEFAULT_MODEL_ID
from libs.common.settings import QUANTIZATIONS


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
        help="activations, KV and float weights' dtype; auto picks the faster of bfloat16 and float32 here (default)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="weight precision: auto keeps the checkpoint's own (the default model's GGUF: int4-g32) where the "
        "int kernels are fast (CPU, bfloat16/float16 activations) and is none elsewhere (default); int8 (per "
        "channel) and int4 (= int4-g32), int4-g64, int4-g128 (groups of in-features) quantize at load",
    )
