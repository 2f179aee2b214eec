"""What the ``ckpt`` verbs share: the usage error, ``-o key=value`` parsing, the terminal test,
the progress bar and byte sizes as text.

Separate from :mod:`ckptcore.cli` (the parser and ``main``) so that the verb modules
(:mod:`ckptcore._cli_read`, :mod:`ckptcore._cli_files`) can use these without importing ``cli``,
which imports them: the names are public because other modules import them.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from . import _io


class UsageExit(SystemExit):
    """A usage error found after argparse: exit 2 as argparse's own (the README's "the arguments
    are wrong"), the message already printed on stderr; ``str()`` is the message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def usage_error(message: str) -> UsageExit:
    print(message, file=sys.stderr)
    return UsageExit(message)


def parse_options(pairs: Sequence[str] | None,
                  option: str = "--storage-option/-o") -> dict[str, Any]:
    """``key=value`` pairs as storage options; values parse as JSON when they can."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise usage_error(f"ckpt: {option} expects key=value (e.g. -o anon=true), "
                              f"got {pair!r}")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        node = out
        *parents, leaf = key.split(".")  # client_kwargs.endpoint_url=... nests
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parsed
    return out


def is_tty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a ``\r`` progress bar belongs there, not in a log file)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = is_tty(sys.stderr) and total > (64 << 20)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.enabled:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%}")
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        self._token = _io.progress.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _io.progress.reset(self._token)
        if self.enabled:
            sys.stderr.write("\n")


def size_text(n: int) -> str:
    """A byte count as text: ``512 B``, ``1.5 KiB`` ... ``3.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
