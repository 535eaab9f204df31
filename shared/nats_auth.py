"""Who may do what on NATS: the identities of a cluster and their subject permissions.

Every process connects as a user of one *role* (docs/SECURITY.md):

* ``admin`` — ``diloco up`` itself (or an operator): everything, including creating streams;
* ``outer`` of job J — consume J's uploads through its own durable consumer, publish J's params,
  checkpoints and dead letters, write its status and lease;
* ``gateway`` — read every record, write desired states and jobs;
* ``learner`` u of job J — publish its own grads subject and its own status key, read J's
  params and its own desired state, read J's statuses;
* ``link`` of job J — write its own link status key.

A user's permissions list what it may publish and subscribe to; everything else is refused by
nats-server (a publish is dropped and the client gets a ``Permissions Violation``). The
JetStream API is subjects too (``$JS.API.STREAM.CREATE.<stream>``, ...), so the same lists decide
who may create or delete streams and consumers: only ``admin``. Each user gets its own inbox
prefix (``_INBOX.<user>``), so no one can read the replies another user asked for.

nats-server's configuration holds each password as a bcrypt hash; the plain password is only in
the user's credentials file (:class:`shared.records.NatsCredentials`, mode 0600).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt

from shared import atomic, records, subjects
from shared.records import MAX_OUTER_SHARDS
from shared.records.credentials import NatsCredentials, NatsRole

JS_API = "$JS.API"
# The passwords are 192 random bits, so bcrypt's cost buys nothing against guessing; a low cost
# keeps the server's check of each (re)connection cheap when many clients reconnect at once.
BCRYPT_ROUNDS = 6
PASSWORD_BYTES = 24


class CredentialsError(ValueError):
    """A credentials file is missing, malformed, or readable by others."""


@dataclass(frozen=True)
class Identity:
    """One NATS user: a role, with the job and unit (or link name) it acts for."""

    role: NatsRole
    job: str = ""
    unit: int | None = None
    link: str = ""

    @property
    def user(self) -> str:
        """The user name (unique per role, job and unit)."""
        if self.role == "learner":
            return f"learner-{self.job}-{self.unit}"
        if self.role == "outer":
            return f"outer-{self.job}"
        if self.role == "link":
            return f"link-{self.job}-{self.link}"
        return self.role

    def permissions(self) -> dict[str, object] | None:
        """nats-server's ``permissions`` block for this user (None: allowed everything)."""
        if self.role == "admin":
            return None
        publish = [*_ROLE_PUBLISH[self.role](self)]
        subscribe = [inbox_prefix(self.user) + ".>"]
        if self.role == "learner":
            assert self.unit is not None, "a learner identity needs its unit"
            subscribe.append(subjects.params_head_subject(self.job, "*"))
            # Notified of a change of its desired state (then it reads the record).
            subscribe.append(subjects.desired_subject(self.job, self.unit))
        if self.role == "outer":
            subscribe.append(subjects.want_subject(self.job, "*", "*"))
        permissions: dict[str, object] = {
            "publish": {"allow": publish},
            "subscribe": {"allow": subscribe},
        }
        if self.role == "outer":
            # Only to answer the units' wants: one reply to each request's reply subject.
            permissions["allow_responses"] = True
        return permissions


def inbox_prefix(user: str) -> str:
    """The prefix of the reply subjects of ``user`` (only it may subscribe there)."""
    return f"_INBOX.{user}"


def _kv(bucket: str, key: str) -> str:
    """The subject a write of ``key`` in KV ``bucket`` is published to."""
    return f"$KV.{bucket}.{key}"


def _kv_read(bucket: str, keys: str) -> str:
    """The direct-get subject that reads the last value of ``keys`` in ``bucket``."""
    return f"{JS_API}.DIRECT.GET.{_kv_stream(bucket)}.{_kv(bucket, keys)}"


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


#: The streams each role reads or writes (it may ask for their info).
ROLE_STREAMS: dict[NatsRole, tuple[str, ...]] = {
    "learner": (
        _kv_stream(subjects.STATUS_BUCKET),
        _kv_stream(subjects.DESIRED_BUCKET),
        subjects.GRADS_STREAM,
        subjects.PARAMS_STREAM,
        subjects.DOWNLINK_STREAM,
    ),
    "outer": (
        _kv_stream(subjects.STATUS_BUCKET),
        _kv_stream(subjects.OUTER_BUCKET),
        _kv_stream(subjects.DESIRED_BUCKET),
        subjects.GRADS_STREAM,
        subjects.PARAMS_STREAM,
        subjects.CKPT_STREAM,
        subjects.DEAD_STREAM,
        subjects.DOWNLINK_STREAM,
    ),
    "gateway": (
        _kv_stream(subjects.STATUS_BUCKET),
        _kv_stream(subjects.DESIRED_BUCKET),
        _kv_stream(subjects.JOBS_BUCKET),
    ),
    "link": (_kv_stream(subjects.STATUS_BUCKET),),
}


def _stream_info(role: NatsRole) -> list[str]:
    return [f"{JS_API}.STREAM.INFO.{s}" for s in ROLE_STREAMS[role]]


def _learner(who: Identity) -> list[str]:
    job, unit = who.job, who.unit
    assert unit is not None, "a learner identity needs its unit"
    return [
        subjects.grads_subject(job, unit, "*"),
        _kv(subjects.STATUS_BUCKET, subjects.unit_status_key(job, unit)),
        *_stream_info("learner"),
        _kv_read(subjects.DESIRED_BUCKET, subjects.desired_key(job, unit)),
        _kv_read(subjects.STATUS_BUCKET, f"{job}.>"),
        # A params chunk is read by its sequence number, which names no subject: a learner can
        # read any job's params (it cannot change them).
        f"{JS_API}.DIRECT.GET.{subjects.PARAMS_STREAM}",
        f"{JS_API}.DIRECT.GET.{subjects.PARAMS_STREAM}.{subjects.params_head_subject(job, '*')}",
        # Params deltas (--params-downlink delta): it asks for its own, and reads them by
        # subject, only its own.
        subjects.want_subject(job, unit, "*"),
        f"{JS_API}.DIRECT.GET.{subjects.DOWNLINK_STREAM}.{subjects.downlink_filter(job, unit)}",
    ]


def _outer(who: Identity) -> list[str]:
    job = who.job
    return [
        f"diloco.{job}.params.>",
        subjects.downlink_filter(job, "*"),
        subjects.dead_letter_subject(job),
        subjects.checkpoint_filter(job),
        _kv(subjects.STATUS_BUCKET, subjects.outer_status_key(job, "*")),
        _kv(subjects.STATUS_BUCKET, subjects.outer_standby_keys(job)),
        _kv(subjects.OUTER_BUCKET, subjects.lease_key(job, "*")),
        *_stream_info("outer"),
        _kv_read(subjects.STATUS_BUCKET, f"{job}.>"),
        _kv_read(subjects.OUTER_BUCKET, subjects.lease_key(job, "*")),
        # The units' desired states: a quarantined unit's uploads are refused.
        _kv_read(subjects.DESIRED_BUCKET, f"{job}.*"),
        f"{JS_API}.DIRECT.GET.{subjects.PARAMS_STREAM}",
        f"{JS_API}.DIRECT.GET.{subjects.PARAMS_STREAM}.diloco.{job}.params.>",
        f"{JS_API}.DIRECT.GET.{subjects.CKPT_STREAM}",
        f"{JS_API}.DIRECT.GET.{subjects.CKPT_STREAM}.{subjects.checkpoint_filter(job)}",
        # The purge request carries its subject filter in its body, which permissions cannot
        # see: an outer may drop another job's old checkpoints (the outers are trusted).
        f"{JS_API}.STREAM.PURGE.{subjects.CKPT_STREAM}",
        # Its shards' durable consumers and nothing else of the grads stream.
        *(
            subject
            for shard in range(MAX_OUTER_SHARDS)
            for subject in _consumer(subjects.outer_consumer(job, shard))
        ),
    ]


def _consumer(name: str) -> list[str]:
    """What an outer shard does with its durable consumer ``name`` of the grads stream."""
    grads = subjects.GRADS_STREAM
    return [
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{grads}.{name}",
        f"{JS_API}.CONSUMER.CREATE.{grads}.{name}",
        f"{JS_API}.CONSUMER.CREATE.{grads}.{name}.>",
        f"{JS_API}.CONSUMER.DELETE.{grads}.{name}",
        f"{JS_API}.CONSUMER.INFO.{grads}.{name}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{grads}.{name}",
        f"$JS.ACK.{grads}.{name}.>",
    ]


def _gateway(_who: Identity) -> list[str]:
    return [
        _kv(subjects.DESIRED_BUCKET, ">"),
        _kv(subjects.JOBS_BUCKET, ">"),
        f"{JS_API}.STREAM.INFO.*",
        f"{JS_API}.DIRECT.GET.>",
    ]


def _link(who: Identity) -> list[str]:
    return [
        _kv(subjects.STATUS_BUCKET, subjects.link_status_key(who.job, who.link)),
        *_stream_info("link"),
    ]


_ROLE_PUBLISH = {"learner": _learner, "outer": _outer, "gateway": _gateway, "link": _link}


def new_credentials(who: Identity) -> NatsCredentials:
    """Fresh credentials (a random password) for ``who``."""
    return NatsCredentials(
        user=who.user,
        password=secrets.token_urlsafe(PASSWORD_BYTES),
        role=who.role,
        job=who.job,
        unit=who.unit,
        link=who.link,
    )


def identity_of(credentials: NatsCredentials) -> Identity:
    """The identity a credentials file is for.

    Raises:
        CredentialsError: the file's user name is not the one its role, job and unit make.
    """
    who = Identity(credentials.role, credentials.job, credentials.unit, credentials.link)
    if who.user != credentials.user:
        raise CredentialsError(
            f"credentials of user {credentials.user!r} name another identity ({who.user!r})"
        )
    return who


def password_hash(password: str) -> str:
    """The bcrypt hash nats-server checks ``password`` against."""
    salt = bcrypt.gensalt(rounds=BCRYPT_ROUNDS, prefix=b"2a")
    return bcrypt.hashpw(password.encode(), salt).decode()


def write_credentials(path: Path, credentials: NatsCredentials) -> None:
    """Write a credentials file, readable by its owner only."""
    atomic.write_private_bytes(path, records.encode(credentials))


def read_credentials(path: str | os.PathLike[str]) -> NatsCredentials:
    """Read a credentials file.

    Raises:
        CredentialsError: the file is missing, unreadable, malformed, or readable by its group
            or others (like ssh, a secret others can read is refused).
    """
    where = Path(path)
    try:
        mode = where.stat().st_mode
        data = where.read_bytes()
    except OSError as err:
        raise CredentialsError(f"cannot read the NATS credentials {where}: {err}") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(
            f"the NATS credentials {where} are readable by others (mode {mode & 0o777:o}): "
            f"run chmod 600 {where}"
        )
    try:
        return NatsCredentials.model_validate_json(data)
    except ValueError as err:
        raise CredentialsError(f"malformed NATS credentials {where}: {err}") from err


def authorization_block(users: Iterable[tuple[Identity, str]]) -> str:
    """nats-server's ``authorization`` block for ``(identity, password hash)`` pairs.

    With users listed, a connection without a valid user and password is refused.
    """
    entries = []
    for who, hashed in users:
        entry: dict[str, object] = {"user": who.user, "password": hashed}
        permissions = who.permissions()
        if permissions is not None:
            entry["permissions"] = permissions
        entries.append(entry)
    # nats-server's configuration format reads JSON.
    return "authorization: " + json.dumps({"users": entries}, indent=1)


@dataclass
class Credentials:
    """The identities of one cluster, their credentials files and the server's block.

    Identities are added as the cluster needs them (a job created through the REST API brings
    its outer and learners); the caller then rewrites the server's configuration and reloads it.
    A file already in the folder is kept (its user may be connected): several processes may
    add users to one folder (compose's controller), and the server's owner picks them up with
    :meth:`load`.

    Attributes:
        folder: where the credentials files go (``<user>.json``, mode 0600).
    """

    folder: Path
    _users: dict[str, tuple[Identity, NatsCredentials, str]] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)  # users removed for good (quarantine)

    def path(self, who: Identity) -> Path:
        """Where the credentials file of ``who`` is (or goes)."""
        return self.folder / f"{who.user}.json"

    def ensure(self, who: Identity) -> tuple[Path, bool]:
        """The credentials file of ``who``, made if new; returns it and whether it is new.

        Raises:
            CredentialsError: ``who`` was revoked, or its file holds another identity.
        """
        if who.user in self.revoked:
            raise CredentialsError(f"the NATS user {who.user!r} was revoked")
        path = self.path(who)
        if who.user in self._users:
            return path, False
        if path.exists():
            credentials = read_credentials(path)
            if identity_of(credentials) != who:
                raise CredentialsError(f"{path} holds the credentials of another identity")
        else:
            credentials = new_credentials(who)
            write_credentials(path, credentials)
        self._users[who.user] = (who, credentials, password_hash(credentials.password))
        return path, True

    def revoke(self, who: Identity) -> bool:
        """Remove ``who`` for good: from the server's block (the caller reloads the server,
        which closes the user's connections) and its file; returns whether it was there."""
        self.revoked.add(who.user)
        self.path(who).unlink(missing_ok=True)
        return self._users.pop(who.user, None) is not None

    def load(self) -> tuple[list[str], list[str]]:
        """Add every credentials file in the folder that is new to this object (written by
        another process).

        Returns:
            The new users' names, and why each file that cannot be used was skipped.
        """
        added, problems = [], []
        for path in sorted(self.folder.glob("*.json")):
            if path.stem in self._users or path.stem in self.revoked:
                continue
            try:
                credentials = read_credentials(path)
                who = identity_of(credentials)
            except CredentialsError as err:
                problems.append(str(err))
                continue
            if who.user != path.stem:
                problems.append(f"{path} holds the credentials of {who.user!r}")
                continue
            self._users[who.user] = (who, credentials, password_hash(credentials.password))
            added.append(who.user)
        return added, problems

    def authorization_block(self) -> str:
        """nats-server's ``authorization`` block for every identity made so far."""
        return authorization_block((who, hashed) for who, _, hashed in self._users.values())
