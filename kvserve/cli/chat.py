"""``kvserve chat``: talk to a model in this terminal, on the engine in one process."""

import argparse
import sys

from kvserve.cli.options import add_model_options
from libs.common.model.engine import EngineConfig
from libs.common.model.generator import Generator
from libs.common.model.loader import build_engine, load_model
from libs.common.sampling_params import SamplingParams

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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    generator = Generator(build_engine(loaded, EngineConfig(num_blocks=1024)), loaded.tokenizer)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _answer(generator, history + [{"role": "user", "content": args.prompt}], params)
        return 0
    print(f"kvserve chat with {loaded.model_id} ({loaded.dtype}, {loaded.device}); {HELP}")
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
        messages.append({"role": "assistant", "content": _answer(generator, messages, params)})


def _answer(generator: Generator, messages: list[dict], params: SamplingParams) -> str:
    prompt = generator.tokenizer.encode_chat(messages)
    text = []
    for out in generator.stream(prompt, params):
        sys.stdout.write(out.text)
        sys.stdout.flush()
        text.append(out.text)
    sys.stdout.write("\n")
    return "".join(text)
