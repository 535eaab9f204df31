"""``diloco link``: a shaped link in front of nats-server, reporting what crosses it.

The proxy (``services.link.proxy``) carries the clients' traffic; a connection of the link's
own, not shaped, puts a ``LinkStatus`` record under ``J.link.<name>`` in the status bucket
every ``--report-every-s`` and once more at the end. NATS being away only delays the reports:
the link carries on (and a client behind it reconnects through it when NATS is back).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.link.proxy import LinkCounters, LinkProxy
from services.link.settings import LinkSettings
from shared import kv, subjects
from shared.cancel import raise_if_cancelling
from shared.records.link import LinkStatus
from shared.retry import NATS_ERRORS, retry
from shared.transport.connection import connect_with_retry
from shared.transport.streams import prepare_streams

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


def link_status(settings: LinkSettings, counters: LinkCounters) -> LinkStatus:
    """The status record of a link from its counters."""
    return LinkStatus(
        name=settings.name,
        spec=settings.link_spec(),
        bytes_up=counters.bytes_up,
        bytes_down=counters.bytes_down,
        busy_up_s=counters.busy_up_s,
        busy_down_s=counters.busy_down_s,
        uptime_s=counters.uptime_s,
        connections=counters.connections,
        connects=counters.connects,
        outage=counters.outage,
        outages=counters.outages,
    )


async def run_link(settings: LinkSettings, stop: asyncio.Event) -> None:
    """Carry the link until ``stop`` is set."""
    (host, port), *fallbacks = settings.upstreams()
    proxy = LinkProxy(
        settings.link_spec(),
        host,
        port,
        settings.listen_host,
        settings.listen_port,
        settings.seed,
        fallbacks,
    )
    listening = await proxy.start()
    log.info(
        "link %s of job %s: %s:%d → %s:%d, %s",
        settings.name,
        settings.job,
        settings.listen_host,
        listening,
        host,
        port,
        settings.link_spec().text(),
    )
    tasks = [
        asyncio.create_task(proxy.run_outages(settings.outage_schedule())),
        asyncio.create_task(_report(settings, proxy, stop)),
    ]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await proxy.close()


async def _report(settings: LinkSettings, proxy: LinkProxy, stop: asyncio.Event) -> None:
    nc = await connect_with_retry(
        settings, f"link-{settings.job}-{settings.name}", stopping=stop.is_set
    )
    if nc is None:
        return
    key = subjects.link_status_key(settings.job, settings.name)
    bucket: Any = None
    try:
        js = nc.jetstream()
        await retry(lambda: prepare_streams(js, settings), "create streams")
        bucket = await retry(lambda: js.key_value(subjects.STATUS_BUCKET), "open status bucket")
        while True:
            raise_if_cancelling()
            try:
                await kv.put(bucket, key, link_status(settings, proxy.counters()))
            except NATS_ERRORS as err:
                log.warning("link status not written: %s", err)
            await asyncio.sleep(settings.report_every_s)
    finally:
        # The last counters (the link stops after this), then close.
        if bucket is not None:
            try:
                final = link_status(settings, proxy.counters())
                await asyncio.wait_for(kv.put(bucket, key, final), CLOSE_TIMEOUT_S)
            except NATS_ERRORS as err:
                log.warning("last link status not written: %s", err)
        try:
            await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
        except NATS_ERRORS as err:
            log.warning("closing NATS: %s", err)
