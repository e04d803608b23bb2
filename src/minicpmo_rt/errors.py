"""Error types shared by every package.

Each error names the input, says what is wrong with it and what to do; the CLI
turns them into a one-line message and a non-zero exit status.
"""


class MiniCPMORTError(Exception):
    """Base class of every error the runtime raises on purpose."""


class InputError(MiniCPMORTError, ValueError):
    """A user-supplied input (file, flag, tensor) is invalid."""


class CheckpointError(MiniCPMORTError):
    """A snapshot directory, config or weight file cannot be used."""


class StrictLoadError(CheckpointError):
    """Weights do not match the model's keys and shapes (lists every difference)."""
