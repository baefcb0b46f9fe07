"""Dense weights in oneDNN's own layout against plain tensors, side by side in one
process, on the default model with bfloat16 activations:

- int4 weights (the default): prefill tokens/s and decode steps of batches past the
  quantized kernels' rows, where every projection and the LM head multiply by their
  weight dequantized (libs/engine/model/dense.py, ``DenseWeight``);
- ``--float``: the model loaded float (``--quantization none``), every projection and the
  LM head a ``PackedLinear`` against the plain weights (``LlamaModel.pack_float_weights``
  skipped): two copies of the model in the process, each with its own engine; decode
  batches of 1 and 8 run the fused step, larger ones the modules.

    .venv/bin/python bench/dense_weights.py [--float] [--prefill 512,2048] [--batches 16,32,64] [--reps 5] [--out FILE]

The two ways alternate repetition by repetition (int4: each layer's dense weight is made
afresh for its way, outside the timing); each row is the median. The outputs of the
two ways are compared: the same logits to the bit is what the packed layout promises.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER_CHUNK = 256  # services/prefill/settings.py's default step
DECODE_CONTEXT = 300  # each decoding sequence's prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--float", action="store_true", help="float weights: PackedLinear against the plain weights")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--batches", default=None, help="decode batches (default 16,32,64; with --float 1,8,32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from libs.engine.model import dense, quant, steps
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    if dense._ONEDNN is None:
        print("this torch has no oneDNN linear: nothing to compare")
        return 1
    onednn = dense._ONEDNN
    batches = [int(b) for b in (args.batches or ("1,8,32" if args.float else "16,32,64")).split(",") if b]
    lengths = [int(n) for n in args.prefill.split(",") if n]
    # the blocks of the longest prompt, or of both ways' decoding batches at once
    blocks = max(max(lengths + [0]) // 16, 2 * max(batches + [0]) * (DECODE_CONTEXT // 16 + 2)) + 64
    config = EngineConfig(num_blocks=blocks, max_chunk_tokens=WORKER_CHUNK, enable_prefix_cache=False)
    if args.float:
        from libs.engine.model.llama import LlamaModel

        packed = load_model(None, dtype="bfloat16", quantization="none", progress=False)
        pack = LlamaModel.pack_float_weights
        LlamaModel.pack_float_weights = lambda self: None  # the plain copy
        plain = load_model(None, dtype="bfloat16", quantization="none", progress=False)
        LlamaModel.pack_float_weights = pack
        engines = {"plain": build_engine(plain, config), "packed": build_engine(packed, config)}

        def use(way: str):
            return engines[way]
    else:
        loaded = load_model(None, dtype="bfloat16", progress=False)
        layers = [m for m in loaded.model.modules() if isinstance(m, (quant.Int4Linear, quant.Int8Linear))]
        engine = build_engine(loaded, config)

        def use(way: str):
            dense._ONEDNN = onednn if way == "packed" else None
            for layer in layers:
                layer._dense = None
            for layer in layers:  # made now, outside the timing
                layer.dense(torch.bfloat16)
            return engine

    ways = ("plain", "packed")
    rows = []
    for n in lengths:
        ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        times, logits = {w: [] for w in ways}, {}
        for rep in range(args.reps + 1):
            for way in ways:
                engine = use(way)
                seq = Sequence.from_prompt(f"{way}-{n}-{rep}", ids)
                start = time.perf_counter()
                logits[way] = steps.prefill(engine, [seq])
                elapsed = time.perf_counter() - start
                engine.cache.free(seq)
                if rep:  # the first repetition warms up
                    times[way].append(n / elapsed)
        same = torch.equal(logits["plain"], logits["packed"])
        rates = [statistics.median(times[w]) for w in ways]
        rows.append((f"prefill {n} (steps of {WORKER_CHUNK})", "tokens/s", *rates, same))
        print(rows[-1], flush=True)
    for batch in batches:
        seeds = [torch.Generator().manual_seed(batch * 1000 + i) for i in range(batch)]
        prompts = [torch.randint(100, 40000, (DECODE_CONTEXT,), generator=g).tolist() for g in seeds]
        times, batches_of = {w: [] for w in ways}, {}
        for way in ways:
            engine = use(way)
            seqs = [Sequence.from_prompt(f"{way}-b{batch}-{i}", p) for i, p in enumerate(prompts)]
            steps.prefill(engine, seqs)
            for seq in seqs:
                seq.append_token(1)
            batches_of[way] = seqs
        outs = {}
        for rep in range(args.reps + 1):
            for way in ways:
                engine = use(way)
                start = time.perf_counter()
                outs[way] = steps.decode(engine, batches_of[way])
                elapsed = time.perf_counter() - start
                if rep:
                    times[way].append(batch / elapsed)
                for seq in batches_of[way]:
                    seq.append_token(1)
        for way in ways:
            for seq in batches_of[way]:
                use(way).cache.free(seq)
        same = torch.equal(outs["plain"], outs["packed"])
        rows.append((f"decode, batch {batch}", "tokens/s", *(statistics.median(times[w]) for w in ways), same))
        print(rows[-1], flush=True)
    dense._ONEDNN = onednn
    weights = "float weights (PackedLinear)" if args.float else "int4 weights (their dense copies)"
    lines = [
        "",
        f"### Dense weights packed for oneDNN vs plain ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- command: `python bench/dense_weights.py {' '.join(sys.argv[1:])}`",
        f"- {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; the default model, "
        f"{weights}, bfloat16; decode: every sequence {DECODE_CONTEXT} tokens of prompt; median of {args.reps}",
        "",
        "| step | unit | plain | packed | packed / plain | same logits |",
        "|---|---|---|---|---|---|",
    ]
    for step, unit, plain, packed, same in rows:
        lines.append(f"| {step} | {unit} | {plain:.1f} | {packed:.1f} | {packed / plain:.3f}x | "
                     f"{'yes' if same else 'NO'} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
