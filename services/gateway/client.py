"""``diloco jobs|job|unit|units``: a thin command-line client of the gateway's REST API.

    diloco jobs                                   list the registry
    diloco job create -f spec.toml                create a job (TOML keys = JobSpec fields)
    diloco job show|start|pause|resume|stop|delete JOB
    diloco unit start|pause|resume|stop JOB UNIT
    diloco units scale JOB N

Every command prints the gateway's JSON answer. On a 4xx/5xx answer it prints the gateway's
message to stderr and exits 1 (2 for a local problem such as an unreadable spec file).
``--gateway`` (env ``DILOCO_GATEWAY``) and the token (env ``DILOCO_TOKEN``, or ``--token-file``;
never a flag, which ``ps`` would show) say where and as whom; ``diloco up`` prints its gateway's
token and writes it to ``<data-dir>/token``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from typing import Any

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
TIMEOUT_S = 30.0
EXIT_REFUSED = 1  # the gateway answered 4xx/5xx, or could not be reached
EXIT_USAGE = 2


class ClientError(RuntimeError):
    """A call failed; the message is what the user should read."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _message(response: httpx.Response) -> str:
    """The gateway's reason for a refusal, as one readable text."""
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    if isinstance(detail, list):  # FastAPI's 422: one entry per invalid field
        detail = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg')}"
            for item in detail
            if isinstance(item, dict)
        )
    return f"{response.status_code} {response.reason_phrase}: {detail}"


def _token(args: argparse.Namespace) -> str:
    """The API token: from ``--token-file`` if given, else ``DILOCO_TOKEN`` ("" if neither).

    Raises:
        ClientError: the token file cannot be read.
    """
    if args.token_file is None:
        return os.environ.get("DILOCO_TOKEN", "").strip()
    try:
        with open(args.token_file, encoding="utf-8") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ClientError(f"cannot read token file {args.token_file}: {err}", EXIT_USAGE) from None


def call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    """One request to the gateway; returns the decoded JSON answer.

    Raises:
        ClientError: when the gateway cannot be reached or answers 4xx/5xx.
    """
    token = _token(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=args.gateway, timeout=TIMEOUT_S, headers=headers) as client:
            response = client.request(method, path, json=body)
    except httpx.HTTPError as err:
        raise ClientError(f"cannot reach the gateway at {args.gateway}: {err}") from None
    if response.status_code >= 400:
        raise ClientError(_message(response))
    return response.json()


def read_spec(path: str) -> dict[str, Any]:
    """A job spec from a TOML file (flat keys; ``-`` or ``_``; [sections] only group keys)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ClientError(f"cannot read spec file {path}: {err}", EXIT_USAGE) from None
    spec: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        spec.update({k.replace("-", "_"): v for k, v in items})
    return spec


def _run(args: argparse.Namespace) -> Any:
    group, action = args.group, getattr(args, "action", None)
    if group == "jobs":
        return call(args, "GET", "/jobs")
    if group == "job":
        if action == "create":
            return call(args, "POST", "/jobs", read_spec(args.file))
        if action == "show":
            return call(args, "GET", f"/jobs/{args.job}")
        if action == "delete":
            return call(args, "DELETE", f"/jobs/{args.job}")
        return call(args, "POST", f"/jobs/{args.job}/{action}")
    if group == "unit":
        return call(args, "POST", f"/jobs/{args.job}/units/{args.unit}/{action}")
    if group == "units":
        return call(args, "PUT", f"/jobs/{args.job}/units", {"units": args.units})
    raise ClientError(f"unknown command {group}", EXIT_USAGE)


def run_client(args: argparse.Namespace) -> int:
    """Run one client command (the handler of ``diloco jobs|job|unit|units``)."""
    try:
        result = _run(args)
    except ClientError as err:
        print(f"diloco {args.group}: {err}", file=sys.stderr)
        return err.exit_code
    print(json.dumps(result, indent=2))
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # --token must not pass for --token-file
    parser.add_argument(
        "--gateway",
        default=os.environ.get("DILOCO_GATEWAY", DEFAULT_GATEWAY),
        help=f"gateway URL (default: {DEFAULT_GATEWAY}) [env: DILOCO_GATEWAY]",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help="file holding the gateway's API token, needed to change anything (e.g. "
        "data/token) [or env: DILOCO_TOKEN]",
    )
    parser.set_defaults(handler=run_client)


def add_client_commands(commands: Any) -> None:
    """Add ``jobs``, ``job``, ``unit`` and ``units`` to the ``diloco`` subcommands."""
    jobs = commands.add_parser("jobs", help="list the jobs of the gateway's registry")
    _common(jobs)
    jobs.set_defaults(group="jobs")

    job = commands.add_parser("job", help="create, show, start, pause, resume, stop, delete a job")
    actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a job from a TOML spec file")
    create.add_argument("-f", "--file", required=True, help="TOML file, keys = JobSpec fields")
    _common(create)
    for name in ("show", "start", "pause", "resume", "stop", "delete"):
        sub = actions.add_parser(name, help=f"{name} a job")
        sub.add_argument("job", help="job name")
        _common(sub)
    job.set_defaults(group="job")

    unit = commands.add_parser("unit", help="start, pause, resume or stop one unit of a job")
    actions = unit.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name in ("start", "pause", "resume", "stop"):
        sub = actions.add_parser(name, help=f"{name} a unit")
        sub.add_argument("job", help="job name")
        sub.add_argument("unit", type=int, help="unit index")
        _common(sub)
    unit.set_defaults(group="unit")

    units = commands.add_parser("units", help="scale a job's units")
    actions = units.add_subparsers(dest="action", required=True, metavar="ACTION")
    scale = actions.add_parser("scale", help="set the number of units of a job")
    scale.add_argument("job", help="job name")
    scale.add_argument("units", type=int, help="new number of units")
    _common(scale)
    units.set_defaults(group="units")
