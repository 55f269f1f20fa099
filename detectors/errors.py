"""Errors shared across the library.

:class:`InputError` is the common base of the errors that bad params or bad input raise (the message
names the key or file, the value, and what to do); a stage (:func:`pipelines._stage.run`) and the ``dynrag``
command line report them as one line (:func:`one_line`), without a traceback unless :data:`TRACEBACK_ENV` asks
for it (:func:`traceback_wanted`). Any other exception is a bug and keeps its traceback.
"""

import os

TRACEBACK_ENV = "DETECTORS_TRACEBACK"  # set to anything but "" or "0": an input error shows its traceback too


class InputError(Exception):
    """Bad params or bad input: the message says which value is wrong and what to do about it."""


class RecordError(InputError, ValueError):
    """One record cannot be processed; the reason is reported and the run goes on."""


class SourceError(InputError, ValueError):
    """A data source (QA pairs, articles, statements) cannot be read or holds no usable record."""


def traceback_wanted() -> bool:
    """Whether ``$DETECTORS_TRACEBACK`` asks for an input error's traceback (the caller re-raises it)."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def one_line(err: BaseException) -> str:
    """How an input error is reported: ``<type>: <message, its lines joined> (set DETECTORS_TRACEBACK=1 for the
    traceback)``."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {message} (set {TRACEBACK_ENV}=1 for the traceback)"
