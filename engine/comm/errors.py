"""The communicator's one error type: a failure that stops training, with a one-line message."""
from __future__ import annotations


class CommError(RuntimeError):
    """A communication or launch failure; the message names the peer (host:port) and the cause."""
