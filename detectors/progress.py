"""Progress bars: live on a terminal, a line every :data:`LOG_INTERVAL` seconds in a log file.

tqdm's default (a refresh every 0.1 s) suits a terminal, but when stderr goes to a file (``dvc repro >
log``, a batch job) it writes one update per item: hundreds of carriage-return separated states on one
line that bury the log messages. There, a bar writes whole lines instead, at most one per interval.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

LOG_INTERVAL = 10.0  # seconds between two updates of a bar when stderr is not a terminal


class _Lines:
    """A log stream for tqdm: each state it draws becomes one line (no carriage returns)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    initial: int = 0,
    desc: str | None = None,
    unit: str = "it",
    disable: bool = False,
) -> tqdm:
    """A tqdm bar on stderr (iterate over it, or ``update`` it in a ``with`` block): refreshed as usual on a
    terminal; otherwise one line at most every :data:`LOG_INTERVAL` seconds, plus its first and last state."""
    stream = sys.stderr
    interactive = stream is not None and hasattr(stream, "isatty") and stream.isatty()
    # maxinterval too: tqdm's monitor thread would otherwise force a refresh every 10 s
    pace = {} if interactive else {"mininterval": LOG_INTERVAL, "maxinterval": LOG_INTERVAL}
    file = stream if interactive else _Lines(stream)
    return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=disable, file=file, **pace)
