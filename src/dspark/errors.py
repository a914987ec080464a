"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class DsparkError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""
