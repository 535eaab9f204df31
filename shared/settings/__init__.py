"""Settings, each defined once with its default, and composed into every place that needs them.

A group is a plain pydantic model; a service's settings class composes the groups it uses with
``pydantic_settings.BaseSettings`` (which adds the ``DILOCO_*`` environment variables), and the
job spec of the REST API (``shared.records.jobs.JobSpec``), the simulator (``sim.training``) and
the benchmarks compose the same groups, so that what they run is what ships:

* ``workload`` — what a job trains: model, seed, corpus, batch size, steps;
* ``algorithm`` — how it trains: the sync mode and fragments, the inner optimizer and sync
  schedule, the outer optimizer and merge rules;
* ``codec`` — how pseudo-gradients and global params are encoded;
* ``link`` — the shaped link every learner reaches NATS through;
* ``resources`` — threads each process may use;
* ``nats`` — how a service connects to NATS (URL, user, TLS) and its liveness file;
* ``cli`` — settings classes as CLI flags, environment variables and job configuration files.

Settings modules import no implementation (JAX, Optax, Numba): ``diloco --help``, the gateway
and the client commands load them quickly (``tests/test_imports.py``).
"""

from __future__ import annotations

from typing import Any

ENV_PREFIX = "DILOCO_"

#: Marks a settings field that holds a secret: it gets no ``--flag`` (a command line shows in
#: ``ps``); it is set by its environment variable (or a file the settings read).
SECRET = {"secret": True}


class SettingsError(ValueError):
    """A setting has an invalid value; the message names the flag and what is expected."""


def is_secret(field: Any) -> bool:
    """Whether a settings field holds a secret (:data:`SECRET`)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True
