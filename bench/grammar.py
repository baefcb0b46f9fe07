"""Constrained decoding's cost: a decode step (engine + sampler) of 8 and 32 sequences
where half carry a JSON Schema grammar, against the same batch without grammars; and
grammar compile time per schema, cold and cached.

    .venv/bin/python bench/grammar.py [--steps 12] [--rounds 3] [--out bench/results/grammar.md]

Each round times ``--steps`` decode steps with grammars as the sampler ships, with
grammars whose mask is filled before every draw (the sampler's path for a row that
reads logprobs or cuts by top-p), and without grammars, on sequences of the same
prompts and lengths (each batch prefilled afresh, the order rotated between rounds);
the figure is the median step over all rounds. The grammar (an object holding an array of exactly
64 strings, once of at most 16 characters each and once of any length) does not end
within the steps timed, so every constrained row is masked at every step. Compile times are the 20 schemas of the structured-output
integration test, on a fresh compiler (cold) and again (cached).
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libs.engine.model import sampling, steps  # noqa: E402
from libs.engine.model.engine import EngineConfig  # noqa: E402
from libs.engine.model.grammar import GrammarCompiler  # noqa: E402
from libs.engine.model.loader import build_engine, load_model  # noqa: E402
from libs.engine.model.scheduler import sample_tokens  # noqa: E402
from libs.engine.model.sequence import Sequence  # noqa: E402
from libs.protocol.sampling_params import Grammar, SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64,
                  "maxItems": 64}},
    "required": ["items"],
    "additionalProperties": False,
}
# the same schema with strings of any length: xgrammar's mask for a bounded string costs far more
UNBOUNDED = {**SCHEMA, "properties": {"items": {**SCHEMA["properties"]["items"], "items": {"type": "string"}}}}
GRAMMARS = {
    "strings of at most 16 characters": Grammar(kind="json_schema", schema=json.dumps(SCHEMA), strict=True),
    "strings of any length": Grammar(kind="json_schema", schema=json.dumps(UNBOUNDED), strict=True),
}
PROMPT = "List as many fruits as you can, as JSON."


def batch(model, engine, size: int, grammar: Grammar | None, grammars: GrammarCompiler) -> list[Sequence]:
    """``size`` prefilled sequences with their first token; half with ``grammar``."""
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    seqs = []
    for i in range(size):
        params = SamplingParams(max_tokens=1000, temperature=1.0, seed=i, ignore_eos=True,
                                grammar=grammar if i % 2 == 0 else None)  # fmt: skip
        seqs.append(Sequence.from_prompt(f"r{i}", [*prompt, i % 7], params))  # distinct prompts: no shared blocks
    logits = steps.prefill(engine, seqs)
    sample_tokens(seqs, logits, lambda s: None, model.tokenizer.eos_token_ids, grammars)
    return seqs


def time_steps(model, engine, seqs: list[Sequence], num_steps: int,
               grammars: GrammarCompiler) -> list[tuple[float, float]]:  # fmt: skip
    """(whole step, sampler alone) seconds of each of ``num_steps`` decode steps."""
    eos = model.tokenizer.eos_token_ids
    out = []
    for _ in range(num_steps):
        start = time.perf_counter()
        logits = steps.decode(engine, seqs)
        sampling = time.perf_counter()
        sample_tokens(seqs, logits, lambda s: None, eos, grammars)
        end = time.perf_counter()
        out.append((end - start, end - sampling))
    return out


VARIANTS = ("with", "masked first", "without")  # the grammar as shipped; its mask filled before every draw; none


def step_times(model, size: int, num_steps: int, rounds: int, grammar: Grammar, grammars: GrammarCompiler) -> dict[str, float]:
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    mask_can_wait = sampling._mask_can_wait
    for r in range(rounds):
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # no variant always goes first
            engine = build_engine(model, EngineConfig(num_blocks=64 * size // 8 + 64, enable_prefix_cache=False))
            seqs = batch(model, engine, size, None if variant == "without" else grammar, grammars)
            sampling._mask_can_wait = (lambda p: False) if variant == "masked first" else mask_can_wait
            try:
                time_steps(model, engine, seqs, 2, grammars)  # warm
                times[variant] += time_steps(model, engine, seqs, num_steps, grammars)
            finally:
                sampling._mask_can_wait = mask_can_wait
    step = {v: statistics.median(t for t, _ in times[v]) * 1e3 for v in times}
    sampler = {v: statistics.median(s for _, s in times[v]) * 1e3 for v in times}
    return {"step_ms": step, "sampler_ms": sampler,
            "slower_pct": {v: 100 * (step[v] / step["without"] - 1) for v in VARIANTS[:2]}}  # fmt: skip


def compile_times(model) -> dict[str, float]:
    from openai.lib._pydantic import to_strict_json_schema

    from tests.integration.structured_schemas import MODELS

    grammars = GrammarCompiler(model.tokenizer, model.model.config.vocab_size)
    start = time.perf_counter()
    grammars.compile(Grammar(kind="json_object"))  # builds the tokenizer's tables once (and imports xgrammar)
    setup = time.perf_counter() - start
    schemas = [Grammar(kind="json_schema", schema=json.dumps(to_strict_json_schema(m)), strict=True) for m, _ in MODELS]
    cold, cached = [], []
    for g in schemas:
        start = time.perf_counter()
        grammars.compile(g)
        cold.append(time.perf_counter() - start)
    for g in schemas:
        start = time.perf_counter()
        grammars.compile(g)
        cached.append(time.perf_counter() - start)
    return {"setup_ms": setup * 1e3, "cold_median_ms": statistics.median(cold) * 1e3,
            "cold_max_ms": max(cold) * 1e3, "cached_median_us": statistics.median(cached) * 1e6}  # fmt: skip


def step_report_head(title: str, script: str, model, args: argparse.Namespace, extra: str = "") -> list[str]:
    """A step benchmark's report up to its table: the title, when and where, the command."""
    return [
        f"# {title}",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
        f"({torch.get_num_threads()} torch threads), default model ({model.dtype}){extra}:",
        "",
        f"    .venv/bin/python bench/{script} --steps {args.steps} --rounds {args.rounds}"
        + (f" --dtype {args.dtype}" if args.dtype != "auto" else ""),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write the results as Markdown here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(None, dtype=args.dtype, progress=False)
    compiled = compile_times(model)
    grammars = GrammarCompiler(model.tokenizer, model.model.config.vocab_size)
    timed = {(size, name): step_times(model, size, args.steps, args.rounds, grammar, grammars)
             for size in (8, 32) for name, grammar in GRAMMARS.items()}  # fmt: skip
    lines = [
        *step_report_head("Constrained decoding: decode step and compile time", "grammar.py", model, args,
                          ", xgrammar 0.1.34"),  # fmt: skip
        "| sequences | the grammar's array holds | half with the grammar (ms/step) | no grammar (ms/step) | slower "
        "| the same, mask filled before every draw (ms/step) | slower | sampler: with / mask first / without (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *(f"| {size} | {name} | {s['step_ms']['with']:.1f} | {s['step_ms']['without']:.1f} | "
          f"{s['slower_pct']['with']:+.1f}% | {s['step_ms']['masked first']:.1f} | {s['slower_pct']['masked first']:+.1f}% "
          f"| {s['sampler_ms']['with']:.2f} / {s['sampler_ms']['masked first']:.2f} / {s['sampler_ms']['without']:.2f} |"
          for (size, name), s in timed.items()),
        "",
        f"Compile (20 schemas of tests/integration/structured_schemas.py): cold median "
        f"{compiled['cold_median_ms']:.1f} ms, max {compiled['cold_max_ms']:.1f} ms; cached median "
        f"{compiled['cached_median_us']:.1f} µs. Once per process: {compiled['setup_ms']:.0f} ms to import "
        "xgrammar and build the tokenizer's tables.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
