"""The one error type a user sees as a single line (the CLI turns it into a message, never a traceback)."""


class UserError(ValueError):
    """A problem with what the user asked for: bad input, a mismatched model, a refused overwrite."""
