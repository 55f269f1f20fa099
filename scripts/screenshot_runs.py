"""Screenshot of the comparison as a user sees it in the MLflow UI: ``dynrag screenshot`` (:mod:`detectors.cli`,
:func:`detectors.mlflow_ui.screenshot`), kept under its old name. Needs Debian's ``chromium`` (``apt-get install -y
chromium``). Usage: ``python scripts/screenshot_runs.py [--dataset early|realtime] [--params params.yaml] [--out PNG]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from detectors.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["screenshot", *sys.argv[1:]], prog="scripts/screenshot_runs.py"))
