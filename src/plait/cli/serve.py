"""`plait serve SPEC --job NAME`: run a job for thin trainer clients (no Ray in the trainers): on Ray
(default), or all of it in this one process (`--runtime local`, no Ray at all)."""

from __future__ import annotations

import argparse
import os
import signal
import warnings
from pathlib import Path

from plait.cli.common import console, loaders_arg, positive_int
from plait.errors import PlaitError
from plait.spec import load_spec

RENAMED = {"--address": "--listen", "--prefetch": "--build-ahead"}  # one name, one meaning at every layer
HELP = "run a job on Ray and serve its batches to thin trainer clients over Arrow Flight"
DESCRIPTION = (
    "Create job NAME of SPEC on Ray (a local instance unless --ray-address) and serve its micro-batches over "
    "Arrow Flight: each Constructor serves its ranks' builds, and one rendezvous address (--listen, loopback "
    "by default) tells each trainer where. Prints PLAIT_ADDRESS and PLAIT_TOKEN (a fresh per-job token, or "
    "PLAIT_TOKEN from the environment) for the trainer processes, which use "
    "plait.Loader(spec, dp_rank, runtime=\"flight\"). A trainer on another node of the Ray cluster is served by a "
    "Constructor on its own node (PLAIT_NODE: that node's Ray id, name or IP; else its connection's address). "
    "Runs until stopped (Ctrl-C or SIGTERM), then ends the job. "
    "--runtime local: no Ray; this one process plans, loads every source and builds every rank's batches "
    "(plait.runtime.serve_local), the least memory for a one-node job."
)


def add_arguments(p) -> None:
    p.add_argument("spec", help="the spec (YAML)")
    p.add_argument("--job", required=True, help="the job's name")
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="where the rendezvous listens, host:port (default 127.0.0.1 on a free port)")
    p.add_argument("--runtime", choices=["ray", "local"], default="ray",
                   help="ray (default): the job's roles are Ray actors; local: all in this process, no Ray")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (auto, host:port); default: start a local one")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard with the local instance (off by default)")
    p.add_argument("--dp", type=positive_int, default=None, help="override topology.dp")
    p.add_argument("--loaders", type=loaders_arg, default="auto", help="SourceLoader actors: auto or a number")
    p.add_argument("--build-ahead", type=int, default=2, help="steps built ahead of each rank's request (default 2)")
    p.add_argument("--constructors", choices=["node", "replica"], default="node",
                   help="one Constructor per node (default) or per DP replica")
    for old, new in RENAMED.items():  # the old names still work, with a DeprecationWarning
        p.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=DeprecatedFlag, help=argparse.SUPPRESS,
                       default=argparse.SUPPRESS, type=int if new == "--build-ahead" else str)
    p.add_argument("--token-file", metavar="PATH", help="also write the token to PATH (mode 0600) for PLAIT_TOKEN_FILE")


class DeprecatedFlag(argparse.Action):
    """An option's old name: sets the new one's value, with a DeprecationWarning."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = next(n for o, n in RENAMED.items() if o == option_string)
        warnings.warn(f"plait serve {option_string} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def _server(args, spec):
    token = os.environ.get("PLAIT_TOKEN") or None
    if args.runtime == "local":
        if args.ray_address or args.dashboard:
            flag = "--ray-address" if args.ray_address else "--dashboard"
            raise PlaitError(f"{flag}: --runtime local uses no Ray (drop one of them)")
        from plait.runtime.serve_local import LocalJobServer

        return LocalJobServer(spec, args.job, args.listen, token=token, build_ahead=args.build_ahead)
    from plait.runtime.ray.serving import JobServer

    options = {"loaders": args.loaders, "build_ahead": args.build_ahead, "constructors": args.constructors}
    if args.ray_address:
        options["address"] = args.ray_address
    if args.dashboard:
        options["dashboard"] = True
    return JobServer(spec, args.job, args.listen, token=token, **options)


def run(args) -> int:
    spec = load_spec(args.spec)
    if args.dp:
        spec = spec.with_overrides(topology={"dp": args.dp})
    server = _server(args, spec)
    try:
        # After Ray started, if it did (it installs its own handlers): SIGTERM and SIGINT, even where the launcher
        # left SIGINT ignored (a background job of a script), end the job cleanly.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _interrupt)
        if args.token_file:
            path = Path(args.token_file)
            path.touch(mode=0o600)
            path.chmod(0o600)
            path.write_text(server.token + "\n")
        print(f"PLAIT_ADDRESS={server.address}", flush=True)
        print(f"PLAIT_TOKEN={server.token}", flush=True)
        console.print(f"serving job {args.job!r} ({spec.topology.dp} DP ranks, {args.runtime} runtime) at "
                      f"{server.address}; "
                      "trainers: plait.Loader(spec, dp_rank, runtime=\"flight\") with PLAIT_ADDRESS and "
                      "PLAIT_TOKEN set; Ctrl-C ends the job", highlight=False)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
