"""Connecting to NATS: as a user, over TLS, reconnecting forever; the first connection retried."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from shared import nats_auth
from shared.retry import retry
from shared.settings.nats import NatsSettings
from shared.transport import TransportError

log = logging.getLogger(__name__)

# nats-py waits a fixed time between reconnect attempts; each client draws its own from this
# range, so that after a server restart the clients do not all reconnect at the same moments.
RECONNECT_WAIT_S = (0.5, 1.5)

AUTHORIZATION_VIOLATION = "authorization violation"

NATS_CONNECT_ERRORS = (TimeoutError, OSError, nats.errors.Error)


async def connect(settings: NatsSettings, name: str, **callbacks: Callable[..., Any]) -> NatsClient:
    """Connect to NATS with reconnect-forever and logged errors.

    With ``settings.nats_credentials`` it connects as that user, with the user's own inbox
    prefix (``shared.nats_auth``); with ``settings.nats_ca_file`` over TLS, verifying the
    server's certificate against that CA (``shared.tls``).

    Args:
        settings: connection settings.
        name: client name shown in the server's connection list.
        **callbacks: optional nats-py callbacks (``disconnected_cb``, ``reconnected_cb``, ...).

    Raises:
        TransportError: when the first connection cannot be made within the connect timeout
            (a refused user or password included).
        nats_auth.CredentialsError: the credentials file cannot be used.
    """

    async def log_error(err: Exception) -> None:
        # Denied publishes and other server-side errors only surface here.
        log.warning("nats error (%s): %s", name, err)

    report = callbacks.pop("error_cb", log_error)
    refused = asyncio.Event()

    async def error_cb(err: Exception) -> None:
        # nats-py retries a refused user forever, even on its first connection.
        if AUTHORIZATION_VIOLATION in str(err).lower():
            refused.set()
        await report(err)

    credentials = settings.credentials()
    identity: dict[str, Any] = {}
    if credentials is not None:
        identity = {
            "user": credentials.user,
            "password": credentials.password,
            "inbox_prefix": nats_auth.inbox_prefix(credentials.user),
        }
    if settings.nats_ca_file is not None:
        from shared import tls  # X.509 only where TLS is asked for

        identity["tls"] = tls.client_context(settings.nats_ca_file)
        if settings.nats_tls_hostname is not None:
            identity["tls_hostname"] = settings.nats_tls_hostname
    connecting = asyncio.ensure_future(
        nats.connect(
            servers=settings.nats_servers(),
            name=name,
            **identity,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=random.uniform(*RECONNECT_WAIT_S),
            allow_reconnect=True,
            error_cb=error_cb,
            **callbacks,
        )
    )
    watching = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({connecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, *NATS_CONNECT_ERRORS):
            await connecting
        who = f"user {credentials.user}" if credentials is not None else "no user"
        raise TransportError(
            f"NATS at {settings.nats_url} refused the connection ({who}): Authorization Violation"
        )
    try:
        return connecting.result()
    except NATS_CONNECT_ERRORS as err:
        raise TransportError(f"cannot connect to NATS at {settings.nats_url}: {err}") from err


async def connect_with_retry(
    settings: NatsSettings,
    name: str,
    stopping: Callable[[], bool],
    on_error: Callable[[str], None] | None = None,
    **callbacks: Callable[..., Any],
) -> NatsClient | None:
    """``connect``, retried (``shared.retry``) until it works or ``stopping()``.

    Returns:
        The connection, or None if ``stopping()`` became true first.
    """
    try:
        return await retry(
            lambda: connect(settings, name, **dict(callbacks)),
            f"connect to NATS as {name}",
            on=(TransportError,),
            stopping=stopping,
            on_error=on_error,
        )
    except TransportError:
        return None
