"""Native kernels: small C sources compiled once with the system C compiler and
loaded with ctypes, for the few loops PyTorch cannot express without copies.

Compiled on first use into the cache directory (keyed by the source's hash and
the compiler flags), under a file lock so concurrent workers compile once. If
there is no compiler, or KVSERVE_NATIVE_KERNELS=0, callers get None and use
their PyTorch path: the kernels are an optimisation, never a requirement.
"""

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from libs.common.settings import ProcessSettings

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "kernels"
# The reassociation -ffast-math would allow (vectorised sums), without -ffast-math itself:
# that links crtfastmath.o, whose constructor flushes subnormal floats to zero for the
# whole process that loads the library, not just this kernel.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]  # fmt: skip


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled library for ``kernels/<name>.c``, or None when it cannot be had."""
    settings = ProcessSettings.from_env()
    if not settings.native_kernels:
        return None
    compiler = shutil.which(settings.compiler)
    if compiler is None:
        log.info("no C compiler: native %s kernel disabled, using PyTorch", name)
        return None
    try:
        source = (SOURCES / f"{name}.c").read_bytes()
    except OSError as e:  # an install without the sources
        log.warning("native %s kernel source missing (using PyTorch): %s", name, e)
        return None
    headers = b"".join(path.read_bytes() for path in sorted(SOURCES.glob("*.h")))  # what the sources include
    digest = hashlib.blake2b(source + headers + " ".join(FLAGS).encode(), digest_size=8).hexdigest()
    target = settings.cache_dir / "kernels" / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                tmp = target.with_suffix(f".tmp{os.getpid()}")
                result = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCES / f"{name}.c"), "-lm"],
                                        capture_output=True, text=True)  # fmt: skip
                if result.returncode != 0:
                    log.warning("cannot compile the native %s kernel (using PyTorch): %s", name, result.stderr[-500:])
                    return None
                os.rename(tmp, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        log.warning("cannot load the native %s kernel (using PyTorch): %s", name, e)
        return None
