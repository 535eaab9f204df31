"""``diloco controller``: the processes of REST-created jobs, as containers.

Under ``diloco up`` the reconcile loop starts a process for each outer and learner a registered
job needs (``services.orchestration.reconcile``). In a compose cluster this controller runs the same
loop and the same plan, but each of them is a container (``docker_api.ContainerLauncher``), started
through the Docker SDK and supervised like a process: a crashed or killed container (``docker
kill``) is started again after the supervisor's backoff, and its learner resumes from its checkpoint
in the ``units`` volume; one that exited 0 (stopped, or trained all its steps) stays down; a stopped
job's outer goes once its learners are done.

Each container connects as its own NATS user (``shared.nats_auth``): the controller writes the
user's credentials into the secrets volume, waits until the broker has loaded them (it polls the
folder), and copies only that file and the CA into the container. With ``--link`` every learner
is behind a shaped link of its own, a ``diloco link`` container (``<job>/link-<unit>``) that its
learner connects to and that reports the bytes it carried (``diloco_link_bytes`` in /metrics).

On SIGTERM (``docker compose down``) the learners are stopped first (they upload what they
have), then the outers, then the links; then every job container is removed, so that compose
can remove the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from services.orchestration import commands, reconcile
from services.orchestration.children import Child, log_path_of
from services.orchestration.compose.broker import hand_to_broker
from services.orchestration.compose.docker_api import (
    ENGINE_ERRORS,
    LIVENESS_VARIABLE,
    Container,
    ContainerLauncher,
    Template,
    container_name,
    engine_client,
    remove_children,
    remove_container,
)
from services.orchestration.compose.settings import CREDENTIALS_DIR, ControllerSettings
from services.orchestration.registry import Registry, read_registry
from services.orchestration.supervisor import RestartPolicy, State, Supervisor
from shared import kv, liveness, nats_auth, retry, subjects, transport
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import prepare_streams

log = logging.getLogger("diloco.controller")
TICK_S = 1.0  # how often the registry is read and the containers checked
READ_TIMEOUT_S = 5.0
USER_WAIT_S = 30.0  # how long a new user may take to be accepted by the broker
STOP_GRACE_S = 35.0  # per group at shutdown (the containers' own stop timeout is 30 s)
LINK_PORT = 4222  # a link container listens here, like nats-server
JOB_LIVENESS_FILE = "/tmp/diloco.alive"  # in an outer's or learner's container
LOGS_DIR = Path("/tmp/diloco-controller/logs")  # one line per job container: its name
STACK_LOG_LINES = 100  # of a hung container's log, copied into the controller's: its stacks
NATS_ERRORS = (*retry.NATS_ERRORS, kv.KvError, transport.TransportError)


def link_name(job: str, unit: int) -> str:
    """The child name of the shaped link in front of a job's learner."""
    return f"{job}/link-{unit}"


@dataclass
class Controller:
    """The job containers of one compose cluster and their restart bookkeeping."""

    settings: ControllerSettings
    launch: ContainerLauncher
    logs: Path
    supervisor: Supervisor = field(default_factory=lambda: Supervisor(RestartPolicy()))
    children: dict[str, Child] = field(default_factory=dict)  # every one, by child name
    links: dict[str, Child] = field(default_factory=dict)  # the shaped links, by learner name
    credentials: nats_auth.Credentials = field(init=False)

    def __post_init__(self) -> None:
        self.credentials = nats_auth.Credentials(self.settings.secrets_dir / CREDENTIALS_DIR)

    def _plan_states(self) -> dict[str, State]:
        """The supervisor's states of the outers and learners (links are not the plan's)."""
        links = self._link_names()
        states = self.supervisor.states()
        return {n: s for n, s in states.items() if n in self.children and n not in links}

    def _link_names(self) -> set[str]:
        return {link.name for link in self.links.values()}

    async def _user_env(self, who: nats_auth.Identity) -> dict[str, str]:
        """The environment that makes a container connect as ``who``; a new user is waited
        for until the broker accepts it."""
        path, new = self.credentials.ensure(who)
        if new:
            hand_to_broker(path)  # this process runs as root, for the Docker socket
        env = {"DILOCO_NATS_CREDENTIALS": str(path)}
        if who.role in ("outer", "learner"):
            env[LIVENESS_VARIABLE] = JOB_LIVENESS_FILE  # a health check on their heartbeat
        if self.settings.nats_ca_file is not None:
            env["DILOCO_NATS_CA_FILE"] = self.settings.nats_ca_file
        if new:
            await wait_until_accepted(
                self.settings.model_copy(update={"nats_credentials": str(path)})
            )
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str], may_finish: bool) -> Child:
        child = Child.start(name, args, env, self.logs, self.launch)
        self.children[name] = child
        self.supervisor.add(name, time.monotonic(), may_finish=may_finish)
        log.info("started %s (container %s)", name, _container(child).name)
        return child

    async def reconcile(self, registry: Registry) -> None:
        """Start and stop containers to match ``registry`` (``orchestration.reconcile``)."""
        actions = reconcile.plan(
            registry.records,
            registry.desired,
            self._plan_states(),
            self.supervisor.retired(),
            own_job="",
            checkpoint_dir=self.settings.checkpoint_dir,
        )
        for action in actions:
            if isinstance(action, reconcile.Retire):
                self.supervisor.retire(action.name)
                self.children[action.name].terminate()
                log.info("job %s: its learners are done, stopping %s", action.job, action.name)
                continue
            command, *flags = action.args
            who = nats_auth.Identity(action.role, action.job, unit=action.unit)
            env = await self._user_env(who)
            url = self.settings.nats_url
            if action.role == "learner":
                env.update(commands.threads_env(self.settings.learner_threads))
                assert action.unit is not None
                if self.settings.link:
                    url = await self._start_link(action.name, action.job, action.unit)
                    server = urlsplit(self.settings.nats_servers()[0]).hostname or ""
                    env["DILOCO_NATS_TLS_HOSTNAME"] = server  # the certificate's name
            self._start(
                action.name,
                [command, "--nats-url", url, *flags],
                env,
                may_finish=action.role == "learner",
            )

    async def _start_link(self, learner: str, job: str, unit: int) -> str:
        """Start the shaped link in front of the learner ``learner`` (its child name); returns
        the URL the learner connects to."""
        name = link_name(job, unit)
        env = await self._user_env(nats_auth.Identity("link", job, link=str(unit)))
        args = [
            "link",
            *("--nats-url", self.settings.nats_url, "--job", job, "--name", str(unit)),
            *("--link", self.settings.link, "--listen-host", "0.0.0.0"),
            *("--listen-port", str(LINK_PORT)),
        ]
        self.links[learner] = self._start(name, args, env, may_finish=False)
        host = container_name(self.launch.template.project, log_path_of(self.logs, name))
        return f"nats://{host}:{LINK_PORT}"

    def heal(self) -> None:
        """Notice containers that stopped; kill those whose health check fails (a hung
        process: its stacks go to its log first, and the end of that log into the controller's);
        start again those whose backoff is over. A learner that is done takes its link with
        it."""
        now = time.monotonic()
        for name in self.supervisor.running():
            child = self.children[name]
            code = child.exit_code()
            if code is None:
                container = _container(child)
                if container.unhealthy():
                    log.warning("%s is unhealthy (no heartbeat): killing it", name)
                    child.kill_with_stacks()
                    # Its next start removes the container, and its log with it.
                    log.warning(
                        "%s: the end of its log, its threads' stacks:\n%s",
                        name,
                        container.log_tail(STACK_LOG_LINES),
                    )
                continue
            decision = self.supervisor.exited(name, code, now)
            if decision.state is State.FINISHED:
                log.info("%s exited with code %d (done)", name, code)
            else:
                log.warning("%s", decision.line())
            link = self.links.get(name)
            if (
                decision.state in reconcile.DONE
                and link is not None
                and self.supervisor.state(link.name) is State.RUNNING
            ):
                self.supervisor.retire(link.name)
                link.terminate()
        for name in self.supervisor.due(now):
            number = self.supervisor.restarts()[name] + 1
            self.children[name].restart(number)
            self.supervisor.restarted(name, time.monotonic())
            log.info("%s started again (restart #%d)", name, number)

    def stop(self) -> None:
        """Stop the learners, then the outers, then the links; remove every job container."""
        links = list(self.links.values())
        rest = [c for c in self.children.values() if c.name not in self._link_names()]
        learners = [c for c in rest if not reconcile.is_outer(c.name)]
        outers = [c for c in rest if reconcile.is_outer(c.name)]
        for group in (learners, outers, links):
            for child in group:
                with contextlib.suppress(*ENGINE_ERRORS):  # gone already: nothing to stop
                    child.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                if not child.wait_until(deadline):
                    log.warning("%s did not stop in %.0f s: killing it", child.name, STOP_GRACE_S)
                    child.process.kill()
        for child in self.children.values():
            remove_container(self.launch.client, _container(child).name)


def _container(child: Child) -> Container:
    """The container a child of the controller runs in."""
    assert isinstance(child.process, Container), child.process
    return child.process


async def wait_until_accepted(settings: NatsSettings) -> None:
    """Wait until NATS accepts the user of ``settings`` (the broker loads new users within a
    second or so).

    Raises:
        transport.TransportError: still refused after :data:`USER_WAIT_S`.
    """

    async def quiet(_err: Exception) -> None:
        """A refusal is expected until the broker has loaded the user."""

    deadline = time.monotonic() + USER_WAIT_S
    while True:
        try:
            nc = await connect(settings, "diloco-controller-check", error_cb=quiet)
        except transport.TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)
            continue
        await nc.close()
        return


async def run_controller(settings: ControllerSettings, stop: asyncio.Event) -> int:
    """Match the job containers with the registry until ``stop`` is set; then stop them all."""
    client = engine_client(settings.docker_socket)
    own = settings.container or os.environ.get("HOSTNAME", "")
    template = Template.of(client, own, skip_targets={str(settings.secrets_dir)})
    for name in remove_children(client, template.project):
        log.info("removed %s, left by an earlier controller", name)
    controller = Controller(settings, ContainerLauncher(client, template), LOGS_DIR)
    nc = await connect(settings, "diloco-controller")
    try:
        js = nc.jetstream()
        # The admin creates them (a cluster takes a moment to elect its metadata leader).
        await retry.retry(
            lambda: prepare_streams(js, settings), "create streams", stopping=stop.is_set
        )
        jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
        desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
        log.info(
            "controller ready: job containers from image %s on network %s",
            template.image,
            template.network,
        )
        while not stop.is_set():
            try:
                registry = await asyncio.wait_for(
                    read_registry(nc, jobs_kv, desired_kv, own_job=""), READ_TIMEOUT_S
                )
                await controller.reconcile(registry)
            except NATS_ERRORS as err:
                log.warning("registry not read (%s): %s", type(err).__name__, err)
            except ENGINE_ERRORS as err:  # tried again at the next tick
                log.warning("a container was not started: %s", err)
            try:
                controller.heal()
            except ENGINE_ERRORS as err:
                log.warning("a container was not checked or started again: %s", err)
            liveness.mark(settings.liveness_file)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=TICK_S)
    finally:
        log.info("stopping the job containers ...")
        await asyncio.to_thread(controller.stop)
        with contextlib.suppress(*NATS_ERRORS):
            await asyncio.wait_for(nc.close(), timeout=5.0)
        log.info("every job container removed")
    return 0
