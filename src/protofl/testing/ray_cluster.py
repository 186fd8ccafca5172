"""A multi-node Ray cluster on this machine, for tests and benchmarks of the Ray backend.

:class:`LocalRayCluster` runs ``ray start`` for a head node and N-1 worker nodes on
127.0.0.1, each with its own ``--temp-dir`` under ``root`` and ``cpus`` CPUs, and stops
every process they started by PID: the processes of each ``ray start`` process group (Ray
daemonizes them, so they are not its children), their descendants, and anything naming
the nodes' folder or the head's port (Ray's client-server proxy names neither the temp dir
nor, always, the group). Never ``ray stop``: it stops every Ray cluster of the machine's users.

Ray puts Unix sockets about 70 characters deep in a node's temp dir
(``session_<date>_<time>_<pid>/sockets/plasma_store``), and a socket path may not exceed
107 bytes: when ``root`` is too deep for that (a test's temporary folder), the node folders
go to a short folder of the system temp dir instead, removed by :meth:`stop`.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is removed from the Ray processes' environment:
with it set to 0 the second ``ray start`` refuses to join ("Multi-node Ray clusters are
not supported"). ``PYTHONPATH`` is passed on, so the nodes' workers import the same
protofl as the caller.

    with LocalRayCluster(tmp, nodes=2) as c:
        protofl.run(cfg.replace(**{"execution.backend": "ray", "execution.address": c.address}))
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


# the deepest socket Ray makes in a node's temp dir, with a 7-digit pid, and the longest
# Unix socket path Linux takes (sun_path is 108 bytes with its terminating NUL)
SOCKET_TAIL = "/h/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"
SOCKET_PATH_MAX = 107


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ray_env(fast_failure_detection: bool = False) -> dict[str, str]:
    """The environment for ``ray start`` and drivers of a local multi-node cluster."""
    env = dict(os.environ)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    src = str(Path(__file__).resolve().parents[2])  # the folder that holds the protofl package
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if fast_failure_detection:  # a dead node is noticed within ~3 s instead of ~30 s
        env.update(RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
                   RAY_health_check_failure_threshold="3", RAY_health_check_initial_delay_ms="1000")
    return env


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, pgid, cmdline) of every process we can read."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[int(d.name)] = (int(fields[1]), int(fields[2]), cmd)
        except (OSError, ValueError, IndexError):
            continue
    return out


class LocalRayCluster:
    def __init__(self, root: str | os.PathLike[str], nodes: int = 2, cpus: int = 1,
                 fast_failure_detection: bool = True, timeout: float = 180.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # node folders: under root, or a short folder when root is too deep for the sockets
        deep = len(str(self.root.resolve())) + len(SOCKET_TAIL) > SOCKET_PATH_MAX
        self.nodes_root = Path(tempfile.mkdtemp(prefix="protofl-ray-")) if deep else self.root
        self.nodes, self.cpus, self.timeout = nodes, cpus, timeout
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = ray_env(fast_failure_detection)
        self.started: list[int] = []  # pids of the `ray start` commands, each its own process group
        self.startup_s: Optional[float] = None

    def node_dir(self, i: int) -> Path:
        return self.nodes_root / ("h" if i == 0 else f"w{i}")  # short: Unix socket paths are limited

    def _ray_start(self, args: list[str], name: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        with open(self.root / f"{name}.log", "wb") as log:
            p = subprocess.Popen([ray, "start", *args, f"--num-cpus={self.cpus}", "--disable-usage-stats"],
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                 start_new_session=True)
        self.started.append(p.pid)
        rc = p.wait(timeout=self.timeout)
        if rc != 0:
            raise RuntimeError(f"`ray start` for {name} failed ({rc}): "
                               + (self.root / f"{name}.log").read_text(errors="replace")[-2000:])

    def start(self) -> "LocalRayCluster":
        t0 = time.perf_counter()
        try:
            self._ray_start(["--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                             f"--ray-client-server-port={free_port()}", f"--temp-dir={self.node_dir(0)}",
                             "--include-dashboard=false"], "head")
            for i in range(1, self.nodes):
                self._ray_start([f"--address={self.address}", "--node-ip-address=127.0.0.1",
                                 f"--temp-dir={self.node_dir(i)}"], f"worker{i}")
            self.wait_for_nodes(self.nodes)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def wait_for_nodes(self, n: int) -> None:
        """Until the head counts ``n`` live nodes (asked by a short-lived driver process)."""
        probe = ("import ray,sys,time\nray.init(address=sys.argv[1],log_to_driver=False,logging_level=40)\n"
                 "t=time.time()\nalive=lambda: sum(x['Alive'] for x in ray.nodes())\n"
                 "while alive()<int(sys.argv[2]) and time.time()-t<float(sys.argv[3]): time.sleep(0.2)\n"
                 "print(alive())")
        out = subprocess.run([sys.executable, "-c", probe, self.address, str(n), str(self.timeout)],
                             capture_output=True, text=True, env=self.env, timeout=self.timeout + 60)
        if not out.stdout.strip().endswith(str(n)):
            raise RuntimeError(f"the local Ray cluster has not {n} live nodes: {out.stdout}{out.stderr[-2000:]}")

    def processes(self) -> set[int]:
        """Everything this cluster runs: by process group, temp dir or head port, plus descendants."""
        procs = _procs()
        mine = {pid for pid, (_, pgid, cmd) in procs.items()
                if pgid in self.started or str(self.nodes_root) in cmd
                or ("ray.util.client.server" in cmd and f":{self.port} " in cmd + " ")}
        while True:
            kids = {pid for pid, (ppid, _, _) in procs.items() if ppid in mine} - mine
            if not kids:
                break
            mine |= kids
        return mine - {os.getpid()}

    def raylet(self, i: int) -> int:
        """The pid of node ``i``'s raylet (0 = head)."""
        d = str(self.node_dir(i)) + "/"
        pids = [pid for pid, (_, _, cmd) in _procs().items()
                if cmd.split(" ")[0].endswith("/raylet") and d in cmd]
        if len(pids) != 1:
            raise RuntimeError(f"expected one raylet of node {i}, found {pids}")
        return pids[0]

    def stop(self) -> None:
        """SIGKILL every process of the cluster, by PID, until none is left (then remove the
        short node folder, if one was made)."""
        for _ in range(10):
            pids = self.processes()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        if self.nodes_root != self.root and not self.processes():
            shutil.rmtree(self.nodes_root, ignore_errors=True)

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
