"""The engine side by side with llama.cpp and Hugging Face transformers, in one run.

Every kvserve variant (weights float32 / bfloat16 / int8 / int4, decode eager or
compiled), transformers' `generate` (bf16, fp32) and llama.cpp's `llama-server` on
the same GGUF file run one after the other, each in its own process so start-up
time and resident memory are its own. For each: prefill tokens/s at 512 and 2,048
tokens, decode tokens/s at batch 1, 8, 32 and 64, start-up seconds (process start
to ready, compilation included) and peak resident memory; for kvserve the batch-1
step against the floor (weight bytes / this machine's measured copy bandwidth).

    python bench/engine.py [--variants all] [--skip-llama] [--skip-hf] [--out bench/results/engine.md]
    python bench/engine.py --gguf Q4_K_M   # only decode at batch 1 and 32, kvserve vs llama.cpp, on the
                                           # default model as llama-quantize makes that file (bench/gguf_quants.py);
                                           # its section of --out is replaced, the rest kept

Variants: fp32, bf16, int8, int4 with -eager or -compiled (e.g. int4-compiled);
hf-bf16, hf-fp32; llama.cpp (needs bench/llama_cpp.sh). One process at a time:
never run two benchmarks at once on a small machine.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before any import of the project: this tree's, not the installed one

from libs.engine.model import steps  # noqa: E402

LLAMA_SERVER = ROOT / ".cache" / "llama.cpp" / "bin" / "llama-server"
PREFILL_LENGTHS = (512, 2048)
BATCHES = (1, 8, 32, 64)
NEW_TOKENS = 32  # decoded per sequence after the first token
DECODE_PROMPT = 128  # tokens per decode prompt (each a little different in length)
KVSERVE_VARIANTS = [f"{w}-{m}" for w in ("fp32", "bf16", "int8", "int4") for m in ("eager", "compiled")]
HF_VARIANTS = ["hf-bf16", "hf-fp32"]
DEFAULT_VARIANT = "int4-eager"  # what `kvserve up` serves: the GGUF's int4, decode not compiled
WEIGHTS = {  # variant prefix -> (dtype, quantization)
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("auto", "int8"),
    "int4": ("auto", "auto"),  # the default model ships Q4_1: auto runs its blocks as int4-g32
    "file": ("bfloat16", "auto"),  # --gguf: the file's own formats
}
FILE_BATCHES = (1, 32)


def random_prompt(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_prompts(batch: int) -> list[list[int]]:
    return [random_prompt(DECODE_PROMPT + 3 * i, 1000 + i) for i in range(batch)]


def memory_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak) in KiB from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB tensor copy into a preallocated tensor (best of 5)."""
    import torch

    src = torch.ones(1 << 28, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best


# --- one variant, in its own process ------------------------------------------------
def emit(**fields) -> None:
    print("BENCH " + json.dumps(fields), flush=True)


def kvserve_worker(
    variant: str, reps: int, model: str | None = None, batches=BATCHES, prefill_lengths=PREFILL_LENGTHS
) -> None:
    import torch

    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.generator import Generator
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence
    from libs.protocol.sampling_params import SamplingParams

    weights, _ = variant.split("-")
    dtype, quantization = WEIGHTS[weights]
    torch.set_grad_enabled(False)
    loaded = load_model(model, dtype=dtype, quantization=quantization, progress=False)
    config = EngineConfig(num_blocks=max(BATCHES) * 32 + 256, max_chunk_tokens=2048, enable_prefix_cache=False,
                          compile=variant.endswith("-compiled"))  # fmt: skip
    engine = build_engine(loaded, config)
    warmup = getattr(engine, "warmup", None)
    if warmup is not None:
        warmup()
    emit(ready=True, dtype=str(loaded.dtype).removeprefix("torch."),
         quantization=str(getattr(loaded, "quantization", "none")),
         compiled=engine.compiled is not None, weight_bytes=weight_bytes(loaded.model),
         step_bytes=step_bytes(loaded.model))  # fmt: skip

    def prefill(n: int, seed: int) -> float:
        seq = Sequence.from_prompt(f"p{seed}", random_prompt(n, seed))
        start = time.perf_counter()
        steps.prefill(engine, [seq])
        elapsed = time.perf_counter() - start
        engine.cache.free(seq)
        return n / elapsed

    for n in prefill_lengths:
        prefill(n, 99)
        emit(prefill=n, tok_s=statistics.median(prefill(n, rep) for rep in range(reps)))
    for batch in batches:
        generator = Generator(engine, loaded.tokenizer, max_batch_size=batch)
        params = SamplingParams(max_tokens=NEW_TOKENS + 1, temperature=0, ignore_eos=True)
        for prompt in decode_prompts(batch):
            generator.add_request(prompt, params)
        generator.step()  # every prefill and each sequence's first token
        while generator.running and len(generator.running) < batch:
            generator.step()
        start, num_steps = time.perf_counter(), 0
        while generator.has_work:
            generator.step()
            num_steps += 1
        emit(decode=batch, tok_s=batch * num_steps / (time.perf_counter() - start), steps=num_steps)
    emit(memory=memory_kib())


def weight_bytes(model) -> int:
    from libs.engine.model.dense import PackedLinear

    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.out_features * m.in_features * m.weight.dtype.itemsize  # held outside parameters
                 for m in model.modules() if isinstance(m, PackedLinear))  # fmt: skip
    return sum(storages.values()) + packed


def step_bytes(model) -> int:
    """Bytes of weights a kvserve batch-1 decode step reads: each projection in the form
    its kernel multiplies by (int4: the packing and its group scales, not the nibble copy
    kept for prefill), the norms, the LM head, and one row of the embedding table (the
    whole table when the head is that table)."""
    from torch import nn

    from libs.engine.model.dense import FloatLinear, PackedLinear
    from libs.engine.model.llama import Linear, RMSNorm
    from libs.engine.model.quant import Int4Linear, Int8Linear

    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            tensors = [module.packed, module.scale_zero, module.bias]
        elif isinstance(module, Int8Linear):
            tensors = [module.weight_q, module.scale, module.bias]
        elif isinstance(module, (Linear, FloatLinear)):  # StackedLinear: its parts count themselves
            tensors = [module.weight_t, module.bias]
        elif isinstance(module, PackedLinear):  # oneDNN's blocked layout: the plain weight's bytes
            total += module.out_features * module.in_features * module.weight.dtype.itemsize
            tensors = [module.bias]
        elif isinstance(module, (RMSNorm, nn.Linear)):  # nn.Linear: a float LM head
            tensors = [module.weight, getattr(module, "bias", None)]
        elif isinstance(module, nn.Embedding):
            tensors = [module.weight[0]]
        else:
            continue
        total += sum(t.nbytes for t in tensors if t is not None)
    return total


def hf_worker(variant: str, reps: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from libs.engine.model.default_model import default_model_dir

    dtype = {"hf-bf16": torch.bfloat16, "hf-fp32": torch.float32}[variant]
    torch.set_grad_enabled(False)
    model = LlamaForCausalLM.from_pretrained(str(default_model_dir()), dtype=dtype).eval()
    emit(ready=True, dtype=str(dtype).removeprefix("torch."), quantization="none", compiled=False,
         weight_bytes=weight_bytes(model))  # fmt: skip

    def prefill(n: int, seed: int) -> float:
        ids = torch.tensor([random_prompt(n, seed)])
        start = time.perf_counter()
        model(ids, use_cache=True)
        return n / (time.perf_counter() - start)

    for n in PREFILL_LENGTHS:
        prefill(n, 99)
        emit(prefill=n, tok_s=statistics.median(prefill(n, rep) for rep in range(reps)))
    for batch in BATCHES:
        prompts = decode_prompts(batch)
        width, pad = max(len(p) for p in prompts), 2
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def generate(new: int) -> float:
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)  # fmt: skip
            return time.perf_counter() - start

        first = generate(1)
        total = generate(NEW_TOKENS + 1)
        emit(decode=batch, tok_s=batch * NEW_TOKENS / (total - first), steps=NEW_TOKENS)
    emit(memory=memory_kib())


def run_variant(variant: str, reps: int, timeout: float, extra: list[str] = [], quiet: bool = False) -> dict:
    """Run one variant in a fresh process; its start-up counts from the spawn."""
    env = dict(os.environ)
    result: dict = {"variant": variant, "prefill": {}, "decode": {}}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--worker", variant, "--reps", str(reps), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)  # fmt: skip
    deadline = start + timeout
    tail: list[str] = []
    for line in proc.stdout:
        if time.perf_counter() > deadline:
            proc.kill()
            result["error"] = f"timed out after {timeout:g}s"
            break
        if not line.startswith("BENCH "):
            tail = (tail + [line.rstrip()])[-5:]
            continue
        fields = json.loads(line[6:])
        if "error" in fields:
            result["error"] = fields["error"]
        elif "ready" in fields:
            result["startup_s"] = time.perf_counter() - start
            result.update({k: v for k, v in fields.items() if k != "ready"})
        elif "prefill" in fields:
            result["prefill"][fields["prefill"]] = fields["tok_s"]
        elif "decode" in fields:
            result["decode"][fields["decode"]] = fields["tok_s"]
        elif "memory" in fields:
            result["rss_mib"] = fields["memory"]["VmHWM"] / 1024
        if not quiet:
            print(f"  {variant}: {fields}", flush=True)
    proc.wait()
    if proc.returncode != 0 and "error" not in result:
        result["error"] = f"exited {proc.returncode}: " + " | ".join(tail)
    return result


# --- llama.cpp ---------------------------------------------------------------------
def llama_cpp(reps: int, model: Path | None = None, parallel: int = 4, prefill: bool = True) -> dict:
    """llama-server on ``model`` (the default model's file): prefill, one stream's decode, and
    ``parallel`` concurrent requests' decode."""
    from libs.engine.model.default_model import default_gguf_path

    model = model or default_gguf_path()
    kind = model.stem.rpartition(".")[2]
    result: dict = {"variant": "llama.cpp", "prefill": {}, "decode": {}, "dtype": f"{kind} (its own kernels)"}
    if not LLAMA_SERVER.exists():
        result["error"] = f"{LLAMA_SERVER} is missing: run bench/llama_cpp.sh"
        return result
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(len(os.sched_getaffinity(0)))
    args = ["-np", str(parallel), "-kvu", "-t", threads, "-c", "16384", "--no-webui"]
    result["command"] = "llama-server " + " ".join(args)
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), *args], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                result["error"] = f"llama-server exited {proc.returncode}: {log.read()[-500:]!r}"
                return result
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - start > 120:
                result["error"] = "llama-server not healthy within 120 s"
                return result
            time.sleep(0.1)  # polling a process we do not control
        result["startup_s"] = time.perf_counter() - start

        def complete(prompt: list[int], n_predict: int) -> dict:
            body = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": False, "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())["timings"]

        for n in PREFILL_LENGTHS if prefill else ():
            complete(random_prompt(n, 99), 1)
            rates = [complete(random_prompt(n, rep), 1)["prompt_per_second"] for rep in range(reps)]
            result["prefill"][n] = statistics.median(rates)
            print(f"  llama.cpp: prefill {n}: {result['prefill'][n]:.0f} tok/s", flush=True)
        singles = [complete(decode_prompts(1)[0], NEW_TOKENS + 1)["predicted_per_second"] for _ in range(reps)]
        result["decode"][1] = statistics.median(singles)
        prompts = decode_prompts(parallel)
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            begin = time.perf_counter()
            timings = list(pool.map(lambda p: complete(p, 4 * NEW_TOKENS), prompts))
            wall = time.perf_counter() - begin
        result["decode"][f"{parallel} parallel"] = sum(t["predicted_n"] for t in timings) / wall
        # the same requests' decode alone: each request's own decode rate, summed (their decodes overlap)
        result["decode"][f"{parallel} parallel, decode"] = sum(t["predicted_per_second"] for t in timings)
        print(f"  llama.cpp: decode {result['decode']}", flush=True)
        result["rss_mib"] = memory_kib(proc.pid)["VmHWM"] / 1024
        result["weight_bytes"] = model.stat().st_size
    finally:
        proc.terminate()
        proc.wait()
    return result


# --- the report ------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: list[dict], bandwidth: float, command: str) -> str:
    import torch

    flags = set()
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags)
    lines = [
        "# Engine benchmark: kvserve vs llama.cpp and Hugging Face transformers",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {cpu_name()} ({isa or 'no AVX-512'}), {len(os.sched_getaffinity(0))} cores, "
        f"torch {torch.__version__}",
        "- model: SmolLM2-135M-Instruct; kvserve and llama.cpp read the same Q4_1 GGUF file, transformers its "
        "dequantized float32 copy",
        f"- memory-copy bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s",
        "",
        f"Each variant in its own process, one after the other. Prefill: one forward over a random prompt (median of "
        f"the repetitions). Decode: {NEW_TOKENS} tokens per sequence after the first, prompts of "
        f"{DECODE_PROMPT}-{DECODE_PROMPT + 3 * (max(BATCHES) - 1)} tokens, greedy; tokens/s counts every sequence's "
        "tokens. llama.cpp: its own timings (prompt_per_second, predicted_per_second) for single requests; "
        f"'4 parallel' is the tokens of four concurrent {4 * NEW_TOKENS}-token requests over their wall time.",
        "",
        "| variant | weights | prefill 512 | prefill 2048 | decode b=1 | b=8 | b=32 | b=64 | llama.cpp 4 parallel "
        "| start-up s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:160]} |||||||||")
            continue
        weights = r.get("quantization") if r.get("quantization") not in (None, "none") else r.get("dtype")
        d = r["decode"]
        lines.append(
            f"| {r['variant']} | {weights} | {fmt(r['prefill'].get(512))} | {fmt(r['prefill'].get(2048))} | "
            f"{fmt(d.get(1), 1)} | {fmt(d.get(8), 1)} | {fmt(d.get(32), 1)} | {fmt(d.get(64), 1)} | "
            f"{fmt(d.get('4 parallel'), 1)} | {fmt(r.get('startup_s'), 1)} | {fmt(r.get('rss_mib'))} |"
        )
    lines += ["", "## Batch-1 decode step against the floor", "",
              "The floor: the bytes of weights a batch-1 step reads over the copy bandwidth above (a copy moves "
              "each byte twice, so the floor is pessimistic by up to 2x). kvserve: every projection in the form its "
              "kernel reads, the norms, the LM head and one embedding row; transformers: every parameter once (the "
              "tied head reads the embedding table); llama.cpp: its file. Held: every buffer the process keeps "
              "(kvserve's int4 also keeps a nibble copy and, from its first prefill, a bfloat16 copy for "
              "prefill-sized batches).", "",
              "| variant | bytes read | held | floor | batch-1 step | step / floor |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "error" in r or not r["decode"].get(1) or not r.get("weight_bytes"):
            continue
        read = r.get("step_bytes", r["weight_bytes"])
        floor = read / bandwidth
        step = 1 / r["decode"][1]
        lines.append(f"| {r['variant']} | {read / 1e6:.0f} MB | {r['weight_bytes'] / 1e6:.0f} MB | "
                     f"{floor * 1e3:.1f} ms | {step * 1e3:.1f} ms | {step / floor:.2f}x |")  # fmt: skip
    lines += ["", "## Targets", ""] + targets(results, bandwidth)
    return "\n".join(lines) + "\n"


def targets(results: list[dict], bandwidth: float) -> list[str]:
    by = {r["variant"]: r for r in results if "error" not in r}
    llama, hf = by.get("llama.cpp"), by.get("hf-bf16")
    ours = [r for r in results if "error" not in r and r["variant"] in KVSERVE_VARIANTS]
    if not ours:
        return ["- no kvserve variant ran"]
    # the targets hold for what a user gets: the default variant, where it ran
    default = by.get(DEFAULT_VARIANT) or max(ours, key=lambda r: r["decode"].get(1, 0))
    name = default["variant"]
    out = []

    def line(what: str, ratio: float | None, goal: float, note: str = "") -> None:
        if ratio is None:
            out.append(f"- {what}: not measured")
        else:
            verdict = "met" if ratio >= goal else "not met"
            out.append(f"- {what}: {ratio:.2f}x (target >= {goal:g}x: {verdict}){note}")

    if llama:
        line(f"batch-1 decode, {name} vs llama.cpp single stream", default["decode"][1] / llama["decode"][1], 1.0)
        line(f"batch-32 aggregate decode, {name} vs llama.cpp 4 parallel",
             default["decode"][32] / llama["decode"]["4 parallel"], 3.0)  # fmt: skip
        line(f"prefill 2048, {name} vs llama.cpp", default["prefill"][2048] / llama["prefill"][2048], 3.0)
    if hf:
        line(f"batch-32 aggregate decode, {name} vs transformers bf16", default["decode"][32] / hf["decode"][32], 3.0)
        line(f"prefill 2048, {name} vs transformers bf16", default["prefill"][2048] / hf["prefill"][2048], 1.0)
    step = (1 / default["decode"][1]) / (default.get("step_bytes", default["weight_bytes"]) / bandwidth)
    out.append(f"- batch-1 step of {name}: {step:.2f}x the floor (target <= 1.5x: "
               f"{'met' if step <= 1.5 else 'not met'})")  # fmt: skip
    return out


# --- --gguf: decode on a llama-quantize file ------------------------------------------------
def gguf_rows(kind: str, reps: int, timeout: float, out: Path, command: str) -> None:
    """kvserve (auto: the file's own formats) and llama.cpp decoding the same file; the report's
    section for it replaced in ``out`` (appended the first time)."""
    from bench.gguf_quants import default_model_as

    path = default_model_as(kind)
    load_before = os.getloadavg()[0]
    ours = {**run_variant("file-eager", reps, timeout, ["--worker-model", str(path)]), "variant": "kvserve"}
    theirs = llama_cpp(reps, path, parallel=max(FILE_BATCHES), prefill=False)
    title = f"## Decode on llama-quantize's {kind} file"
    load = (load_before, os.getloadavg()[0])
    text = gguf_section(title, path, ours, theirs, command, load)
    old = out.read_text() if out.exists() else ""
    if title in old:
        before, _, rest = old.partition(title)
        after = rest[rest.index("\n## ") + 1 :] if "\n## " in rest else ""
        old = before + text + ("\n" + after if after else "")
    else:
        old = old.rstrip("\n") + "\n\n" + text
    out.write_text(old)
    print(text)


def file_types(path: Path) -> str:
    """How many of a GGUF file's matrices (2-D tensors) it stores in each type, most first."""
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) > 1)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def gguf_section(title: str, path: Path, ours: dict, theirs: dict, command: str, load: tuple[float, float]) -> str:
    big = max(FILE_BATCHES)
    busy = (" (above the core count: other work ran beside the two engines, one after the other, and only their "
            "ratio, loosely, means anything)") if max(load) > (os.cpu_count() or 1) else ""  # fmt: skip
    lines = [title, "",
             f"`{command}` ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}): {path.name} "
             f"({path.stat().st_size / 1e6:.0f} MB), made from a float32 copy of the shipped Q4_1 file by "
             "bench/gguf_quants.py. kvserve: `--quantization auto`, bfloat16, decode not compiled (each tensor "
             f"in its kept format, README); b={big}: {big} sequences decoding together. llama.cpp: "
             f"`{theirs.get('command', 'llama-server')}`; b=1 is one stream, b={big} the sum of {big} concurrent "
             "requests' own decode rates (their prompts' processing left out, as kvserve's), beside their tokens "
             f"over the wall time. Load average (1 min) before and after: {load[0]:.1f} and {load[1]:.1f} on "
             f"{os.cpu_count()} cores{busy}. The file's matrices by GGUF type: {file_types(path)}.", "",
             f"| engine | weights | decode b=1 | b={big} | b={big}, wall incl. prompts | peak RSS MiB |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in (ours, theirs):
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:160]} |||||")
            continue
        d = r["decode"]
        weights = r.get("quantization") or r.get("dtype")
        many = d.get(big) if big in d else d.get(f"{big} parallel, decode")
        lines.append(f"| {r['variant']} | {weights} | {fmt(d.get(1), 1)} | {fmt(many, 1)} | "
                     f"{fmt(d.get(f'{big} parallel'), 1)} | {fmt(r.get('rss_mib'))} |")  # fmt: skip
    if "error" not in ours and "error" not in theirs:
        lines += ["", f"kvserve / llama.cpp: b=1 {ours['decode'][1] / theirs['decode'][1]:.2f}x, b={big} "
                  f"{ours['decode'][big] / theirs['decode'][f'{big} parallel, decode']:.2f}x."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="all", help="comma-separated, all (default) or none")
    parser.add_argument("--skip-llama", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--reps", type=int, default=3, help="prefill repetitions per length (default 3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant (default 900)")
    parser.add_argument("--out", default="bench/results/engine.md")
    parser.add_argument("--gguf", metavar="KIND", help="only the decode rows on the default model as this "
                        "llama-quantize file type (e.g. Q4_K_M), kvserve against llama.cpp on that file")  # fmt: skip
    parser.add_argument("--prefill-speed", action="store_true", help="only print what `kvserve up` serves "
                        f"({DEFAULT_VARIANT}) prefills, in tokens/s at 2,048 tokens, as JSON")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-model", help=argparse.SUPPRESS)
    parser.add_argument("--worker-prefill-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill_speed:
        result = run_variant(DEFAULT_VARIANT, args.reps, args.timeout, ["--worker-prefill-only"], quiet=True)
        print(json.dumps({"variant": DEFAULT_VARIANT, "dtype": result.get("dtype"),
                          "tok_s": result["prefill"].get(2048), "error": result.get("error")}))  # fmt: skip
        return
    if args.worker and args.worker_model:
        kvserve_worker(args.worker, args.reps, args.worker_model, FILE_BATCHES, ())
        return
    if args.worker and args.worker_prefill_only:
        kvserve_worker(args.worker, args.reps, batches=(), prefill_lengths=(2048,))
        return
    if args.worker:
        (hf_worker if args.worker.startswith("hf-") else kvserve_worker)(args.worker, args.reps)
        return
    if args.gguf:
        if args.skip_llama:  # the rows are the comparison: without llama.cpp there is none to write
            parser.error("--gguf compares kvserve with llama.cpp on the file; --skip-llama cannot apply to it")
        gguf_rows(args.gguf, args.reps, args.timeout, Path(args.out), "python " + " ".join(sys.argv))
        return
    named = {"all": KVSERVE_VARIANTS + HF_VARIANTS, "none": []}
    variants = named[args.variants] if args.variants in named else args.variants.split(",")
    if args.skip_hf:
        variants = [v for v in variants if not v.startswith("hf-")]
    unknown = [v for v in variants if v not in KVSERVE_VARIANTS + HF_VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {KVSERVE_VARIANTS + HF_VARIANTS}")
    import torch

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    del torch
    results = [run_variant(v, args.reps, args.timeout) for v in variants]
    if not args.skip_llama:
        results.append(llama_cpp(args.reps))
    text = report(results, bandwidth, "python " + " ".join(sys.argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
