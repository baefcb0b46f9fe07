"""The launcher's log: whole lines written from many threads, each service's behind an
``[instance-id]`` label of one width, coloured by role on a terminal."""

import threading
from typing import TextIO

from libs.protocol.vocabulary import Role

_COLOURS = {Role.CONDUCTOR: "35", Role.STORE: "34", Role.PREFILL: "33", Role.DECODE: "32", Role.GATEWAY: "36",
            "kvserve": "1"}  # fmt: skip


class Console:
    """Writes to ``stream`` (nothing when it is None); ``labels`` fixes the label width."""

    def __init__(self, stream: TextIO | None, labels: list[str]) -> None:
        self._stream = stream
        self._colour = _isatty(stream)
        self._lock = threading.Lock()
        self._width = max(len(label) for label in labels) + 3  # "[" label "] "

    def echo(self, text: str, label: str | None = None) -> None:
        """Write ``text``, whole, between other lines; with ``label``, before each of its lines."""
        if self._stream is None:
            return
        if label is not None:
            text = "\n".join(self.prefix(label, label) + line for line in text.splitlines())
        with self._lock:
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # a closed or broken log must not stop the pipes draining
                pass

    def prefix(self, label: str, role: str) -> str:
        prefix = f"[{label}]".ljust(self._width)
        if self._colour:
            return f"\x1b[{_COLOURS.get(role, '0')}m{prefix}\x1b[0m"
        return prefix


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False
