"""Starting Flower's processes for protofl: commands, environment, a local deployment.

The command builders are what ``protofl flower superlink|supernode|run`` execute; they
add the settings every protofl deployment needs:

* the environment: no telemetry, no update check, no Ray usage stats, and runtime
  dependency installation off (the app's dependencies would be installed with ``uv``,
  pulling a second, CUDA, torch) -- ``--disable-runtime-dependency-installation`` on the
  SuperLink; SuperNodes have it off by default;
* the Flower executables of *this* Python environment first on ``PATH``: the SuperLink
  and SuperNodes start ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp``
  by name, and those must import this protofl;
* SuperNodes in ``process`` isolation with one long-lived ClientApp process each
  (:func:`node_command`: :mod:`protofl.flower.node` runs ``flower-supernode --isolation
  process`` and :mod:`protofl.flower.worker`), instead of Flower's default
  ``subprocess`` isolation, which starts a fresh ``flwr-clientapp`` process -- imports,
  data and all -- for every message. ``isolation="subprocess"`` keeps Flower's way.

:class:`LocalDeployment` starts a SuperLink and N SuperNodes on 127.0.0.1 with free
ports, submits runs with ``flwr run`` and stops every process it started by its PID. The
tests and ``benchmarks/flower_overhead.py`` use it; it is also the quickest way to try
a deployment on one machine.
"""
from __future__ import annotations

import datetime as _dt
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def bin_dir() -> Path:
    """The folder of this environment's executables (flower-superlink, flwr, ...)."""
    return Path(sys.executable).parent


def flower_env(base: Optional[dict] = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(FLOWER_ENV)
    env["PATH"] = str(bin_dir()) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


@dataclass
class TLSFiles:
    """PEM files: the CA certificate (given to clients) and the server's certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def superlink_command(host: str = "127.0.0.1", port: int = 9093, tls: Optional[TLSFiles] = None,
                      database: Optional[str] = None, auth: bool = False) -> list[str]:
    """``flower-superlink``; ``auth``: only SuperNodes whose public key was registered may join
    (Flower allows it only with TLS)."""
    cmd = [str(bin_dir() / "flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    if auth:
        cmd.append("--enable-supernode-auth")
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                "--ssl-keyfile", str(tls.server_key)]
    if database:
        cmd += ["--database", database]
    return cmd


ISOLATIONS = ("process", "subprocess")


def supernode_command(superlink: str, partition_id: int, num_partitions: int, port: int = 9094,
                      root_certificates: Optional[Path] = None, insecure: Optional[bool] = None,
                      node_config: Optional[dict[str, Any]] = None, max_wait_time: Optional[float] = None,
                      isolation: str = "subprocess", auth_key: Optional[Path] = None) -> list[str]:
    """``flower-supernode`` serving client ``partition_id`` of a SuperLink at ``superlink`` (host:port).

    ``auth_key``: the node's private key (:func:`supernode_keys`), for a SuperLink started
    with SuperNode authentication.

    ``port`` is the SuperNode's own local Runtime API (where its ClientApp processes
    connect); several SuperNodes on one machine need different ones. With
    ``isolation="process"`` the SuperNode runs no ClientApp by itself: use
    :func:`node_command`, which adds the process that does.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, not {isolation!r}")
    items = {"partition-id": int(partition_id), "num-partitions": int(num_partitions), **(node_config or {})}
    conf = " ".join(f"{k}={v}" if isinstance(v, (int, float)) else f'{k}="{v}"' for k, v in items.items())
    cmd = [str(bin_dir() / "flower-supernode"), "--superlink", superlink, "--host", "127.0.0.1",
           "--port", str(port), "--node-config", conf]
    if root_certificates is None if insecure is None else insecure:
        cmd.append("--insecure")
    if root_certificates is not None:
        cmd += ["--root-certificates", str(root_certificates)]
    if max_wait_time is not None:
        cmd += ["--max-wait-time", str(max_wait_time)]
    if isolation != "subprocess":
        cmd += ["--isolation", isolation]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def node_command(superlink: str, partition_id: int, num_partitions: int, port: int = 9094,
                 root_certificates: Optional[Path] = None, insecure: Optional[bool] = None,
                 node_config: Optional[dict[str, Any]] = None, max_wait_time: Optional[float] = None,
                 isolation: str = "process", auth_key: Optional[Path] = None,
                 rejoin_wait: Optional[float] = None) -> list[str]:
    """What ``protofl flower supernode`` runs: a SuperNode and what runs its ClientApps.

    ``process`` (default): :mod:`protofl.flower.node` starting ``flower-supernode
    --isolation process`` and one long-lived ClientApp worker (:mod:`protofl.flower.worker`)
    on its Runtime API (127.0.0.1:``port``), stopping both together; with ``auth_key`` it
    tries a refused activation again for ``rejoin_wait`` seconds (default
    ``node.REJOIN_WAIT``: a node restarted after a crash rejoins). ``subprocess``: the
    plain ``flower-supernode`` (a fresh ``flwr-clientapp`` process per message).
    """
    cmd = supernode_command(superlink, partition_id, num_partitions, port=port, root_certificates=root_certificates,
                            insecure=insecure, node_config=node_config, max_wait_time=max_wait_time,
                            isolation=isolation, auth_key=auth_key)
    if isolation == "subprocess":
        return cmd
    wait = [] if rejoin_wait is None else ["--rejoin-wait", str(float(rejoin_wait))]
    return [sys.executable, "-m", "protofl.flower.node", "--runtime-api-address", f"127.0.0.1:{port}", *wait,
            "--", *cmd]


def write_connection(flwr_home: Path, name: str, address: str, root_certificates: Optional[Path] = None) -> Path:
    """Add SuperLink connection ``name`` to ``<flwr_home>/config.toml`` (what ``flwr run`` reads)."""
    import tomli
    import tomli_w

    path = Path(flwr_home) / "config.toml"
    data = tomli.loads(path.read_text()) if path.exists() else {}
    links = data.setdefault("superlink", {})
    conn: dict[str, Any] = {"address": address}
    if root_certificates is None:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(Path(root_certificates).resolve())
    links[name] = conn
    links.setdefault("default", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))
    return path


def flwr_run_command(app_dir: Path, connection: str, stream: bool = True,
                     run_config: Sequence[str] = ()) -> list[str]:
    cmd = [str(bin_dir() / "flwr"), "run", str(app_dir), connection]
    for item in run_config:
        cmd += ["--run-config", item]
    if stream:
        cmd.append("--stream")
    return cmd


def register_command(public_key: Path, connection: str, name: Optional[str] = None) -> list[str]:
    """``flwr supernode register``: allow the SuperNode holding this key pair to join (Control API)."""
    cmd = [str(bin_dir() / "flwr"), "supernode", "register", str(public_key), connection]
    if name:
        cmd += ["--name", name]
    return cmd


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (an exited, unreaped child)."""
    proc = Path("/proc")
    if proc.is_dir():  # Linux: read the members' state; a zombie needs no stopping
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
                return True
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float = 10.0) -> None:
    """Stop each process (SIGTERM, SIGKILL after ``timeout``), then what is left of its group.

    Processes started by :class:`LocalDeployment` lead their own process group (the group
    id is their PID), and the processes they start -- ``flower-supernode`` and the
    ClientApp worker under :mod:`protofl.flower.node`, ``flower-superexec``,
    ``flwr-clientapp`` -- stay in it: signalling the group reaches exactly those, also
    when the leader is already gone. All processes are signalled first, then waited
    for, so stopping N of them takes about as long as stopping one.
    """
    def wait_all(items, alive, kill) -> None:
        deadline = time.monotonic() + timeout
        while any(alive(x) for x in items) and time.monotonic() < deadline:
            time.sleep(0.05)
        for x in items:
            if alive(x):
                kill(x)

    pending = [p for p in procs if p.poll() is None]
    for p in pending:
        p.terminate()
    wait_all(pending, lambda p: p.poll() is None, lambda p: p.kill())
    for p in procs:
        if p.returncode is None:
            p.wait(timeout=timeout)
    groups = [p.pid for p in procs if getattr(p, "own_group", False) and _group_alive(p.pid)]
    for pgid in groups:
        os.killpg(pgid, signal.SIGTERM)
    wait_all(groups, _group_alive, lambda g: os.killpg(g, signal.SIGKILL) if _group_alive(g) else None)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    stop_processes([proc], timeout)



# ---------------------------------------------------------------------------------------
# throwaway certificates (trials and tests; use your organization's CA in production)
# ---------------------------------------------------------------------------------------
def throwaway_certificates(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                           days: int = 2) -> TLSFiles:
    """A fresh CA and a server certificate for ``hosts`` (IPs and DNS names), as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("protofl throwaway CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = TLSFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                   serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    os.chmod(files.server_key, 0o600)
    return files


def supernode_keys(folder: Path, names: Sequence[str]) -> dict[str, tuple[Path, Path]]:
    """An ECDSA P-384 key pair per name for SuperNode authentication: ``{name: (private, public)}``.

    ``<name>`` (private key, OpenSSH format, mode 0600: stays on the SuperNode's machine,
    ``--auth-supernode-private-key``) and ``<name>.pub`` (public key, OpenSSH format: give
    it to the SuperLink's operator, who registers it with ``flwr supernode register``).
    An existing pair is kept, never overwritten.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        priv, pub = folder / name, folder / f"{name}.pub"
        if not (priv.exists() and pub.exists()):
            key = ec.generate_private_key(ec.SECP384R1())
            fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
            pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH) + b"\n")
        out[name] = (priv, pub)
    return out


# ---------------------------------------------------------------------------------------
# a whole deployment on this machine
# ---------------------------------------------------------------------------------------
class LocalDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes (partition-id 0..N-1) on 127.0.0.1.

    Each SuperNode is started as :func:`node_command` builds it: by default with one
    long-lived ClientApp process (``isolation="process"``), which lives and dies with it;
    ``isolation="subprocess"`` gives Flower's one ``flwr-clientapp`` process per message.
    Every process gets a log file in ``workdir`` (``flwr-run-<n>.log``: the ServerApp's
    log of the n-th submitted run) and its own ``FLWR_HOME`` (where Flower installs the
    submitted app), so nothing touches ``~/.flwr``. ``stop()``
    (also on leaving the ``with`` block) stops each process it started, by its PID.
    """

    def __init__(self, workdir: Path, num_nodes: int, tls: Optional[TLSFiles] = None,
                 node_config: Optional[dict[str, Any]] = None, isolation: str = "process",
                 auth: bool = False) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, not {isolation!r}")
        if auth and tls is None:
            raise ValueError("SuperNode authentication needs TLS (Flower refuses it on plain HTTP): pass tls")
        self.workdir = Path(workdir)
        # the nodes keep their clients' state in the workdir (not in ~/.cache) unless told otherwise
        node_config = {"state-dir": str(self.workdir / "node-state"), **(node_config or {})}
        self.num_nodes, self.tls, self.node_config, self.isolation = num_nodes, tls, node_config, isolation
        self.auth = auth  # SuperNode authentication: a key pair per node, registered before it starts
        self.port = 0
        self.superlink: Optional[subprocess.Popen] = None
        self.nodes: list[subprocess.Popen] = []
        self._others: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        self._runs = 0
        # SuperExecs look for new tasks every 0.2 s instead of 1 s: cheap on one machine
        self.env = flower_env(FLWR_HOME=str(self.workdir / "flwr-home-cli"), FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, cmd: list[str], name: str, home: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        self._logs.append(log)
        env = dict(self.env, FLWR_HOME=str(self.workdir / home))
        proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        proc.own_group = True  # type: ignore[attr-defined]  # see stop_process
        return proc

    def start(self, timeout: float = 60.0) -> "LocalDeployment":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.port = free_port()
            self.superlink = self._spawn(superlink_command(port=self.port, tls=self.tls, auth=self.auth),
                                         "superlink", "flwr-home-link")
            wait_for_port(self.port, timeout)
            write_connection(self.workdir / "flwr-home-cli", "local", self.address,
                             None if self.tls is None else self.tls.ca_cert)
            for i in range(self.num_nodes):
                self.start_node(i)
        except BaseException:  # nothing started may outlive a failed start
            self.stop()
            raise
        return self

    def register(self, public_key: Path, name: Optional[str] = None) -> None:
        """Allow the SuperNode with this public key in (``flwr supernode register``)."""
        res = subprocess.run(register_command(public_key, "local", name), cwd=self.workdir, env=self.env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"registering {public_key} failed: {(res.stdout + res.stderr)[-2000:]}")

    def start_node(self, partition_id: int, insecure: Optional[bool] = None, name: Optional[str] = None,
                   max_wait_time: Optional[float] = None, auth_key: Optional[Path] = None,
                   rejoin_wait: Optional[float] = None) -> subprocess.Popen:
        """Start a SuperNode for ``partition_id`` (TLS when the deployment has it, unless ``insecure``).

        With ``auth``, a node started without ``auth_key`` gets the key pair
        ``keys/supernode-<k>`` (made and registered on first use); a node given ``auth_key``
        uses that private key as it is, registered or not. ``rejoin_wait``: see
        :func:`node_command`.
        """
        name_ = name or f"supernode-{partition_id}"
        if self.auth and auth_key is None:
            auth_key, pub = supernode_keys(self.workdir / "keys", [name_])[name_]
            if not (self.workdir / "keys" / f"{name_}.registered").exists():
                self.register(pub, name_)
                (self.workdir / "keys" / f"{name_}.registered").touch()
        root = None if self.tls is None or insecure else self.tls.ca_cert
        cmd = node_command(self.address, partition_id, self.num_nodes, port=free_port(),
                           root_certificates=root, insecure=insecure, node_config=self.node_config,
                           max_wait_time=max_wait_time, isolation=self.isolation, auth_key=auth_key,
                           rejoin_wait=rejoin_wait)
        proc = self._spawn(cmd, name_, f"flwr-home-{name_}")
        if name is None:
            self.nodes.append(proc)
        else:
            self._others.append(proc)
        return proc

    def submit(self, cfg, run_dir: Path, timeout: float = 600.0, **settings: Any) -> subprocess.CompletedProcess:
        """Write the app for ``cfg``, ``flwr run`` it with its logs streamed, wait for the end.

        Under ``auth`` the run binds each client to its first node (``bind_clients``,
        unless the settings say otherwise): node ids are the registered keys'.
        """
        from .project import write_app

        if self.auth:
            settings.setdefault("bind_clients", True)
        self._runs += 1
        app = write_app(cfg, self.workdir / f"app-{self._runs}", run_dir=str(Path(run_dir).resolve()), **settings)
        proc = subprocess.Popen(flwr_run_command(app, "local", stream=True), cwd=self.workdir, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        proc.own_group = True  # type: ignore[attr-defined]
        self._others.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            stop_process(proc)
        from .project import plain_text

        text = plain_text(out.decode(errors="replace"))  # the flwr CLI's own lines may carry colours too
        (self.workdir / f"flwr-run-{self._runs}.log").write_text(text)
        return subprocess.CompletedProcess(proc.args, proc.returncode, text)

    def kill_node(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Crash SuperNode ``index`` with its ClientApp, as a machine failure would.

        SIGKILL (the default) to its process group -- the SuperNode, its ClientApp
        process(es) and, in ``process`` isolation, the supervisor: no goodbye to the
        SuperLink, which notices only when heartbeats stop.
        """
        proc = self.nodes[index]
        if _group_alive(proc.pid):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=10)

    def restart_node(self, index: int) -> subprocess.Popen:
        """Start SuperNode ``index`` again (after :meth:`kill_node`), same partition and state folder."""
        if self.nodes[index].poll() is None:
            raise RuntimeError(f"SuperNode {index} is still running")
        old = self.workdir / f"supernode-{index}.log"
        if old.exists():  # keep the first life's log beside the new one
            n = 1
            while (self.workdir / f"supernode-{index}.{n}.log").exists():
                n += 1
            old.rename(self.workdir / f"supernode-{index}.{n}.log")
        proc = self.start_node(index)
        self.nodes[index] = self.nodes.pop()  # start_node appended it
        return proc

    def serverapp_pids(self) -> list[int]:
        """PIDs of the running ServerApp processes (``flwr-serverapp``, started by the SuperLink's
        ``flower-superexec``, which leads a session of its own: found by ancestry, Linux only)."""
        superlink = self.superlink
        if superlink is None or not Path("/proc").is_dir():
            return []
        parent, exe = {}, {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (d / "cmdline").read_bytes().split(b"\0")[:2]
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(d.name)] = int(fields[1])
                exe[int(d.name)] = {Path(c.decode(errors="replace")).name for c in cmd}

        def under_superlink(pid: int) -> bool:
            for _ in range(8):
                pid = parent.get(pid, 0)
                if pid == superlink.pid:
                    return True
            return False

        return sorted(p for p, names in exe.items() if "flwr-serverapp" in names and under_superlink(p))

    def stop(self) -> None:
        # the clients together first, then the SuperLink (SuperNodes say goodbye to it)
        for group in (self._others + self.nodes, [self.superlink] if self.superlink else []):
            try:
                stop_processes(group)
            except Exception:  # still make sure nothing outlives us
                for p in group:
                    if p.poll() is None:
                        p.kill()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
