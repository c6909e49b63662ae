"""Errors a user can fix. The command line prints these in one line, without a traceback.

Any other exception that escapes a command is a bug in sparserl or below it (torch, transformers),
and keeps its traceback so that it can be reported.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix: a flag, a config or data file, a model directory, a run directory.

    The message names what is wrong and what to do. A ValueError, so code that caught the library's
    ValueErrors before still catches these.
    """


class ConfigError(UserError):
    """A configuration value that cannot be used; the message names the key and what is allowed."""


class DataError(UserError):
    """A data file that cannot be used; the message names the file, the line and the problem."""
