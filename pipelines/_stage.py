"""What every stage's entry point shares: the ``--params`` option, logging, the declared params, and how
a stage stops on bad params or bad input (:func:`run`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterable

from detectors.config import StageParams, read_params
from detectors.errors import InputError, one_line, traceback_wanted


def stage_params(
    description: str | None, argv: list[str] | None, reads: Iterable[str], stage: str, foreach: str | None = None
) -> StageParams:
    """Parse ``--params``, set up logging, and return the params the stage declared (``READS``), validated.

    ``reads`` is the stage's ``params`` in ``dvc.yaml`` (``python -m pipelines._provenance`` writes them from it), so
    DVC reruns a stage exactly when a value it reads changes. A stage run once per key of the params table ``foreach``
    (its ``FOREACH``: ``dvc.yaml`` runs it with ``--item <key>``) finds the keys given in ``items`` (empty: all).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    if foreach:
        parser.add_argument("--item", action="append", default=[], help=f"a key of {foreach} (default: every key)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    params = StageParams(read_params(args.params), reads, stage)
    params.items = list(getattr(args, "item", []))
    return params


def run(main: Callable[[], None]) -> None:
    """Run a stage's ``main`` from the command line (``if __name__ == "__main__": run(main)``).

    Bad params or bad input (:class:`~detectors.errors.InputError`: the message names the key or file, the
    value and what to do) end the stage with that message as one line on stderr and exit status 1, without
    a traceback; ``DETECTORS_TRACEBACK=1`` shows the traceback too. Any other error keeps its traceback.
    """
    try:
        main()
    except InputError as err:
        if traceback_wanted():
            raise
        print(one_line(err), file=sys.stderr)
        raise SystemExit(1) from None
