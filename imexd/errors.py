"""The error tree of imexd.

Foreign exceptions (OSError, aiomqtt.MqttError, msgspec errors, psutil errors) are
translated at the boundary that meets them (`raise XError(...) from exc`) so the core
only ever handles these classes.
"""

from __future__ import annotations


class ImexdError(Exception):
    """Base class of every error imexd raises on purpose."""


class ConfigError(ImexdError):
    """Settings are invalid; `problems` holds one line per wrong key.

    The CLI prints every line and exits 2.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  " + "\n  ".join(self.problems))


class RetryableError(ImexdError):
    """A failure that the caller retries with backoff (file write, broker, probe)."""


class FatalError(ImexdError):
    """A failure that ends the agent with a non-zero exit."""


class FileWriteError(RetryableError):
    """A file could not be written; the previous file is left intact."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason}")


class BusError(RetryableError):
    """The message bus is unreachable or the connection was lost."""


class ProbeError(RetryableError):
    """`nvidia-imex-ctl` failed, timed out or printed something unparsable."""


class ParseError(ImexdError):
    """Input (ctl output, a member file, a bus payload) has the wrong shape."""


class DiscoveryError(ImexdError):
    """GPU fabric discovery through NVML failed; the message says what to set instead."""
