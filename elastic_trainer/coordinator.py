"""``python -m elastic_trainer.coordinator``: JAX's coordination service for a job, as a task of its own.

Run it once per job, apart from the training processes (a Slurm step or
task of its own, a Kubernetes pod behind a Service), and start the training
processes with ``cluster.launcher=none`` and ``JAX_COORDINATOR_ADDRESS`` set
to its ``host:port``: then any training process may die and the others go
on. It serves until SIGTERM or Ctrl-C. (The local launcher,
``cluster.launcher=local``, hosts the service itself.)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .clusters.multicontroller._coordinator import DEFAULT_HEARTBEAT_TIMEOUT_S, serve

DEFAULT_PORT = 8476
"""The port JAX's own cluster detection uses for its coordinator when none is given."""


def main(argv: list[str] | None = None) -> int:
    """Serve until a stop signal; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m elastic_trainer.coordinator", description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, required=True, help="training processes in the job "
                        "(cluster.num_processes)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument("--bind", default="[::]", help="address to listen on (default: every address)")
    parser.add_argument("--heartbeat-timeout-s", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help="a silent process is declared dead after this long (cluster.heartbeat_timeout_s; "
                        f"default {DEFAULT_HEARTBEAT_TIMEOUT_S})")
    args = parser.parse_args(argv)
    if args.num_processes < 1 or args.heartbeat_timeout_s < 1 or not 0 < args.port < 65536:
        parser.error("--num-processes and --heartbeat-timeout-s must be at least 1, and --port a TCP port")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with serve(f"{args.bind}:{args.port}", num_processes=args.num_processes,
               heartbeat_timeout_s=args.heartbeat_timeout_s):
        print(f"elastic_trainer: coordinator: serving a job of {args.num_processes} processes on port {args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
