"""Errors shared across the library.

:class:`InputError` is the common base of the errors that bad params or bad input raise (the message
names the key or file, the value, and what to do); a stage reports them as one line, without a traceback
(:func:`pipelines._stage.run`). Any other exception is a bug and keeps its traceback.
"""


class InputError(Exception):
    """Bad params or bad input: the message says which value is wrong and what to do about it."""


class RecordError(InputError, ValueError):
    """One record cannot be processed; the reason is reported and the run goes on."""


class SourceError(InputError, ValueError):
    """A data source (QA pairs, articles, statements) cannot be read or holds no usable record."""
