"""``diloco``: one command line for every service and for a whole local cluster.

    diloco up        start nats-server, outer, gateway and N learners; show progress
    diloco learner   run one learner unit against a NATS URL
    diloco outer     run the outer optimizer of a job
    diloco gateway   run the REST gateway
    diloco link      a shaped link (rate, delay, outages) in front of nats-server
    diloco broker    nats-server of a docker-compose cluster, with the cluster's secrets
    diloco controller  the containers of REST-created jobs in a docker-compose cluster
    diloco loadtest  synthetic units against a real outer: ingest, latency, saturation point
    diloco jobs | job | unit | units   control jobs through a gateway (services/gateway/client.py)

Every option is also an environment variable ``DILOCO_<NAME>`` and a key of the job
configuration file given with ``--config job.toml``; flags win over the environment, which wins
over the file. ``diloco <command> --help`` lists them. docker-compose runs these same commands.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from shared.memory import keep_freed_memory
from shared.runtime import setup_logging
from shared.settings import SettingsError
from shared.settings.cli import add_settings_arguments, settings_from_args

log = logging.getLogger("diloco")

# Exit status of an outer that lost its lease to another outer (EX_TEMPFAIL: start it again).
EXIT_LEASE_LOST = 75
CLIENT_COMMANDS = ("jobs", "job", "unit", "units")  # services/gateway/client.py


def _settings(cls, args: argparse.Namespace):
    """Settings of one command from its flags, the environment and the config file."""
    from services.gateway.settings import GatewaySettings
    from services.learner.settings import LearnerSettings
    from services.link.settings import LinkSettings
    from services.loadtest.settings import LoadtestSettings
    from services.orchestration.compose.settings import (
        BrokerSettings,
        ControllerSettings,
        CredentialsSettings,
    )
    from services.orchestration.local.settings import UpSettings
    from services.outer.settings import OuterSettings

    known = set()
    for settings_cls in (
        BrokerSettings,
        ControllerSettings,
        CredentialsSettings,
        UpSettings,
        LearnerSettings,
        OuterSettings,
        GatewaySettings,
        LinkSettings,
        LoadtestSettings,
    ):
        known |= set(settings_cls.model_fields)
    return settings_from_args(cls, args, args.config or os.environ.get("DILOCO_CONFIG"), known)


def _cmd_up(args: argparse.Namespace) -> int:
    from services.orchestration.local.run import run_up
    from services.orchestration.local.settings import UpSettings

    return run_up(_settings(UpSettings, args))


def _cmd_learner(args: argparse.Namespace) -> int:
    from services.learner.service import install_stop_signals, run_learner
    from services.learner.settings import LearnerSettings

    settings = _settings(LearnerSettings, args)
    process = f".{settings.process_id}" if settings.num_processes > 1 else ""
    setup_logging(args.log_level, f"learner-{settings.unit}{process}")
    stop = threading.Event()
    install_stop_signals(stop)
    run_learner(settings, stop)
    return 0


def _cmd_outer(args: argparse.Namespace) -> int:
    from services.outer.lease import LeaseLost
    from services.outer.service import OuterService
    from services.outer.settings import OuterSettings

    settings = _settings(OuterSettings, args)
    setup_logging(args.log_level, "outer")
    keep_freed_memory()  # the outer allocates fragment-sized arrays for every upload

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await OuterService(settings, stop).run()

    try:
        asyncio.run(main())
    except LeaseLost as lost:
        # Another outer leads the job now; exit so a supervisor restarts this one as a standby.
        print(f"outer: {lost}", file=sys.stderr)
        return EXIT_LEASE_LOST
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    settings = _settings(GatewaySettings, args)
    setup_logging(args.log_level, "gateway")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
    return 0


def _cmd_broker(args: argparse.Namespace) -> int:
    from services.orchestration.compose.broker import run_broker
    from services.orchestration.compose.settings import BrokerSettings

    settings = _settings(BrokerSettings, args)
    setup_logging(args.log_level, "broker")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    return run_broker(settings, stop)


def _cmd_credentials(args: argparse.Namespace) -> int:
    from services.orchestration.compose.join import learner_credentials
    from services.orchestration.compose.settings import CredentialsSettings
    from shared.nats_auth import CredentialsError

    settings = _settings(CredentialsSettings, args)
    try:
        path = learner_credentials(settings)
    except CredentialsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(path.read_text())
    return 0


def _cmd_controller(args: argparse.Namespace) -> int:
    from services.orchestration.compose.controller import run_controller
    from services.orchestration.compose.settings import ControllerSettings

    settings = _settings(ControllerSettings, args)
    setup_logging(args.log_level, "controller")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_controller(settings, stop)

    return asyncio.run(main())


def _cmd_link(args: argparse.Namespace) -> int:
    from services.link.service import run_link
    from services.link.settings import LinkSettings

    settings = _settings(LinkSettings, args)
    setup_logging(args.log_level, f"link-{settings.name}")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_link(settings, stop)

    asyncio.run(main())
    return 0


def _cmd_loadtest(args: argparse.Namespace) -> int:
    from services.loadtest.run import run_loadtest
    from services.loadtest.settings import LoadtestSettings
    from services.loadtest.stage import StageError
    from services.orchestration.nats_server import BrokerError

    settings = _settings(LoadtestSettings, args)
    setup_logging(args.log_level, "loadtest")
    try:
        report = run_loadtest(settings)
    except (StageError, BrokerError) as err:
        print(f"diloco loadtest: {err}", file=sys.stderr)
        return 1
    return 0 if all(stage.books.balanced for stage in report.stages) else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``diloco`` argument parser with one subcommand per service."""
    from services.gateway.settings import GatewaySettings
    from services.learner.settings import LearnerSettings
    from services.link.settings import LinkSettings
    from services.loadtest.settings import LoadtestSettings
    from services.orchestration.compose.settings import (
        BrokerSettings,
        ControllerSettings,
        CredentialsSettings,
    )
    from services.orchestration.local.settings import UpSettings
    from services.outer.settings import OuterSettings

    parser = argparse.ArgumentParser(
        prog="diloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    table = [
        (
            "up",
            UpSettings,
            _cmd_up,
            "run a whole local cluster (nats-server, outer, gateway, learners) until it finishes",
        ),
        ("learner", LearnerSettings, _cmd_learner, "run one learner unit"),
        ("outer", OuterSettings, _cmd_outer, "run the outer optimizer of a job"),
        ("gateway", GatewaySettings, _cmd_gateway, "run the REST gateway"),
        ("link", LinkSettings, _cmd_link, "a shaped link in front of nats-server"),
        (
            "broker",
            BrokerSettings,
            _cmd_broker,
            "nats-server of a compose cluster, with the cluster's secrets (docker-compose.yml)",
        ),
        (
            "controller",
            ControllerSettings,
            _cmd_controller,
            "start and supervise the containers of REST-created jobs (docker-compose.yml)",
        ),
        (
            "credentials",
            CredentialsSettings,
            _cmd_credentials,
            "make the NATS user of a unit that joins a compose cluster from outside; print it",
        ),
        (
            "loadtest",
            LoadtestSettings,
            _cmd_loadtest,
            "synthetic units against a real outer: ingest, sync latency, saturation point",
        ),
    ]
    for name, settings_cls, handler, help_text in table:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=(settings_cls.__doc__ or help_text).strip(),
            allow_abbrev=False,  # --token must not pass for --token-file
        )
        add_settings_arguments(sub, settings_cls)
        sub.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
        sub.add_argument(
            "--config",
            metavar="FILE",
            help="job configuration file (TOML, keys = option names) [env: DILOCO_CONFIG]",
        )
        sub.set_defaults(handler=handler)
    from services.gateway.client import add_client_commands

    add_client_commands(commands)
    return parser


def _add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--version``: print ``diloco <installed version of decoupled-diloco>`` and exit."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("decoupled-diloco")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diloco`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        # Answered before build_parser(), which imports the services' settings (and JAX).
        _add_version(argparse.ArgumentParser(prog="diloco")).parse_args(argv)
    if argv and argv[0] in CLIENT_COMMANDS:
        # A client command: no service settings to build (they import JAX), no logging set-up.
        from services.gateway.client import add_client_commands

        parser = argparse.ArgumentParser(prog="diloco", description=__doc__)
        add_client_commands(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        return int(args.handler(args))
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except SettingsError as err:
        print(f"diloco {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
