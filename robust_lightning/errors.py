"""User-facing errors.

A ``UserError`` means the input (a path, a config value, a checkpoint) is wrong, not the code: the CLI prints
its message alone, without a traceback, and exits with status 2.
"""


class UserError(Exception):
    """Bad input that the user can fix; the message names the problem and what was expected."""
