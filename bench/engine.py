"""The engine against Hugging Face transformers, side by side in one run.

For each dtype: prefill tokens/s at 512 and 2,048 tokens (one forward each),
decode tokens/s at batch 1, 8 and 32 (64 new tokens, `generate` for transformers,
the continuous-batching generator for kvserve), and the floor: the model's
weight bytes over this machine's memory-copy bandwidth, per decode step.
Repetitions alternate between the two so that machine noise hits both.

    python bench/engine.py [--device cpu] [--dtypes float32,bfloat16] [--out bench/results/engine.md]
"""

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libs.common.model.engine import EngineConfig  # noqa: E402
from libs.common.model.generator import Generator  # noqa: E402
from libs.common.model.loader import build_engine, load_model  # noqa: E402
from libs.common.model.sequence import Sequence  # noqa: E402
from libs.common.sampling_params import SamplingParams  # noqa: E402

PREFILL_LENGTHS = (512, 2048)
BATCHES = (1, 8, 32)
NEW_TOKENS = 64
DECODE_PROMPT = 128  # tokens per decode prompt (each a little different in length)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB tensor copy into a preallocated tensor (best of 5)."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ours_prefill(engine, n: int, rep: int) -> float:
    seq = Sequence.from_prompt(f"p{rep}", random_prompt(n, rep))
    sync(engine.device)
    start = time.perf_counter()
    engine.prefill([seq])
    sync(engine.device)
    elapsed = time.perf_counter() - start
    engine.cache.free(seq)
    return n / elapsed


def hf_prefill(model, n: int, rep: int, device) -> float:
    ids = torch.tensor([random_prompt(n, rep)], device=device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, use_cache=True)
    sync(device)
    return n / (time.perf_counter() - start)


def decode_prompts(batch: int) -> list[list[int]]:
    return [random_prompt(DECODE_PROMPT + 3 * i, 1000 + i) for i in range(batch)]


def ours_decode(loaded, batch: int) -> float:
    engine = build_engine(loaded, EngineConfig(num_blocks=batch * 16 + 64, enable_prefix_cache=False))
    generator = Generator(engine, loaded.tokenizer, max_batch_size=batch)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for prompt in decode_prompts(batch):
        generator.add_request(prompt, params)
    generator.step()  # the prefill of every request, and each one's first token
    sync(engine.device)
    start = time.perf_counter()
    steps = 0
    while generator.has_work:
        generator.step()
        steps += 1
    sync(engine.device)
    return batch * steps / (time.perf_counter() - start)


def hf_decode(model, batch: int, device) -> float:
    prompts = decode_prompts(batch)
    width = max(len(p) for p in prompts)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def generate(new: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)  # fmt: skip
        sync(device)
        return time.perf_counter() - start

    prefill = generate(1)
    total = generate(NEW_TOKENS)
    return batch * (NEW_TOKENS - 1) / (total - prefill)


def run_dtype(dtype: str, device: str, reps: int) -> dict:
    from transformers import LlamaForCausalLM

    loaded = load_model(None, device=device, dtype=dtype, progress=False)
    dev = loaded.device
    hf = LlamaForCausalLM.from_pretrained(str(loaded.checkpoint.path), dtype=loaded.dtype).to(dev).eval()
    engine = build_engine(loaded, EngineConfig(num_blocks=256, max_chunk_tokens=2048, enable_prefix_cache=False))
    result: dict = {"prefill": {}, "decode": {}}
    for n in PREFILL_LENGTHS:
        ours_prefill(engine, n, 99), hf_prefill(hf, n, 99, dev)  # warm-up
        ours, theirs = [], []
        for rep in range(reps):
            ours.append(ours_prefill(engine, n, rep))
            theirs.append(hf_prefill(hf, n, rep, dev))
        result["prefill"][n] = (statistics.median(ours), statistics.median(theirs))
        print(f"  {dtype} prefill {n}: kvserve {result['prefill'][n][0]:.0f} tok/s, "
              f"transformers {result['prefill'][n][1]:.0f} tok/s", flush=True)  # fmt: skip
    for batch in BATCHES:
        ours, theirs = [], []
        for _ in range(max(1, reps - 1)):
            ours.append(ours_decode(loaded, batch))
            theirs.append(hf_decode(hf, batch, dev))
        result["decode"][batch] = (statistics.median(ours), statistics.median(theirs))
        print(f"  {dtype} decode batch {batch}: kvserve {result['decode'][batch][0]:.1f} tok/s, "
              f"transformers {result['decode'][batch][1]:.1f} tok/s", flush=True)  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    result["weight_bytes"] = weight_bytes
    result["dtype"] = str(loaded.dtype).removeprefix("torch.")
    return result


def report(results: list[dict], bandwidth: float, device: str, command: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [
        "# Engine benchmark: kvserve vs Hugging Face transformers",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {cpu}, {torch.get_num_threads()} threads, device {device}, torch {torch.__version__}",
        "- model: SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), same weights in both",
        f"- memory-copy bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s",
        "",
        "Medians of alternating repetitions. Decode: 64 new tokens per sequence, prompts of "
        f"{DECODE_PROMPT}-{DECODE_PROMPT + 3 * 31} tokens; tokens/s counts generated tokens after the first.",
        "",
        "| dtype | measure | kvserve | transformers | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for n, (ours, theirs) in r["prefill"].items():
            lines.append(f"| {r['dtype']} | prefill {n} tokens, tok/s | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
        for b, (ours, theirs) in r["decode"].items():
            lines.append(f"| {r['dtype']} | decode batch {b}, tok/s | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    lines += ["", "## Batch-1 decode step against the floor", "",
              "| dtype | weight bytes | floor (bytes / copy bandwidth) | kvserve step | step / floor |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        floor = r["weight_bytes"] / bandwidth
        step = 1 / r["decode"][1][0]
        lines.append(f"| {r['dtype']} | {r['weight_bytes'] / 1e6:.0f} MB | {floor * 1e3:.1f} ms | "
                     f"{step * 1e3:.1f} ms | {step / floor:.2f}x |")  # fmt: skip
    lines += ["", "## Targets", ""]
    for r in results:
        d32 = r["decode"][32][0] / r["decode"][32][1]
        step = (1 / r["decode"][1][0]) / (r["weight_bytes"] / bandwidth)
        prefill_ok = all(o >= t for o, t in r["prefill"].values())
        lines.append(f"- {r['dtype']}: batch-32 decode {d32:.2f}x transformers (target >= 3x: "
                     f"{'met' if d32 >= 3 else 'not met'}); batch-1 step {step:.2f}x the floor (target <= 2x: "
                     f"{'met' if step <= 2 else 'not met'}); prefill no slower than transformers: "
                     f"{'met' if prefill_ok else 'not met'}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/engine.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    bandwidth = copy_bandwidth(torch.device(args.device))
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    results = [run_dtype(d, args.device, args.reps) for d in args.dtypes.split(",")]
    text = report(results, bandwidth, args.device, "python " + " ".join(sys.argv))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
