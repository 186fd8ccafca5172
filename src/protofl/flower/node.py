"""A SuperNode and its long-lived ClientApp process, started and stopped as one.

    python -m protofl.flower.node --runtime-api-address 127.0.0.1:9094 -- \\
        flower-supernode ... --isolation process --host 127.0.0.1 --port 9094

is what ``protofl flower supernode`` runs (it replaces itself with this process, same
PID) and what :class:`~protofl.flower.launch.LocalDeployment` starts per client. It

* starts the ``flower-supernode`` command given after ``--`` (``--isolation process``:
  the SuperNode then starts no ClientApp processes of its own);
* starts ``python -m protofl.flower.worker`` (:mod:`protofl.flower.worker`), the one
  ClientApp process that serves all of the node's messages, connected to the SuperNode's
  Runtime API at ``--runtime-api-address`` and watching the SuperNode's PID;
* starts the worker again if it dies while the SuperNode runs (a crashed ClientApp);
* under SuperNode authentication, starts the SuperNode again when the SuperLink refuses
  to activate it (Flower's exit 305 "Failed to activate SuperNode", read from the
  SuperNode's output, which passes through this process to its stdout) within
  ``--rejoin-wait`` seconds of the start: with
  authentication a node's id is its key's, and a node restarted after a crash is refused
  while the SuperLink still counts its old session online -- until two of Flower's
  30-second heartbeat intervals have passed without a heartbeat (``HEARTBEAT_PATIENCE``
  x ``HEARTBEAT_DEFAULT_INTERVAL``, neither configurable in Flower 1.41). A key nobody
  registered is refused the same way, so it too is tried until ``--rejoin-wait`` ends;
* stops both on SIGTERM/SIGINT/SIGHUP (SIGTERM, SIGKILL after ``--stop-timeout``
  seconds), and when the SuperNode exits; its exit status is the SuperNode's.

Both children stay in this process's process group, so signalling the group (as
``LocalDeployment`` does) reaches all three. Only the standard library is imported here:
the supervisor itself costs next to nothing.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

RESTART_DELAY = 1.0  # seconds between a worker's death and its restart (doubled while it keeps dying fast)
# Flower 1.41: a SuperLink counts a node online until HEARTBEAT_PATIENCE (2) x its heartbeat
# interval (30 s) after the last heartbeat, and refuses to activate it again before then
REJOIN_WAIT = 2 * 30.0 + 30.0  # seconds in which a refused activation is tried again
REJOIN_EVERY = 5.0
# what flower-supernode logs when the SuperLink refuses to activate it (its process exits 1)
NOT_ACTIVATED = b"Failed to activate SuperNode"
AUTH_FLAG = "--auth-supernode-private-key"


def _say(msg: str) -> None:
    print(f"[protofl node] {msg}", file=sys.stderr, flush=True)


def worker_command(runtime_api_address: str, parent_pid: Optional[int] = None,
                   poll_interval: Optional[float] = None) -> list[str]:
    cmd = [sys.executable, "-m", "protofl.flower.worker", "--runtime-api-address", runtime_api_address]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    if poll_interval is not None:
        cmd += ["--poll-interval", str(poll_interval)]
    return cmd


def _stop(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(node_cmd: Sequence[str], runtime_api_address: str, *, stop_timeout: float = 8.0,
              poll_interval: Optional[float] = None, rejoin_wait: Optional[float] = None) -> int:
    """Run the SuperNode ``node_cmd`` with a ClientApp worker; returns the SuperNode's exit status.

    ``rejoin_wait``: seconds from the start in which a SuperNode refused activation is
    started again every ``REJOIN_EVERY`` seconds; default ``REJOIN_WAIT`` when ``node_cmd``
    authenticates (``--auth-supernode-private-key``), else 0.
    """
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if rejoin_wait is None:
        rejoin_wait = REJOIN_WAIT if AUTH_FLAG in node_cmd else 0.0
    t0 = time.monotonic()
    while True:
        rc, refused = _life(node_cmd, runtime_api_address, signals, stop_timeout, poll_interval)
        if signals or not refused or time.monotonic() - t0 + REJOIN_EVERY > rejoin_wait:
            return rc if rc is not None else 1
        _say(f"the SuperLink refused to activate this SuperNode: a node restarted after a crash is refused "
             f"until the SuperLink stops counting its old session online (up to 60 s), a key nobody "
             f"registered always; trying again in {REJOIN_EVERY:.0f} s (for up to {rejoin_wait:.0f} s "
             f"from the start)")
        deadline = time.monotonic() + REJOIN_EVERY
        while not signals and time.monotonic() < deadline:
            time.sleep(0.1)
        if signals:
            return rc


def _relay(stream, refused: list[bool]) -> None:
    """Copy the SuperNode's output to ours, line by line, noting a refused activation."""
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        if NOT_ACTIVATED in line:
            refused.append(True)
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):  # our stdout closed: keep draining, or the node blocks
            pass
    stream.close()


def _life(node_cmd: Sequence[str], runtime_api_address: str, signals: list[int], stop_timeout: float,
          poll_interval: Optional[float]) -> tuple[int, bool]:
    """One SuperNode process and its worker(s), until the node exits or a signal arrives.

    Returns the node's exit status and whether the SuperLink refused to activate it.
    """
    node = subprocess.Popen(list(node_cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    refused: list[bool] = []
    relay = threading.Thread(target=_relay, args=(node.stdout, refused), daemon=True)
    relay.start()
    _say(f"SuperNode pid {node.pid}")

    def start_worker() -> subprocess.Popen:
        w = subprocess.Popen(worker_command(runtime_api_address, node.pid, poll_interval), stdin=subprocess.DEVNULL)
        _say(f"ClientApp worker pid {w.pid} (Runtime API {runtime_api_address})")
        return w

    worker, started = start_worker(), time.monotonic()
    died_at: Optional[float] = None
    delay = RESTART_DELAY
    try:
        while not signals and node.poll() is None:
            if worker.poll() is not None:
                if died_at is None:
                    died_at = time.monotonic()
                    delay = min(2 * delay, 30.0) if died_at - started < 10.0 else RESTART_DELAY
                    _say(f"ClientApp worker pid {worker.pid} exited with {worker.returncode}; "
                         f"starting another in {delay:.0f} s")
                elif time.monotonic() - died_at >= delay:
                    (worker, started), died_at = (start_worker(), time.monotonic()), None
            time.sleep(0.1)
        if signals and signals[0] == signal.SIGINT and node.poll() is None:
            # Ctrl-C in a terminal reaches the whole group: give the children a moment to
            # stop by themselves (a second signal would cut Flower's clean exit short)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and (node.poll() is None or worker.poll() is None):
                time.sleep(0.1)
    finally:
        _stop([worker, node], stop_timeout)
        relay.join(timeout=5.0)
    return node.returncode, bool(refused)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m protofl.flower.node [options] -- flower-supernode ARGS...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m protofl.flower.node", description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", required=True,
                    help="the SuperNode's Runtime API host:port (its --host and --port)")
    ap.add_argument("--stop-timeout", type=float, default=8.0, help="seconds before SIGKILL when stopping")
    ap.add_argument("--poll-interval", type=float, help="the worker's task poll interval while idle")
    ap.add_argument("--rejoin-wait", type=float,
                    help=f"seconds from the start in which a SuperNode the SuperLink refuses to activate "
                         f"(\"{NOT_ACTIVATED.decode()}\") is started again (default {REJOIN_WAIT:.0f} with "
                         f"{AUTH_FLAG}, else 0)")
    args = ap.parse_args(argv[:cut])
    node_cmd = argv[cut + 1:]
    if not node_cmd:
        ap.error("no SuperNode command after --")
    rc = supervise(node_cmd, args.runtime_api_address, stop_timeout=args.stop_timeout,
                   poll_interval=args.poll_interval, rejoin_wait=args.rejoin_wait)
    return 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
