"""Dead letters: a rejected message copied to its job's dead-letter subject with the reason."""

from __future__ import annotations

from typing import Any

from nats.js import JetStreamContext

from shared import subjects
from shared.transport.blobs import PUBLISH_TIMEOUT_S

HEADER_REASON = "Diloco-Reason"

HEADER_SUBJECT = "Diloco-Subject"


async def dead_letter(js: JetStreamContext, job: str, reason: str, msg: Any) -> None:
    """Copy a rejected message to the job's dead-letter subject, with the reason in a header.

    The copy keeps the original data and headers and adds ``Diloco-Reason`` and
    ``Diloco-Subject``; its ``Nats-Msg-Id`` is derived from the original's, so a copy made
    again after a crash is deduplicated.

    Raises:
        TimeoutError, nats.errors.Error: when it cannot be stored (the caller retries later,
            since the original is only terminated after its copy is stored).
    """
    headers = {k: v for k, v in (msg.headers or {}).items() if isinstance(v, str)}
    original_id = headers.get("Nats-Msg-Id")
    if original_id is None:
        try:
            original_id = f"seq:{msg.metadata.sequence.stream}"
        except (AttributeError, ValueError):
            original_id = f"seq:{id(msg)}"
    headers.update(
        {
            HEADER_REASON: reason[:1000].replace("\r", " ").replace("\n", " "),
            HEADER_SUBJECT: msg.subject,
            "Nats-Msg-Id": f"dead:{original_id}",
        }
    )
    await js.publish(
        subjects.dead_letter_subject(job), msg.data, headers=headers, timeout=PUBLISH_TIMEOUT_S
    )
