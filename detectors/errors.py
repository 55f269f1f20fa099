"""Errors shared across the library."""


class RecordError(ValueError):
    """One record cannot be processed; the reason is reported and the run goes on."""


class SourceError(ValueError):
    """A data source (QA pairs, articles, statements) cannot be read or holds no usable record."""
