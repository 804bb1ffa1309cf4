"""The one base class of errors a user can fix (a bad file, field, flag or environment).

The CLI prints these as one message, without a traceback; anything else is a bug and keeps its
traceback. Every layer may raise a subclass, so it lives at the bottom.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input or environment; its message says what and where."""

    # The CLI's exit status for it: 2, a usage or input error; a subclass that reports a run that
    # failed (not one the user asked for wrongly) says 1.
    exit_status = 2
