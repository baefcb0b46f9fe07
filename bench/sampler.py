"""The sampler's share of a decode step: the default model's decode step (engine and
sampler) over 8 and 32 sequences sampled at temperature 1, at temperature 0.7 with
top-p 0.95, and greedily, with this tree's sampler against the previous one (an
exponential race over the whole vocabulary, top-p by sorting all of it), in one run.

    .venv/bin/python bench/sampler.py [--steps 12] [--rounds 3] [--out bench/results/sampler.md]

Each round prefills a batch and times ``--steps`` decode steps with one sampler, then
a fresh batch of the same prompts with the other (which goes first alternates); the
figure is the median step over all rounds. The previous sampler is kept here only as
the baseline.
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grammar import step_report_head, time_steps  # noqa: E402
from libs.engine.model import sampling  # noqa: E402
from libs.engine.model import steps  # noqa: E402
from libs.engine.model.engine import EngineConfig  # noqa: E402
from libs.engine.model.loader import build_engine, load_model  # noqa: E402
from libs.engine.model.scheduler import sample_tokens  # noqa: E402
from libs.engine.model.sequence import Sequence  # noqa: E402
from libs.protocol.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
SETTINGS = {
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top-p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "greedy": {"temperature": 0.0},
}


def previous_sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """The sampler before this one: top-p sorts the whole vocabulary, and the draw is an
    exponential race (a random number per token)."""
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if p.seed is not None:
        generator = torch.Generator().manual_seed((p.seed * sampling._MIX + index) & sampling._MASK63)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())


def batch(model, engine, size: int, params: dict) -> list[Sequence]:
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    seqs = [Sequence.from_prompt(f"r{i}", [*prompt, i % 7], SamplingParams(max_tokens=1000, ignore_eos=True, seed=i,
                                                                            **params))
            for i in range(size)]  # fmt: skip
    logits = steps.prefill(engine, seqs)
    sample_tokens(seqs, logits, lambda s: None, model.tokenizer.eos_token_ids)
    return seqs


def step_times(model, size: int, params: dict, num_steps: int, rounds: int) -> dict[str, tuple[float, float]]:
    samplers: dict[str, Callable] = {"this": sampling._sample_row, "previous": previous_sample_row}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in samplers}
    for r in range(rounds):
        for name in samplers if r % 2 == 0 else reversed(samplers):
            with mock.patch.object(sampling, "_sample_row", samplers[name]):
                engine = build_engine(model, EngineConfig(num_blocks=64 * size // 8 + 64, enable_prefix_cache=False))
                seqs = batch(model, engine, size, params)
                time_steps(model, engine, seqs, 2, None)  # warm
                times[name] += time_steps(model, engine, seqs, num_steps, None)
    return {name: (statistics.median(t for t, _ in ts) * 1e3, statistics.median(s for _, s in ts) * 1e3)
            for name, ts in times.items()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write the results as Markdown here")
    args = parser.parse_args()
    model = load_model(None, dtype=args.dtype, progress=False)
    rows = []
    for size in (8, 32):
        for name, params in SETTINGS.items():
            t = step_times(model, size, params, args.steps, args.rounds)
            (this, this_s), (prev, prev_s) = t["this"], t["previous"]
            rows.append(f"| {size} | {name} | {this:.1f} | {prev:.1f} | {100 * (this / prev - 1):+.1f}% "
                        f"| {this_s:.2f} / {prev_s:.2f} |")  # fmt: skip
            print(rows[-1], flush=True)
    lines = [
        *step_report_head("The sampler's share of a decode step", "sampler.py", model, args),
        "| sequences | sampling | this sampler (ms/step) | previous sampler (ms/step) | change | sampler alone, "
        "this / previous (ms) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
