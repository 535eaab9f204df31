"""The processes of one ``diloco up`` run and what happens to them.

nats-server (or, with ``--nats-cluster N``, N routed nodes), the own job's outer, gateway and
learners, and the outer and learners of the registry's jobs: each is started with the command
``diloco <service>`` (``services.orchestration.children``), started again after a crash when
``services.orchestration.supervisor`` says so (a nats-server node on the same ports and
JetStream store), matched with the registry as ``services.orchestration.reconcile`` plans, and
stopped in a safe order: learners first (they upload what they have), then the outers and the
gateway, then nats-server. The live children's PIDs are kept in ``<data-dir>/pids.json``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from services.orchestration import commands, nats_server, reconcile
from services.orchestration.children import Child, Launch, popen
from services.orchestration.local import files
from services.orchestration.local.chaos import ChaosClock, link_outages, nats_names, outer_names
from services.orchestration.local.records import ChaosEvent, PidsFile
from services.orchestration.local.settings import UpSettings
from services.orchestration.registry import Registry
from services.orchestration.supervisor import RestartPolicy, State, Supervisor
from shared import nats_auth, tls
from shared.link_spec import LinkSpec
from shared.settings.nats import NatsSettings

# A learner's stop takes up to its flush timeout (15 s) and its link's slack (16 s,
# ``services/learner/link.py``'s STOP_JOIN_SLACK_S) before it gives up on NATS.
STOP_GRACE_S = 35.0
KILL_WAIT_S = 5.0  # how long a SIGKILLed learner may take to exit
CREDENTIALS_DIR = "credentials"  # <data-dir>/credentials/<user>.json, one per NATS user
TLS_DIR = "tls"  # <data-dir>/tls: the CA and nats-server's certificate (--tls)
TLS_HOSTS = ["127.0.0.1", "localhost"]  # the names the server's certificate is valid for


@dataclass
class Cluster:
    """The processes of one ``diloco up`` run and their restart bookkeeping.

    Attributes:
        settings: the run's options.
        out: where the lines for the user go.
        launch: starts a child's process (a stand-in in tests).
    """

    settings: UpSettings
    out: TextIO = sys.stdout
    launch: Launch = popen
    servers: list[nats_server.NatsServer] = field(default_factory=list)  # by node
    learners: list[Child] = field(default_factory=list)
    services: list[Child] = field(default_factory=list)
    links: list[Child] = field(default_factory=list)  # shaped links in front of NATS
    job_children: list[Child] = field(default_factory=list)  # processes of registry jobs
    registry_busy: bool = False  # the last registry read found a job that is not stopped
    gateway_url: str = ""
    token: str = ""
    supervisor: Supervisor = field(init=False)
    chaos: list[ChaosEvent] = field(default_factory=list)  # failures to inject, by time
    chaos_clock: ChaosClock = field(default_factory=lambda: ChaosClock([]))
    chaos_started: float = 0.0  # monotonic time the chaos schedule counts from
    credentials: nats_auth.Credentials = field(init=False)
    tls_files: tls.ServerFiles | None = None  # with --tls, once nats-server is started

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(RestartPolicy(max_restarts=self.settings.max_restarts))
        self.credentials = nats_auth.Credentials(self.data_dir / CREDENTIALS_DIR)

    @property
    def ca_file(self) -> str | None:
        """The CA certificate clients verify nats-server with (None: no TLS)."""
        return str(self.tls_files.ca_cert) if self.tls_files is not None else None

    def admin_settings(self) -> NatsSettings:
        """How ``diloco up`` itself connects: as the admin (it creates the streams)."""
        path, _ = self.credentials.ensure(nats_auth.Identity("admin"))
        return NatsSettings(
            nats_url=self.nats_url,
            nats_credentials=str(path),
            nats_ca_file=self.ca_file,
            nats_replicas=self.settings.nats_cluster,
        )

    def identity_env(self, *identities: nats_auth.Identity) -> list[dict[str, str]]:
        """The environment that gives each child its NATS user (``DILOCO_NATS_CREDENTIALS``)
        and, with ``--tls``, the CA (``DILOCO_NATS_CA_FILE``); users new to the running server
        are added to it first (one reload)."""
        made = [self.credentials.ensure(who) for who in identities]
        if any(new for _, new in made):
            self.reload_users()
        tls_env = {"DILOCO_NATS_CA_FILE": self.ca_file} if self.ca_file is not None else {}
        return [{"DILOCO_NATS_CREDENTIALS": str(path), **tls_env} for path, _ in made]

    @property
    def data_dir(self) -> Path:
        """The run's data folder."""
        return Path(self.settings.data_dir)

    @property
    def nats_url(self) -> str:
        """The URL of the run's nats-server, or every node's, comma-separated (once started)."""
        assert self.servers, "nats-server is not started"
        return nats_server.cluster_url(self.servers)

    def nats_url_from(self, first: int) -> str:
        """Every node's URL, node ``first`` (modulo the nodes) first: the node a shaped link
        forwards to, the others its fallbacks; the learners' links spread over the nodes."""
        urls = [server.url for server in self.servers]
        first %= len(urls)
        return ",".join(urls[first:] + urls[:first])

    def _server(self, name: str) -> nats_server.NatsServer | None:
        """The nats-server node of child name ``name`` (None: not a node's name)."""
        names = nats_names(len(self.servers)) if self.servers else []
        return self.servers[names.index(name)] if name in names else None

    def reload_users(self) -> None:
        """Have every nats-server node reload the NATS users (added or revoked)."""
        for server in self.servers:
            server.reload(self.credentials.authorization_block())

    def print(self, line: str) -> None:
        """Show a line to the user."""
        print(line, file=self.out, flush=True)

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        may_finish: bool = False,
    ) -> Child:
        """Start the child ``name`` (``diloco <args>``) and supervise it; ``may_finish``: an
        exit with code 0 means it is done."""
        child = Child.start(name, args, env or {}, commands.logs_dir(self.settings), self.launch)
        self.supervisor.add(name, time.monotonic(), may_finish=may_finish)
        return child

    def start_services(self) -> None:
        """Start nats-server, the outer and the gateway."""
        s = self.settings
        store = self.data_dir / "nats"
        # Each run is a fresh job: learners number their rounds from 0, and JetStream would
        # drop a new run's uploads as duplicates of the last run's within its dedupe window;
        # a learner would restore the last run's checkpoint.
        tls_dir = self.data_dir / TLS_DIR
        for stale in (store, commands.checkpoint_dir(s), self.credentials.folder, tls_dir):
            if stale.exists():
                shutil.rmtree(stale)
        # Every user the run starts with, so that the server needs no reload for them; a
        # registry job's users are added when it starts (reconcile).
        links = [str(u) for u in range(s.learners)] if s.unit_links() is not None else []
        links += ["outer"] if s.outer_link_spec() is not None else []
        for who in (
            nats_auth.Identity("admin"),
            nats_auth.Identity("outer", s.job),
            nats_auth.Identity("gateway"),
            *(nats_auth.Identity("learner", s.job, unit=u) for u in range(s.learners)),
            *(nats_auth.Identity("link", s.job, link=name) for name in links),
        ):
            self.credentials.ensure(who)
        self.tls_files = tls.make_server_files(tls_dir, TLS_HOSTS) if s.tls else None
        options = dict(
            authorization=self.credentials.authorization_block(),
            tls=self.tls_files.server_block() if self.tls_files is not None else None,
            new_session=True,
            die_with_parent=True,
        )
        if s.nats_cluster == 1:
            self.servers = [nats_server.start_nats_server(store, port=s.nats_port, **options)]
            what = f"fresh JetStream store {store}"
        else:
            self.servers = nats_server.start_nats_cluster(
                store, s.nats_cluster, port=s.nats_port, route_tls=self.tls_files, **options
            )
            what = (
                f"{s.nats_cluster}-node JetStream cluster, every stream on every node; fresh "
                f"stores in {store}"
            )
        for name in nats_names(len(self.servers)):
            self.supervisor.add(name, time.monotonic())
        self.print(f"nats-server  {self.nats_url}  ({what})")
        outer_spec = s.outer_link_spec()
        outer_url = self.nats_url
        if outer_spec is not None:
            outer_url = self.start_link("outer", outer_spec, "", 0)
        [outer_user] = self.identity_env(nats_auth.Identity("outer", s.job))
        for shard, name in enumerate(outer_names(s.outer_shards)):
            outer = commands.outer_args(s, outer_url, shard)
            self.services.append(self.spawn(name, outer, {**commands.cache_env(s), **outer_user}))
        port = s.gateway_port or nats_server.free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.token = s.token or secrets.token_urlsafe(24)
        token_path = files.write_token(self.data_dir, self.token)
        gateway = commands.gateway_args(s, self.nats_url, port)
        [gateway_user] = self.identity_env(nats_auth.Identity("gateway"))
        env = {"DILOCO_TOKEN": self.token, **gateway_user}
        self.services.append(self.spawn("gateway", gateway, env))
        self.print(
            f"gateway      {self.gateway_url}  (GET /jobs/{s.job}, /readyz)"
            f"  token: {self.token}  (also in {token_path})"
        )
        self.write_pids()

    def start_link(self, name: str, spec: LinkSpec, outages: str, node: int) -> str:
        """Start the shaped link ``link-<name>`` in front of nats-server (of a cluster: in
        front of ``node``, and of the others while it is down); returns the NATS URL its
        client connects to."""
        port = nats_server.free_port()
        upstream = self.nats_url_from(node)
        args = commands.link_args(self.settings, upstream, name, spec, port, outages)
        [user] = self.identity_env(nats_auth.Identity("link", self.settings.job, link=name))
        self.links.append(self.spawn(f"link-{name}", args, user))
        self.print(f"link-{name:<7} nats://127.0.0.1:{port}  ({spec.text()})")
        return f"nats://127.0.0.1:{port}"

    def start_learners(self) -> None:
        """Start the learner processes (after ``start_services``), each behind its shaped link
        when the run has links; the chaos clock (``chaos.py``) starts now."""
        s = self.settings
        links = s.unit_links()
        self.chaos = s.chaos_schedule()
        self.chaos_clock = ChaosClock(self.chaos)
        self.chaos_started = time.monotonic()
        for unit in range(s.learners):
            url = self.nats_url
            if links is not None:
                outages = ",".join(o for o in (s.link_outages, link_outages(self.chaos, unit)) if o)
                url = self.start_link(str(unit), links[unit], outages, unit)
            args = commands.learner_args(s, url, unit)
            [user] = self.identity_env(nats_auth.Identity("learner", s.job, unit=unit))
            # A learner that exits 0 has trained all its steps.
            name = f"learner-{unit}"
            env = commands.learner_env(s, unit)
            self.learners.append(self.spawn(name, args, {**env, **user}, may_finish=True))
        self.print(
            f"{s.learners} learners     model {s.model}, {s.max_steps} steps each, H={s.h_steps}"
            f"  (logs in {commands.logs_dir(s)})"
        )
        self.write_pids()

    def job_learners(self) -> list[Child]:
        """The learner processes of registry jobs."""
        return [c for c in self.job_children if not reconcile.is_outer(c.name)]

    def job_outers(self) -> list[Child]:
        """The outer processes of registry jobs."""
        return [c for c in self.job_children if reconcile.is_outer(c.name)]

    def children(self) -> list[Child]:
        """Every service process (learners first), not nats-server's nodes."""
        return [
            *self.learners,
            *self.job_learners(),
            *self.services,
            *self.job_outers(),
            *self.links,
        ]

    def _job_states(self) -> dict[str, State]:
        names = {c.name for c in self.job_children}
        return {n: st for n, st in self.supervisor.states().items() if n in names}

    def reconcile(self, registry: Registry) -> None:
        """Start and stop the processes of registry jobs to match ``registry`` (just read from
        KV); see ``services.orchestration.reconcile``."""
        actions = reconcile.plan(
            registry.records,
            registry.desired,
            self._job_states(),
            self.supervisor.retired(),
            own_job=self.settings.job,
            checkpoint_dir=str(commands.checkpoint_dir(self.settings)),
        )
        self.registry_busy = any(
            job != self.settings.job and r.state != "stopped" for job, r in registry.records.items()
        )
        spawns = [a for a in actions if isinstance(a, reconcile.Spawn)]
        users = dict(
            zip(
                (a.name for a in spawns),
                self.identity_env(
                    *(nats_auth.Identity(a.role, a.job, unit=a.unit) for a in spawns)
                ),
                strict=True,
            )
        )
        for action in actions:
            if isinstance(action, reconcile.Spawn):
                command, *flags = action.args
                learner = action.role == "learner"
                env = (commands.learner_env if learner else commands.cache_env)(self.settings)
                env = {**env, **users[action.name]}
                # A learner that exits 0 was stopped or has finished.
                args = [command, "--nats-url", self.nats_url, *flags]
                child = self.spawn(action.name, args, env, may_finish=learner)
                self.job_children.append(child)
                self.print(f"job {action.job}: started {action.name} (pid {child.pid})")
            else:
                self.supervisor.retire(action.name)
                self._child(action.name).terminate()
                self.print(f"job {action.job}: its learners are done, stopping {action.name}")
        if actions:
            self.write_pids()

    def jobs_busy(self) -> bool:
        """A registry job is not stopped, or one of its processes still runs."""
        return self.registry_busy or bool(reconcile.active_children(self._job_states()))

    def learners_done(self) -> bool:
        """Every own learner has finished (exit 0) or is left dead after its restarts."""
        return all(self.supervisor.state(child.name) in reconcile.DONE for child in self.learners)

    def ready_to_end(self) -> bool:
        """Nothing is left to run but the outer: every own learner is done, no registry job
        needs the cluster, and every outer shard runs (so its status is current)."""
        return (
            self.learners_done()
            and not self.jobs_busy()
            and all(
                self.supervisor.state(name) is State.RUNNING
                for name in outer_names(self.settings.outer_shards)
            )
        )

    def pids(self) -> dict[str, int]:
        """PIDs of the live children by name (``nats-server`` or ``nats-<node>``, ``outer`` or
        ``outer-<shard>``,
        ``gateway``, ``learner-<unit>``, ``link-<unit>``, ``link-outer``, ``<job>/outer``,
        ``<job>/learner-<unit>``)."""
        pids = {}
        for name, server in zip(nats_names(len(self.servers)), self.servers, strict=True):
            if server.alive():
                pids[name] = server.pid
        for child in self.children():
            if child.alive():
                pids[child.name] = child.pid
        return pids

    def write_pids(self) -> None:
        """Rewrite ``pids.json``: this supervisor's PID, the NATS URL, the live children's PIDs
        and the restart counts."""
        files.write_pids(
            self.data_dir,
            PidsFile(
                supervisor=os.getpid(),
                nats_url=self.nats_url if self.servers else None,
                nats_credentials=str(self.credentials.path(nats_auth.Identity("admin"))),
                nats_ca_file=self.ca_file,
                pids=self.pids(),
                restarts=self.supervisor.restarts(),
            ),
        )

    def _child(self, name: str) -> Child:
        return next(c for c in self.children() if c.name == name)

    def _exit_code(self, name: str) -> int | None:
        server = self._server(name)
        return server.process.poll() if server is not None else self._child(name).exit_code()

    def _log_path(self, name: str) -> Path:
        server = self._server(name)
        return server.log_path if server is not None else self._child(name).log_path

    def heal(self, stopping: Callable[[], bool]) -> str | None:
        """Notice children that exited and restart those whose backoff is over (none once
        ``stopping()``); returns why the run must end (the outer or a nats-server node is left
        dead after its restarts), else None."""
        now = time.monotonic()
        changed = False
        ended = None
        for name in self.supervisor.running():
            code = self._exit_code(name)
            if code is None:
                continue
            changed = True
            decision = self.supervisor.exited(name, code, now)
            if decision.state is State.FINISHED:
                if reconcile.job_of(name) is not None:
                    self.print(f"{name} exited with code {code} (done)")
                continue
            self.print(f"{decision.line()}  (log {self._log_path(name)})")
            # Without an outer shard or a nats-server node nothing can go on: the run ends if
            # one stays dead.
            essential = name in outer_names(self.settings.outer_shards) or (
                self._server(name) is not None
            )
            if decision.state is State.GAVE_UP and essential and ended is None:
                ended = (
                    f"stopped: {name} exited with code {code} and was not restarted "
                    f"(max-restarts {decision.max_restarts} reached)"
                )
        if ended is None:
            for name in self.supervisor.due(now):
                if stopping():
                    break
                self._restart(name)
                changed = True
        if changed:
            self.write_pids()
        return ended

    def quarantine(self, job: str, unit: int) -> None:
        """Shut a quarantined unit out: remove its NATS user and reload nats-server (which
        closes its connections), and SIGKILL its learner for good; returns once the learner
        has exited."""
        revoked = self.credentials.revoke(nats_auth.Identity("learner", job, unit=unit))
        if revoked:
            self.reload_users()
        name = f"learner-{unit}" if job == self.settings.job else reconcile.learner_name(job, unit)
        child = next((c for c in self.children() if c.name == name), None)
        if child is not None:
            self.supervisor.retire(name)
            if child.alive():
                child.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=KILL_WAIT_S)
        self.print(f"{job} unit {unit} quarantined: its NATS user removed, its learner stopped")

    def kill_for_chaos(self, event: ChaosEvent) -> None:
        """SIGKILL the event's target; it is not restarted before its repair time is over."""
        self.supervisor.hold(event.target, time.monotonic() + event.repair_s)
        server = self._server(event.target)
        if server is not None:
            server.kill()
            return
        child = self._child(event.target)
        if child.alive():
            child.process.kill()

    def _restart(self, name: str) -> None:
        number = self.supervisor.restarts()[name] + 1
        server = self._server(name)
        if server is not None:
            # Same ports and config, same JetStream store: clients reconnect by themselves (a
            # cluster node catches up with the others).
            server.restart(ready_timeout_s=None)
            pid = server.pid
        else:
            child = self._child(name)
            child.restart(number)
            pid = child.pid
        self.supervisor.restarted(name, time.monotonic())
        self.print(f"{name} restarted (restart #{number}, pid {pid})")

    def stop(self) -> None:
        """Stop everything: learners, then outers and gateway, then the links that carried
        their last messages, then NATS; kill stragglers."""
        for group in (
            [*self.learners, *self.job_learners()],
            [*self.services, *self.job_outers()],
            self.links,
        ):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                if not child.wait_until(deadline):
                    self.print(
                        f"{child.name} did not stop in {STOP_GRACE_S:.0f}s: killing it "
                        f"(its stack is dumped to {child.log_path})"
                    )
                    child.kill_with_stacks()
        for server in self.servers:
            server.stop()
        with contextlib.suppress(OSError):
            self.write_pids()  # no live PIDs any more: a chaos script must not kill reused ones
