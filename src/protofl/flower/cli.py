"""``protofl flower ...``: deploy a protofl run over Flower (needs ``pip install 'protofl[flower]'``).

    protofl flower superlink [--host H] [--port P] [--certs DIR | --insecure] [--auth]
    protofl flower supernode --superlink H:P --partition-id K --num-partitions N [--root-certificates CA | --insecure]
                             [--isolation process|subprocess] [--auth-key PRIVATE_KEY] [--state-dir DIR]
    protofl flower app CONFIG [overrides] --out DIR [--bind-clients]   # the Flower App project of a run
    protofl flower run CONFIG [overrides] --connection NAME [--stream] [--resume] [--bind-clients]   # app + `flwr run`
    protofl flower local CONFIG [overrides] [--tls | --auth] [--resume]   # everything on this machine, for a trial
    protofl flower certs DIR [--host H ...]              # a throwaway CA and server certificate
    protofl flower keys DIR [--name N ... | --count K]   # SuperNode key pairs (authentication)
    protofl flower register PUBLIC_KEY ... --connection NAME   # allow those SuperNodes in

``superlink`` and ``supernode`` replace themselves (same PID) with ``flower-superlink`` /
the SuperNode after adding protofl's settings (see ``launch.py``); by default the
SuperNode is ``python -m protofl.flower.node``: ``flower-supernode --isolation process``
plus one long-lived ClientApp process (``--isolation subprocess``: the plain
``flower-supernode``, one ``flwr-clientapp`` process per message). This
module imports nothing from flwr until a command runs, so ``protofl --help`` works
without the extra.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_BAD_INPUT = 2


def _need_flwr() -> bool:
    if importlib.util.find_spec("flwr") is None:
        print("protofl: error: Flower is not installed; install the extra: pip install 'protofl[flower]'",
              file=sys.stderr)
        return False
    return True


def _exec(cmd: list[str]) -> int:
    from .launch import flower_env

    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, flower_env())
    return 0  # pragma: no cover - execve does not return


def _settings(args) -> dict:
    return {k: v for k, v in (("run_dir", args.run_dir), ("round_timeout", args.round_timeout),
                              ("discovery_timeout", args.discovery_timeout),
                              ("resume", getattr(args, "resume", None) or None),
                              ("bind_clients", getattr(args, "bind_clients", None) or None)) if v is not None}


# ---------------------------------------------------------------------------------------
def cmd_superlink(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from .launch import TLSFiles, superlink_command

    tls = None
    if args.certs:
        d = Path(args.certs)
        tls = TLSFiles(d / "ca.pem", d / "server.pem", d / "server.key")
        missing = [str(p) for p in (tls.ca_cert, tls.server_cert, tls.server_key) if not p.exists()]
        if missing:
            print(f"protofl: error: missing certificate file(s): {', '.join(missing)}", file=sys.stderr)
            return EXIT_BAD_INPUT
    elif not args.insecure:
        print("protofl: error: give --certs DIR (TLS) or --insecure", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.auth and tls is None:
        print("protofl: error: --auth needs TLS (--certs DIR): Flower refuses SuperNode authentication "
              "on plain HTTP", file=sys.stderr)
        return EXIT_BAD_INPUT
    return _exec(superlink_command(args.host, args.port, tls, args.database, auth=args.auth))


def cmd_supernode(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from .launch import node_command

    if not args.insecure and not args.root_certificates:
        print("protofl: error: give --root-certificates CA.pem (TLS) or --insecure", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.auth_key and not Path(args.auth_key).is_file():
        print(f"protofl: error: --auth-key: no such file: {args.auth_key}", file=sys.stderr)
        return EXIT_BAD_INPUT
    extra = {k: v for k, v in (("data-root", args.data_root), ("device", args.device),
                                ("state-dir", args.state_dir)) if v}
    return _exec(node_command(args.superlink, args.partition_id, args.num_partitions, port=args.port,
                              root_certificates=args.root_certificates, insecure=args.insecure,
                              node_config=extra, isolation=args.isolation, auth_key=args.auth_key,
                              rejoin_wait=args.rejoin_wait))


def cmd_app(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from ..config import config_from_args
    from .project import write_app

    out = write_app(config_from_args(args), args.out, **_settings(args))
    print(f"Flower App: {out}\nsubmit it with: flwr run {out} <superlink-connection> --stream")
    return 0


def cmd_run(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from ..config import config_from_args
    from .launch import flower_env, flwr_run_command
    from .project import write_app

    cfg = config_from_args(args)
    with tempfile.TemporaryDirectory(prefix="protofl-flower-app-") as tmp:
        app = write_app(cfg, tmp, **_settings(args))
        return subprocess.call(flwr_run_command(app, args.connection, stream=args.stream), env=flower_env())


def cmd_local(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from ..config import config_from_args
    from .launch import LocalDeployment, throwaway_certificates

    cfg = config_from_args(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="protofl-flower-"))
    # SuperNode authentication needs TLS: --auth brings its throwaway certificates along
    tls = throwaway_certificates(work / "certs") if args.tls or args.auth else None
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is None:
        from ..api import fresh_dir
        from ..engine.simulation import run_dir_for

        run_dir = run_dir_for(cfg) if args.resume else fresh_dir(cfg)
    print(f"SuperLink + {cfg.partition.num_clients} SuperNodes on 127.0.0.1 (logs in {work})", file=sys.stderr)
    # (SIGTERM and SIGHUP unwind this block as Ctrl-C does: protofl's main, errors.terminate_as_interrupt)
    with LocalDeployment(work, cfg.partition.num_clients, tls=tls, isolation=args.isolation, auth=args.auth,
                         node_config={"state-dir": str(work / "node-state")}) as dep:
        res = dep.submit(cfg, run_dir, timeout=args.timeout, **{k: v for k, v in _settings(args).items()
                                                                if k != "run_dir"})
    print(res.stdout)
    print(f"run folder: {run_dir}")
    return res.returncode


def cmd_certs(args) -> int:
    if importlib.util.find_spec("cryptography") is None:
        print("protofl: error: needs the cryptography package (pip install 'protofl[flower]')", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .launch import throwaway_certificates

    files = throwaway_certificates(Path(args.dir), hosts=args.host or ("127.0.0.1", "localhost"), days=args.days)
    print(f"CA (give to SuperNodes and `flwr`): {files.ca_cert}\n"
          f"server certificate and key (SuperLink): {files.server_cert}, {files.server_key}")
    return 0


def cmd_keys(args) -> int:
    if importlib.util.find_spec("cryptography") is None:
        print("protofl: error: needs the cryptography package (pip install 'protofl[flower]')", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .launch import supernode_keys

    if args.count is not None and args.count < 1:
        print("protofl: error: --count must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    names = args.name or [f"supernode-{k}" for k in range(args.count or 1)]
    for name, (priv, pub) in supernode_keys(Path(args.dir), names).items():
        print(f"{name}: private key (stays on the SuperNode, --auth-key) {priv}; public key (register it) {pub}")
    return 0


def cmd_register(args) -> int:
    if not _need_flwr():
        return EXIT_BAD_INPUT
    from .launch import flower_env, register_command

    missing = [k for k in args.public_key if not Path(k).is_file()]
    if missing:
        print(f"protofl: error: no such public key file(s): {', '.join(missing)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for key in args.public_key:
        rc = subprocess.call(register_command(Path(key), args.connection, Path(key).stem), env=flower_env())
        if rc != 0:
            return rc
    return 0


# ---------------------------------------------------------------------------------------
def add_flower_parser(sub) -> None:
    """Add ``flower`` with its subcommands to the top-level subparsers ``sub``."""
    p = sub.add_parser("flower", help="deploy over real processes and machines with Flower (protofl[flower])",
                       description=__doc__.split("\n\n")[0])
    fs = p.add_subparsers(dest="flower_command", required=True)

    def with_config(sp):
        sp.add_argument("config", help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted key=value overrides")
        sp.add_argument("--data-dir", help="data root on the server machine")
        sp.add_argument("--run-dir", help="run folder on the SuperLink machine (default: output.dir/<run name>)")
        sp.add_argument("--round-timeout", type=float, help="seconds to wait for a round's replies (default 600)")
        sp.add_argument("--discovery-timeout", type=float,
                        help="seconds to wait at the start for one SuperNode per client (default 120)")
        sp.add_argument("--bind-clients", action="store_true",
                        help="a client's first SuperNode owns it for the run: any other node claiming its id "
                             "is refused (for a SuperLink started with --auth, where a node's id is its key's)")

    sp = fs.add_parser("superlink", help="start flower-superlink for protofl runs")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    sp.add_argument("--port", type=int, default=8000, help="Fleet + Control + Runtime API port (default 8000)")
    sp.add_argument("--certs", help="folder with ca.pem, server.pem, server.key (TLS)")
    sp.add_argument("--insecure", action="store_true", help="no TLS (trusted networks only)")
    sp.add_argument("--database", help="SQLite file for the SuperLink state (default: in memory; give one so "
                                       "that registered SuperNodes survive a SuperLink restart)")
    sp.add_argument("--auth", action="store_true",
                    help="SuperNode authentication: only SuperNodes whose public key was registered "
                         "(`protofl flower register`) may join; needs --certs")
    sp.set_defaults(func=cmd_superlink)

    sp = fs.add_parser("supernode", help="start flower-supernode serving one protofl client")
    sp.add_argument("--superlink", required=True, help="SuperLink address host:port")
    sp.add_argument("--partition-id", type=int, required=True, help="the client id this node serves")
    sp.add_argument("--num-partitions", type=int, required=True, help="= partition.num_clients of the run")
    sp.add_argument("--port", type=int, default=9094, help="this node's local Runtime API port (default 9094)")
    sp.add_argument("--root-certificates", help="CA certificate that signed the SuperLink's (TLS)")
    sp.add_argument("--insecure", action="store_true", help="no TLS (trusted networks only)")
    sp.add_argument("--data-root", help="data folder on this machine")
    sp.add_argument("--device", help="torch device on this machine, e.g. cuda:0")
    sp.add_argument("--auth-key", help="this node's private key (`protofl flower keys`), for a SuperLink "
                                       "started with --auth")
    sp.add_argument("--rejoin-wait", type=float,
                    help="with --auth-key: seconds from the start in which a SuperNode the SuperLink refuses to "
                         "activate is started again (default 90: a node restarted after a crash is refused "
                         "until Flower counts its old session offline, up to 60 s)")
    sp.add_argument("--state-dir", help="where this node keeps its client's state per run and round, so that it "
                                        "survives restarts (default ~/.cache/protofl/node-state; off: memory only)")
    sp.add_argument("--isolation", choices=("process", "subprocess"), default="process",
                    help="process (default): one long-lived ClientApp process for all messages; "
                         "subprocess: Flower's default, a fresh flwr-clientapp process per message")
    sp.set_defaults(func=cmd_supernode)

    sp = fs.add_parser("app", help="write the Flower App project of a run (for `flwr run`)")
    with_config(sp)
    sp.add_argument("--out", required=True, help="project folder to write")
    sp.set_defaults(func=cmd_app)

    sp = fs.add_parser("run", help="submit a run to a SuperLink (`flwr run` on a generated app)")
    with_config(sp)
    sp.add_argument("--connection", required=True, help="SuperLink connection name in ~/.flwr/config.toml")
    sp.add_argument("--stream", action="store_true", help="stream the run's logs until it ends")
    sp.add_argument("--resume", action="store_true",
                    help="continue the run folder (--run-dir, default output.dir/<run name>) from its last checkpoint")
    sp.set_defaults(func=cmd_run)

    sp = fs.add_parser("local", help="SuperLink + one SuperNode per client on this machine, run, stop")
    with_config(sp)
    sp.add_argument("--tls", action="store_true", help="with a throwaway CA and certificates")
    sp.add_argument("--auth", action="store_true",
                    help="SuperNode authentication (implies --tls): a key pair per node, registered before it "
                         "starts; each client is bound to its node's key for the run (--bind-clients)")
    sp.add_argument("--workdir", help="folder for logs and Flower state (default: a temp folder; "
                                      "give the same one with --resume to keep the nodes' state)")
    sp.add_argument("--resume", action="store_true",
                    help="continue the run folder (--run-dir, default output.dir/<run name>) from its last checkpoint")
    sp.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds")
    sp.add_argument("--isolation", choices=("process", "subprocess"), default="process",
                    help="how the SuperNodes run ClientApps (see `protofl flower supernode --help`)")
    sp.set_defaults(func=cmd_local)

    sp = fs.add_parser("certs", help="write a throwaway CA and server certificate (trials)")
    sp.add_argument("dir", help="output folder")
    sp.add_argument("--host", action="append", help="server IP or DNS name (repeatable; default 127.0.0.1, localhost)")
    sp.add_argument("--days", type=int, default=30, help="validity (default 30)")
    sp.set_defaults(func=cmd_certs)

    sp = fs.add_parser("keys", help="write SuperNode key pairs for authentication (ECDSA P-384, OpenSSH format)")
    sp.add_argument("dir", help="output folder (existing pairs are kept)")
    sp.add_argument("--name", action="append", help="key pair name (repeatable; default supernode-0 ...)")
    sp.add_argument("--count", type=int, help="this many pairs named supernode-0 .. supernode-<count-1>")
    sp.set_defaults(func=cmd_keys)

    sp = fs.add_parser("register", help="allow SuperNodes to join a SuperLink started with --auth "
                                        "(`flwr supernode register`)")
    sp.add_argument("public_key", nargs="+", help="public key file(s) (<name>.pub from `protofl flower keys`)")
    sp.add_argument("--connection", required=True, help="SuperLink connection name in ~/.flwr/config.toml")
    sp.set_defaults(func=cmd_register)
