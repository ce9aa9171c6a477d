"""Errors that reach the user as one line and exit code 2 (no traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, paths). The CLI prints `error: <message>` and exits 2."""


class ConfigError(UserError):
    """A bad config key or value; the message names the key."""


class DataError(UserError):
    """A bad data file or row; the message names the file, the row (1-based) and the field."""

    def __init__(
        self, message: str, *, file: str | None = None, row: int | None = None, field: str | None = None
    ):
        where = []
        if file is not None:
            where.append(str(file))
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        self.file, self.row, self.field = file, row, field
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class NonFiniteError(UserError):
    """NaN or inf in a training run (scores, log-probs, values, the loss or the gradients); the message
    names the step and the phase. Raised on every process at once, before the failing minibatch updates
    anything and before the PPO step's KL update, step count and checkpoint; in the train phase, earlier
    minibatches of the same PPO step may already have updated the weights, and the message says how many
    optimiser steps did (`llm_rlhf.ppo.update.what_was_updated`)."""
