"""Serve the planner, the doctor, runs and reports as a local web app; prints its URL and opens nothing.

    autotune ui                                  # http://127.0.0.1:28000/, runs under ./output
    autotune ui --runs ~/loras --allow-dir /data # another runs folder, one more folder datasets may come from
    autotune ui --host 0.0.0.0 --port 28000      # other machines: every request then needs the printed token
    autotune ui --engine sd-scripts=~/sd-scripts # the page may also start runs in your own sd-scripts

It binds 127.0.0.1 unless told otherwise; bound elsewhere it refuses every request without its token (generated
and printed with the URL, or --token). Dataset folders and model files must lie under the allowed folders
(--allow-dir, repeatable; default: the home folder and the current folder). The HTTP API is in README.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from autotune.ui.security import AccessPolicy

DEFAULT_PORT = 28000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--runs", default="output", metavar="DIR",
                        help="folder holding the runs (default ./output, where autotune run puts them)")
    parser.add_argument("--allow-dir", action="append", default=None, metavar="DIR",
                        help="a folder datasets and models may come from (repeat it; default: home and current)")
    parser.add_argument("--token", default=None, help="the access token (default: generated when not on loopback)")
    parser.add_argument("--engine", metavar="sd-scripts=PATH|musubi-tuner=PATH", action="append", default=None,
                        help="offer your own sd-scripts (a checkout, or a lora-scripts / kohya_ss folder) or "
                             "musubi-tuner checkout as another engine on the new-training page (repeat it for both); "
                             "the path is fixed here, never sent by a page")
    parser.add_argument("--python", default=None, help="with one --engine: the Python that runs it")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autotune.ui.security import AccessPolicy
    from sd_scripts_compat.facts.errors import UserError

    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: give a port between 1 and 65535, e.g. --port {DEFAULT_PORT}")
    for folder in args.allow_dir or []:
        if not Path(folder).expanduser().is_dir():
            raise UserError(f"--allow-dir {folder}: not a folder; give an existing folder")
    runs = Path(args.runs).expanduser().resolve()
    if runs.exists() and not runs.is_dir():
        raise UserError(f"--runs {args.runs}: a file, not a folder; give the folder runs go to")
    policy = AccessPolicy.for_server(args.host, args.port, args.token, args.allow_dir)
    serve(policy, runs, engines(args.engine, args.python))
    return 0


def engines(given: list[str] | None, python: str | None) -> dict[str, list[str]]:
    """The engines the page may choose: autotune's, and the user's engines ``--engine NAME=PATH`` names (the
    registry's, ``launch.engines``; checked now, with absolute paths: runs start in the runs folder), each as the
    ``autotune run`` options it adds."""
    from autotune.launch.engines import OURS, parse_engine
    from sd_scripts_compat.facts.errors import UserError

    offered: dict[str, list[str]] = {OURS: []}
    if python and len(given or []) != 1:
        raise UserError("--python: only with --engine, exactly one (autotune's engine runs in this Python)")
    for engine in given or []:
        kind, root = parse_engine(engine)
        if kind.offer is None or root is None:
            raise UserError(f"--engine {engine}: {kind.name} cannot be offered on the page")
        offered[kind.name] = kind.offer(root, python)
    return offered


def serve(policy: AccessPolicy, runs: Path, offered: dict[str, list[str]] | None = None) -> None:
    """Bind first (a port in use is one line), then print the URL and serve until Ctrl-C."""
    import socket

    import uvicorn

    from autotune.ui.api import create_app
    from sd_scripts_compat.facts.errors import UserError

    sock = socket.socket(socket.AF_INET6 if ":" in policy.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((policy.host, policy.port))
        sock.listen(128)  # connections wait in the backlog from here: the printed URL answers at once
    except OSError as error:
        sock.close()
        raise UserError(f"cannot listen on {policy.host}:{policy.port} ({error.strerror}); choose another --port "
                        "or --host") from None
    host = f"[{policy.host}]" if ":" in policy.host else policy.host
    url = f"http://{host}:{policy.port}/"
    print(f"autotune ui: {url}" + (f"?token={policy.token}  (token: {policy.token})" if policy.token else ""),
          flush=True)
    if offered and len(offered) > 1:
        print("engines: " + ", ".join(offered), flush=True)
    config = uvicorn.Config(create_app(policy, runs, offered), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
