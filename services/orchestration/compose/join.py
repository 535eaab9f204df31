"""A learner unit from outside a compose cluster: its NATS user, made in the secrets volume.

The brokers load every credentials file of the secrets volume within their ``--poll-s``
(``broker.py``), so a user made here can connect a moment later, from any machine that reaches
the published NATS port over TLS (docker-compose.yml, README "Join a unit from another
machine"). Whoever can run this in the controller's container can let a unit in: it is the
operator's command. A unit quarantined through the REST API stays refused by the outer (its
desired state says so) even if its user is made again.
"""

from __future__ import annotations

from pathlib import Path

from services.orchestration.compose.broker import hand_to_broker
from services.orchestration.compose.settings import CREDENTIALS_DIR, CredentialsSettings
from shared import nats_auth


def learner_credentials(settings: CredentialsSettings) -> Path:
    """The credentials file of the unit ``settings`` names, made if new.

    Raises:
        nats_auth.CredentialsError: the unit's file holds another identity.
    """
    credentials = nats_auth.Credentials(settings.secrets_dir / CREDENTIALS_DIR)
    credentials.load()
    path, new = credentials.ensure(nats_auth.Identity("learner", settings.job, unit=settings.unit))
    if new:
        hand_to_broker(path)
    return path
