"""The parts of the compose cluster that need no Docker engine: the broker's secrets, users added
to a credentials folder by another process, and how a job container is named and given its
files. The cluster itself runs in tests/test_compose.py."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from services.orchestration.compose import docker_api
from services.orchestration.compose.broker import make_secrets
from services.orchestration.compose.settings import BrokerSettings, ControllerSettings
from shared import liveness, nats_auth
from shared.nats_auth import Credentials, CredentialsError, Identity


def test_the_broker_makes_the_secrets_once_and_keeps_them(tmp_path: Path) -> None:
    settings = BrokerSettings(secrets_dir=tmp_path, store_dir=tmp_path / "store")
    credentials, files = make_secrets(settings)
    assert files is not None and files.ca_cert.exists()
    token = (tmp_path / "api-token").read_text()
    admin = (tmp_path / "credentials" / "admin.json").read_bytes()
    for path in (tmp_path / "api-token", tmp_path / "credentials" / "gateway.json", files.key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert '"user": "gateway"' in credentials.authorization_block()
    # A restart keeps every secret: connected clients and the token stay valid.
    ca = files.ca_cert.read_bytes()
    again, files_again = make_secrets(settings)
    assert (tmp_path / "api-token").read_text() == token
    assert (tmp_path / "credentials" / "admin.json").read_bytes() == admin
    assert files_again is not None and files_again.ca_cert.read_bytes() == ca
    assert again.authorization_block().count('"user"') == 2
    assert make_secrets(settings.model_copy(update={"tls": False}))[1] is None


def test_users_another_process_adds_are_loaded_and_bad_files_skipped(tmp_path: Path) -> None:
    server_side = Credentials(tmp_path)
    server_side.ensure(Identity("admin"))
    controller = Credentials(tmp_path)
    learner = Identity("learner", "my-job", unit=3)
    path, new = controller.ensure(learner)
    assert new
    assert server_side.load() == (["learner-my-job-3"], [])
    assert "learner-my-job-3" in server_side.authorization_block()
    assert server_side.load() == ([], [])
    # The same identity again (a restarted controller) keeps the file and its password.
    before = path.read_bytes()
    assert Credentials(tmp_path).ensure(learner) == (path, True)
    assert path.read_bytes() == before
    # A file under another user's name, or readable by others, is skipped with the reason.
    (tmp_path / "outer-x.json").write_bytes(before)
    os.chmod(tmp_path / "outer-x.json", 0o600)
    (tmp_path / "gateway.json").write_bytes(b"{}")
    os.chmod(tmp_path / "gateway.json", 0o644)
    added, problems = server_side.load()
    assert added == [] and len(problems) == 2
    assert any("readable by others" in p for p in problems)
    assert any("learner-my-job-3" in p for p in problems)
    with pytest.raises(CredentialsError, match="another identity"):
        Credentials(tmp_path).ensure(Identity("outer", "x"))


def test_a_credentials_file_names_its_identity() -> None:
    who = Identity("link", "j-1", link="0")
    assert nats_auth.identity_of(nats_auth.new_credentials(who)) == who
    forged = nats_auth.new_credentials(who).model_copy(update={"user": "admin"})
    with pytest.raises(CredentialsError, match="another identity"):
        nats_auth.identity_of(forged)


def test_a_job_container_is_named_after_its_child_and_gets_only_its_files() -> None:
    assert docker_api.container_name("diloco", Path("/logs/demo-learner-1.log")) == (
        "diloco-demo-learner-1"
    )
    archive = docker_api._archive({"nats/credentials.json": b"secret", "nats/ca.pem": b"ca"})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"nats", "nats/credentials.json", "nats/ca.pem"}
        assert members["nats"].isdir() and members["nats"].mode == 0o700
        secret = members["nats/credentials.json"]
        assert (secret.mode, secret.uid) == (0o600, docker_api.USER_ID)
        assert tar.extractfile(secret).read() == b"secret"


def test_the_controllers_link_option_is_checked_at_start() -> None:
    assert ControllerSettings(link="20mbit/40ms").link == "20mbit/40ms"
    with pytest.raises(ValueError, match="expected a rate"):
        ControllerSettings(link="fast")


def test_the_liveness_check_follows_the_files_age(tmp_path: Path, capsys) -> None:
    alive = tmp_path / "alive"
    assert liveness.main([str(alive), "30"]) == 1  # not touched yet
    liveness.mark(str(alive))
    assert liveness.main([str(alive), "30"]) == 0
    old = alive.stat().st_mtime - 60
    os.utime(alive, (old, old))
    assert liveness.main([str(alive), "30"]) == 1
    assert "s old" in capsys.readouterr().err
    liveness.mark(None)  # no file: nothing to do
    liveness.mark(str(tmp_path / "missing" / "alive"))  # logged, not raised
    assert liveness.main([]) == 2
