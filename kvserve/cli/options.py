"""Command-line options and argument types several kvserve commands share."""

import argparse
from pathlib import Path

from libs.common.settings import QUANTIZATIONS
from libs.protocol.models import DEFAULT_MODEL_ID


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


def read_api_key_file(path: str) -> str:
    """An argparse type: the API key on the first line of the file at ``path``."""
    try:
        key = Path(path).read_text().splitlines()[0].strip() if Path(path).stat().st_size else ""
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read the API key file: {e.strerror}") from None
    if not key:
        raise argparse.ArgumentTypeError(f"{path} holds no API key")
    return key


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free one) included."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    value = _number(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a share of requests, in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share of requests in (0, 1], e.g. 0.9; got {text}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
