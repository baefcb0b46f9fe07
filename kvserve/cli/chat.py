"""``kvserve chat``: talk to a model in this terminal, on the engine in one process."""

import argparse
import sys
import time
from dataclasses import dataclass

from kvserve.cli.options import add_model_options
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine, load_model
from libs.protocol.sampling_params import SamplingParams

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) quits"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat with a model in this terminal (one process, no cluster)",
        description="Chat with a model in this terminal. Tokens stream as they are generated. " + HELP + ".",
    )
    add_model_options(parser)
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--system", help="system prompt (default: the model's own)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--stats", action="store_true",
        help="after each answer, print its speed: prompt tokens, prefill time (to the first token) and "
        "prefill tokens/s, tokens decoded after the first and decode tokens/s",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    generator = Generator(build_engine(loaded, EngineConfig(num_blocks=1024)), loaded.tokenizer)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _answer(generator, history + [{"role": "user", "content": args.prompt}], params, args.stats)
        return 0
    print(f"kvserve chat with {loaded.model_id} ({loaded.dtype}, weights {loaded.quantization}, {loaded.device}); {HELP}")
    messages = list(history)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(history)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": _answer(generator, messages, params, args.stats)})


@dataclass(frozen=True)
class AnswerStats:
    """How fast one answer came: its prefill ends with the first token, its decode is every token after it."""

    prompt_tokens: int
    prefill_s: float  # from the request to its first token
    decode_tokens: int  # tokens after the first
    decode_s: float  # from the first token to the last

    def describe(self) -> str:
        text = (f"[{self.prompt_tokens} prompt tokens, prefill {self.prefill_s:.3f} s "
                f"({_rate(self.prompt_tokens, self.prefill_s)} tok/s)")  # fmt: skip
        if self.decode_tokens:
            text += f"; {self.decode_tokens} tokens decoded at {_rate(self.decode_tokens, self.decode_s)} tok/s"
        return text + "]"


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds > 0 else "-"


def _answer(generator: Generator, messages: list[dict], params: SamplingParams, stats: bool = False) -> str:
    prompt = generator.tokenizer.encode_chat(messages)
    text = []
    started = time.perf_counter()
    first = last = started
    tokens = 0
    for out in generator.stream(prompt, params):
        last = time.perf_counter()
        if tokens == 0:
            first = last
        tokens += 1
        sys.stdout.write(out.text)
        sys.stdout.flush()
        text.append(out.text)
    sys.stdout.write("\n")
    if stats:
        print(AnswerStats(len(prompt), first - started, max(0, tokens - 1), last - first).describe())
    return "".join(text)
