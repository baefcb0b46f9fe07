"""llama.cpp's llama-server on a GGUF file (the default model's unless told), as
bench/replay.py compares kvserve with it and the K-quant tests check kvserve's tokens
against it: started on a free port, healthy, then stopped."""

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from libs.engine.model.default_model import default_gguf_path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / ".cache" / "llama.cpp" / "bin" / "llama-server"
# bench/llama_cpp.sh builds without the AMX path on AMX CPUs (it crashes there), so llama-server
# runs with its repacked weights everywhere.
LLAMA_ARGS = ["-np", "4", "-kvu", "-t", "2", "--cache-reuse", "256", "--no-webui"]


@contextlib.contextmanager
def llama_server(
    log_path: Path, model: Path | None = None, args: list[str] = LLAMA_ARGS
) -> Iterator[tuple[str, dict[str, int]]]:
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run `make bench` (or bench/llama_cpp.sh) first")
    port = _free_port()
    model = model or default_gguf_path()
    cmd = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url + "/health", proc, timeout=120)
            yield url, {"llama-server": proc.pid}
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with code {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)  # polling with a deadline
    raise SystemExit(f"llama-server was not healthy within {timeout:g}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
