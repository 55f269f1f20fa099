"""Progress bars write a few lines to a log file, not one per item, and stay live on a terminal."""

from __future__ import annotations

import io
import sys
import time

from detectors.progress import progress


def updates(text: str) -> list[str]:
    """The states a bar wrote (tqdm separates them by carriage returns)."""
    return [s.strip() for s in text.replace("\n", "\r").split("\r") if s.strip()]


def quick_loop(n: int = 400) -> None:
    for _ in progress(range(n), desc="items", unit="item"):
        time.sleep(0.002)  # about 1 s in all: tqdm's default would refresh ~10 times a second


def test_a_bar_on_a_log_file_writes_its_first_and_last_state_only(tmp_path, monkeypatch):
    log = tmp_path / "stage.log"
    with open(log, "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        quick_loop()
        with progress(total=300, initial=100, desc="shards", unit="row") as bar:
            for _ in range(200):
                bar.update(1)
                time.sleep(0.002)
    text = log.read_text()
    assert "\r" not in text  # whole lines in a log
    lines = updates(text)
    assert len(lines) == 4, lines
    assert lines[1].startswith("items: 100%") and "400/400" in lines[1]
    assert lines[2].startswith("shards:  33%") and "100/300" in lines[2] and "300/300" in lines[3]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_refreshes_as_usual(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    quick_loop()
    assert len(updates(terminal.getvalue())) > 5
