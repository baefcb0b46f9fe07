"""The one-process engine's greedy answers (float32) to fixed chat prompts, and their
digest: equal digests from two checkouts mean they answer alike. Run it with the
checkout on PYTHONPATH from inside that checkout, e.g. for a baseline:

    cd BASELINE && PYTHONPATH=BASELINE /path/to/kvserve/.venv/bin/python /path/to/kvserve/bench/same_answers.py

A checkout from before libs/common was split (the engine under libs/common/model)
is read with KVSERVE_LAYOUT=common.
"""

import hashlib
import json
import os

if os.environ.get("KVSERVE_LAYOUT") == "common":
    from libs.common.model.engine import EngineConfig
    from libs.common.model.generator import Generator
    from libs.common.model.loader import build_engine, load_model
    from libs.common.sampling_params import SamplingParams
else:
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.generator import Generator
    from libs.engine.model.loader import build_engine, load_model
    from libs.protocol.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain what a KV cache is in one sentence.", "Translate 'good morning' to Spanish.",
           "What is 12 times 12?", "Name a famous painter.", "Why is the sky blue?"]  # fmt: skip


def main() -> None:
    loaded = load_model(None, dtype="float32", quantization="none", progress=False)
    generator = Generator(build_engine(loaded, EngineConfig(num_blocks=512, block_size=16)), loaded.tokenizer)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]  # fmt: skip
    texts = [c.text for c in generator.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))]
    for prompt, text in zip(PROMPTS, texts):
        print(f"{prompt!r} -> {text!r}")
    print("digest", hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16])


if __name__ == "__main__":
    main()
