"""Errors the ``python -m kvserve.loadtest`` commands report as usage errors (one line, exit status 2)."""


class UsageError(Exception):
    """A command-line flag names something that is not there: a device, a model directory."""
