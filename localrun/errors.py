"""Errors a user can cause. The CLI prints the message as one sentence and exits with code 2."""


class UserError(Exception):
    """A problem with the user's input (file, flag, request), explained in one sentence."""
