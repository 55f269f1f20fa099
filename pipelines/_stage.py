"""What every stage's entry point shares: the ``--params`` option, logging, the raw params."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from detectors.config import read_params


def stage_params(description: str | None, argv: list[str] | None) -> dict[str, Any]:
    """Parse ``--params``, set up logging, and return the params file's sections (validated per section by the caller)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return read_params(args.params)
