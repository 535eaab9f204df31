"""JetStream in memory: the streams, what a publish to a stream's subject does, the acks, and
the ``$JS.API`` requests nats-py makes, answered in the server's JSON.

nats-py's own ``JetStreamContext``, ``KeyValue`` and ``PullSubscription`` talk to this exactly
as to nats-server, so their errors (``NotFoundError``, ``KeyWrongLastSequenceError``,
``APIError`` with its ``code`` and ``err_code``, ...) are the ones nats-py raises. Answers
follow the JetStream API reference (docs.nats.io, "JetStream wire API reference") and the
server's error table (``server/errors.json``).

Simplified: one account, no domains, no clustering; the API answers the requests this project
and nats-py's KV make (stream create, update, info, names, list, delete, purge, message get and
delete, direct get; consumer create, info, names, delete, next; account info). Any other
``$JS.API`` request is answered ``400``; a direct get from a stream without ``allow_direct``
gets no responder, as on the server.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any, Final, Literal

from tests.memory_nats import consumers, headers
from tests.memory_nats.consumers import PullConsumer, Send
from tests.memory_nats.streams import ApiError, StoredMessage, Stream, iso
from tests.memory_nats.subjects import is_valid, matches, overlap

API_PREFIX = "$JS.API."
ACK_PREFIX = "$JS.ACK."

#: A request whose answer comes later (a pull request's messages).
LATER: Final = "later"

#: An answer to a request: ``(header block, data)``, :data:`LATER`, or None when nothing
#: answers (the requester then gets "no responders").
Answer = tuple[bytes, bytes] | Literal["later"] | None

STREAM_NOT_FOUND = ApiError(404, 10059, "stream not found")
CONSUMER_NOT_FOUND = ApiError(404, 10014, "consumer not found")
NO_MESSAGE = ApiError(404, 10037, "no message found")


def _json(body: dict[str, Any]) -> tuple[bytes, bytes]:
    return b"", json.dumps(body).encode()


def _error(err: ApiError) -> tuple[bytes, bytes]:
    return _json({"error": err.as_json()})


def _request(data: bytes) -> dict[str, Any]:
    if not data.strip():
        return {}
    try:
        found = json.loads(data)
    except ValueError:
        raise ApiError(400, 10025, "invalid JSON") from None
    return found if isinstance(found, dict) else {}


class JetStream:
    """Every stream and consumer of the broker.

    ``send`` delivers a message to subscribers (``consumers.Send``); ``has_interest(subject)``
    says whether anyone subscribes to a subject.
    """

    def __init__(self, send: Send, has_interest: Callable[[str], bool]) -> None:
        self.send = send
        self.has_interest = has_interest
        self.streams: dict[str, Stream] = {}
        self._handlers: dict[tuple[str, ...], Callable[[list[str], dict[str, Any]], Any]] = {
            ("INFO",): self._account_info,
            ("STREAM", "CREATE"): self._create_stream,
            ("STREAM", "UPDATE"): self._update_stream,
            ("STREAM", "INFO"): self._stream_info,
            ("STREAM", "DELETE"): self._delete_stream,
            ("STREAM", "PURGE"): self._purge_stream,
            ("STREAM", "NAMES"): self._stream_names,
            ("STREAM", "LIST"): self._stream_list,
            ("STREAM", "MSG"): self._stream_msg,
            ("CONSUMER", "CREATE"): self._create_consumer,
            ("CONSUMER", "DURABLE"): self._create_consumer,
            ("CONSUMER", "INFO"): self._consumer_info,
            ("CONSUMER", "DELETE"): self._delete_consumer,
            ("CONSUMER", "NAMES"): self._consumer_names,
        }

    # ---- publishes and acks ---------------------------------------------------------------

    def stream_for(self, subject: str) -> Stream | None:
        """The stream that captures ``subject`` (at most one: subjects never overlap)."""
        if subject.startswith(("$JS.", "_INBOX.")):
            return None
        for stream in self.streams.values():
            if any(matches(pattern, subject) for pattern in stream.config["subjects"]):
                return stream
        return None

    def capture(self, stream: Stream, subject: str, header_block: bytes, data: bytes) -> bytes:
        """Store a publish in ``stream``; returns the ack (a ``PubAck`` or an error) as JSON."""
        try:
            seq, duplicate = stream.store(subject, header_block, data)
        except ApiError as err:
            return json.dumps({"error": err.as_json(), "stream": stream.name}).encode()
        ack: dict[str, Any] = {"stream": stream.name, "seq": seq}
        if duplicate:
            ack["duplicate"] = True
        return json.dumps(ack).encode()

    def acknowledge(self, subject: str, data: bytes) -> bool:
        """An ack to ``$JS.ACK.<stream>.<consumer>.<n>.<stream seq>...``; False if no such
        consumer (the server then has no responder either)."""
        tokens = subject.split(".")
        if len(tokens) < 9:
            return False
        stream = self.streams.get(tokens[2])
        consumer = stream.listeners.get(tokens[3]) if stream is not None else None
        if not isinstance(consumer, PullConsumer):
            return False
        consumer.acknowledge(int(tokens[5]), data)
        return True

    def drop_requests(self) -> None:
        """The broker lost every connection: forget their pull requests."""
        for stream in self.streams.values():
            for consumer in stream.listeners.values():
                if isinstance(consumer, PullConsumer):
                    consumer.drop_requests()

    # ---- the API --------------------------------------------------------------------------

    def api(self, subject: str, reply: str, data: bytes) -> Answer:
        """Answer a ``$JS.API`` request (see :data:`Answer`)."""
        tokens = subject[len(API_PREFIX) :].split(".")
        try:
            if tokens[0] == "DIRECT" and tokens[1:2] == ["GET"]:
                return self._direct_get(tokens[2], ".".join(tokens[3:]), data)
            if tokens[:3] == ["CONSUMER", "MSG", "NEXT"]:
                return self._next(tokens[3], tokens[4], reply, data)
            handler = self._handlers.get(tuple(tokens[:2])) or self._handlers.get((tokens[0],))
            if handler is None:
                raise ApiError(400, 10003, f"unknown API request {subject}")
            return _json(handler(tokens, _request(data)))
        except ApiError as err:
            return _error(err)

    def stream(self, name: str) -> Stream:
        found = self.streams.get(name)
        if found is None:
            raise STREAM_NOT_FOUND
        return found

    def _account_info(self, _tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        consumers = sum(len(s.listeners) for s in self.streams.values())
        return {
            "memory": 0,
            "storage": sum(s.state()["bytes"] for s in self.streams.values()),
            "streams": len(self.streams),
            "consumers": consumers,
            "limits": {"max_memory": -1, "max_storage": -1, "max_streams": -1},
            "api": {"level": 1, "total": 0, "errors": 0},
        }

    def _checked_config(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("name") not in (None, name):
            raise ApiError(400, 10056, "stream name in subject does not match request")
        config = {**config, "name": name}
        config["subjects"] = list(config.get("subjects") or [name])
        for pattern in config["subjects"]:
            if not is_valid(pattern, wildcards=True):
                raise ApiError(400, 10052, f"invalid subject {pattern!r}")
        for other in self.streams.values():
            if other.name != name and any(
                overlap(a, b) for a in config["subjects"] for b in other.config["subjects"]
            ):
                raise ApiError(400, 10065, "subjects overlap with an existing stream")
        return config

    def _create_stream(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        name = tokens[2]
        config = self._checked_config(name, request)
        existing = self.streams.get(name)
        if existing is not None:
            if Stream(config).config != existing.config:
                raise ApiError(
                    400, 10058, "stream name already in use with a different configuration"
                )
            return existing.info()
        self.streams[name] = Stream(config)
        return {**self.streams[name].info(), "did_create": True}

    def _update_stream(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        stream = self.stream(tokens[2])
        stream.update(self._checked_config(stream.name, request))
        return stream.info()

    def _stream_info(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        return self.stream(tokens[2]).info(request.get("subjects_filter"))

    def _delete_stream(self, tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        stream = self.stream(tokens[2])
        for consumer in stream.listeners.values():
            if isinstance(consumer, PullConsumer):
                consumer.stop()
        del self.streams[stream.name]
        return {"success": True}

    def _purge_stream(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        stream = self.stream(tokens[2])
        purged = stream.purge(
            request.get("filter") or None,
            keep=int(request.get("keep") or 0),
            below_seq=int(request.get("seq") or 0),
        )
        return {"success": True, "purged": purged}

    def _stream_names(self, _tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        subject = request.get("subject")
        names = sorted(
            name
            for name, stream in self.streams.items()
            if not subject or any(overlap(subject, p) for p in stream.config["subjects"])
        )
        return {"streams": names, "total": len(names), "offset": 0, "limit": 1024}

    def _stream_list(self, _tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        infos = [self.streams[name].info() for name in sorted(self.streams)]
        return {"streams": infos, "total": len(infos), "offset": 0, "limit": 256}

    def _stream_msg(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        stream = self.stream(tokens[3])
        if tokens[2] == "DELETE":
            if not stream.remove(int(request.get("seq") or 0)):
                raise NO_MESSAGE
            return {"success": True}
        message = self._find(stream, request)
        if message is None:
            raise NO_MESSAGE
        body: dict[str, Any] = {
            "subject": message.subject,
            "seq": message.seq,
            "data": base64.b64encode(message.data).decode(),
            "time": iso(message.time_ns),
        }
        if message.header_block:
            body["hdrs"] = base64.b64encode(message.header_block).decode()
        return {"message": body}

    @staticmethod
    def _find(stream: Stream, request: dict[str, Any]) -> StoredMessage | None:
        if request.get("last_by_subj"):
            return stream.last(request["last_by_subj"])
        if request.get("next_by_subj"):
            return stream.next_from(int(request.get("seq") or 0), request["next_by_subj"])
        return stream.get(int(request.get("seq") or 0))

    def _direct_get(self, name: str, last_by_subject: str, data: bytes) -> Answer:
        stream = self.streams.get(name)
        if stream is None or not stream.config["allow_direct"]:
            return None  # nothing listens on that stream's direct-get subject
        request = {"last_by_subj": last_by_subject} if last_by_subject else _request(data)
        message = self._find(stream, request)
        if message is None:
            return headers.status(404, "Message Not Found"), b""
        pairs = headers.parse(message.header_block) if message.header_block else []
        pairs += [
            ("Nats-Stream", stream.name),
            ("Nats-Subject", message.subject),
            ("Nats-Sequence", str(message.seq)),
            ("Nats-Time-Stamp", iso(message.time_ns)),
        ]
        return headers.encode(pairs), message.data

    # ---- consumers ------------------------------------------------------------------------

    def consumer(self, stream_name: str, name: str) -> PullConsumer:
        found = self.stream(stream_name).listeners.get(name)
        if not isinstance(found, PullConsumer):
            raise CONSUMER_NOT_FOUND
        return found

    def _create_consumer(self, tokens: list[str], request: dict[str, Any]) -> dict[str, Any]:
        # CONSUMER.CREATE.<stream>[.<name>[.<filter>]] or CONSUMER.DURABLE.CREATE.<stream>.<name>
        durable = tokens[1] == "DURABLE"
        stream = self.stream(tokens[3] if durable else tokens[2])
        config = dict(request.get("config") or {})
        named = tokens[4] if durable else (tokens[3] if len(tokens) > 3 else None)
        name = named or config.get("name") or config.get("durable_name")
        if not name:
            name = f"memory{time.monotonic_ns()}"
        if config.get("filter_subject") and not any(
            overlap(config["filter_subject"], p) for p in stream.config["subjects"]
        ):
            raise ApiError(400, 10093, "consumer filter subject is not a valid subset of stream")
        existing = stream.listeners.get(name)
        if isinstance(existing, PullConsumer):
            wanted = {**consumers.DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
            if request.get("action") == "create" and wanted != existing.config:
                raise ApiError(400, 10148, "consumer already exists")
            existing.configure(config)  # create-or-update keeps the delivery state
            return existing.info()
        consumer = PullConsumer(stream, name, config, self.send, self.has_interest)
        stream.listeners[name] = consumer
        return consumer.info()

    def _consumer_info(self, tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        return self.consumer(tokens[2], tokens[3]).info()

    def _delete_consumer(self, tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        consumer = self.consumer(tokens[2], tokens[3])
        consumer.stop()
        del consumer.stream.listeners[consumer.name]
        return {"success": True}

    def _consumer_names(self, tokens: list[str], _request: dict[str, Any]) -> dict[str, Any]:
        names = sorted(self.stream(tokens[2]).listeners)
        return {"consumers": names, "total": len(names), "offset": 0, "limit": 1024}

    def _next(self, stream_name: str, name: str, reply: str, data: bytes) -> Answer:
        """A pull request; its messages (or its end) go to ``reply`` later."""
        stream = self.streams.get(stream_name)
        consumer = stream.listeners.get(name) if stream is not None else None
        if not isinstance(consumer, PullConsumer) or not reply:
            return None  # the server has no responder for a consumer that does not exist
        text = data.strip()
        request = {"batch": int(text)} if text.isdigit() else _request(data)
        consumer.request(
            reply,
            int(request.get("batch") or 1),
            int(request.get("expires") or 0),
            bool(request.get("no_wait")),
        )
        return LATER
