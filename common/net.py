"""The network bits every launcher shares."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now: the kernel's pick for port 0. Another process may take it before the caller
    binds it (the usual race of this idiom), so a rendezvous that fails on it should be retried on a new port."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
