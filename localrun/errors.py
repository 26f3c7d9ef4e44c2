"""Errors a user can cause. The CLI prints the message as one sentence and exits with code 2."""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (file, flag, request), explained in one sentence."""


class ContextLengthExceeded(UserError):
    """A prompt (field "prompt" or "messages") or a reply (field "max_tokens") that the
    context cannot hold."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class OptionError(UserError):
    """A bad value of one option, in a sentence that starts with the option's name (an
    EngineConfig field such as kv_budget_bytes, a sampling field such as top_p). A front end
    that calls the option otherwise (the CLI's --kv-budget) says it its own way with `named`."""

    def __init__(self, option: str, message: str):
        assert message.startswith(option), (option, message)
        super().__init__(message)
        self.option = option

    def named(self, name: str) -> OptionError:
        """The same sentence about the option called `name`."""
        return OptionError(name, name + str(self)[len(self.option):])
