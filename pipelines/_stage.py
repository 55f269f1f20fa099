"""What every stage's entry point shares: the ``--params`` option, logging, and the declared params."""

from __future__ import annotations

import argparse
import logging
from typing import Iterable

from detectors.config import StageParams, read_params


def stage_params(description: str | None, argv: list[str] | None, reads: Iterable[str], stage: str) -> StageParams:
    """Parse ``--params``, set up logging, and return the params the stage declared (``READS``), validated.

    ``reads`` must equal the stage's ``params`` in ``dvc.yaml`` (tests/test_dag.py checks it), so DVC
    reruns a stage exactly when a value it reads changes.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return StageParams(read_params(args.params), reads, stage)
