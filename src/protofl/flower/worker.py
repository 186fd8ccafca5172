"""A long-lived ClientApp process for a SuperNode started with ``--isolation process``.

Under Flower's default ``subprocess`` isolation a SuperNode starts ``flower-superexec``,
which starts a fresh ``flwr-clientapp`` process for *every message*
(``flwr/supercore/superexec/executor/subprocess_executor.py``, ``launch``), and that
process handles exactly one task and exits (``flwr/supernode/runtime/run_clientapp.py``:
one ``pull_task_input``, one ``client_app(...)`` call, then ``flwr_exit``). Each
message therefore pays the imports (torch, protofl) and the building of the client's
data again.

With ``--isolation process`` the SuperNode starts nothing: it only serves its Runtime
API (127.0.0.1:``--port``) and leaves running the tasks to "a separate independent
process" (``flower-supernode --help``). This module is that process, and it stays: it
does what ``flower-superexec`` and ``flwr-clientapp`` do together, in one loop --

1. ``AcquireTask`` (ClientApp tasks only) every ``poll_interval`` seconds;
2. for an acquired task, with its one-task token: ``PullTaskInput`` + ``PullMessages``
   (message, Context, run, FAB), install the FAB, load the ClientApp named in it, call
   it, ``PushMessages`` the reply and ``PushTaskOutput`` the final status with the
   Context -- the same calls as ``flwr-clientapp``, mostly through flwr's own functions
   (``push_message``, ``push_task_output``; ``pull_task_input`` is re-done here with a
   shorter backoff, see below);
3. back to 1, in the same interpreter.

So Python module state survives between messages: imports happen once, and protofl's
ClientApp keeps its ``ClientRuntime`` (data, model objects, normalized test set) for the
run. Per-client *state* still travels in the Context, which the SuperNode keeps
(``PushTaskOutput`` stores it, the next ``PullTaskInput`` returns it), exactly as with
``subprocess`` isolation.

Differences from ``flwr-clientapp``, all deliberate:

* an exception in the ClientApp becomes an error reply (as in ``flwr-clientapp``) and the
  loop goes on; a hard crash (segfault, OOM kill) ends the process: the SuperNode then
  answers that message with Flower's "ClientApp stopped responding" error once the task's
  heartbeats stop (as for a crashed ``flwr-clientapp``), and ``protofl.flower.node``
  starts a new worker;
* a rejected token or heartbeat fails that task only; ``flwr-clientapp`` would stop the
  whole process with SIGINT (``flwr/supercore/retry/http_retry.py``,
  ``flwr/supercore/heartbeat.py``: ``make_task_heartbeat_fn_http``);
* the message's objects are pulled with a 50 ms first backoff instead of Flower's 1 s
  (``PULL_INITIAL_BACKOFF``): the SuperNode offers the task before it has all of them,
  and a worker that is already running asks that early;
* the FAB is installed once per FAB hash, not once per message;
* no runtime dependency installation (protofl deployments have it off anyway).

Run it as ``python -m protofl.flower.worker --runtime-api-address 127.0.0.1:9094
--parent-pid <SuperNode PID>``; ``protofl flower supernode`` (``protofl.flower.node``)
starts and stops it together with its SuperNode.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import threading
import time
from logging import ERROR, INFO, WARNING
from typing import Any, Optional, Sequence

# Flower's per-process settings, as the wrappers in launch.py set them (also when this
# module is started by hand)
for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1")):
    os.environ.setdefault(_k, _v)

import httpx  # noqa: E402

from flwr.app import Message  # noqa: E402
from flwr.app.error import Error  # noqa: E402
from flwr.cli.install import install_from_fab  # noqa: E402
from flwr.clientapp.client_app import ClientApp, LoadClientAppError  # noqa: E402
from flwr.clientapp.utils import get_load_client_app_fn  # noqa: E402
from flwr.common.constant import MAX_RETRY_DELAY, ErrorCode, SubStatus  # noqa: E402
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # noqa: E402
from flwr.supercore import log  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.heartbeat import HeartbeatSender  # noqa: E402
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor  # noqa: E402
from flwr.supercore.retry.retry_invoker import RetryInvoker, exponential  # noqa: E402
from flwr.supercore.runtime import RuntimeHttpClient  # noqa: E402
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto  # noqa: E402
from flwr.proto.node_pb2 import Node  # noqa: E402
from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # noqa: E402
from flwr.supercore.inflatable.inflatable_protobuf_utils import (  # noqa: E402
    make_confirm_message_received_fn_protobuf, make_pull_object_fn_protobuf)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output  # noqa: E402

DEFAULT_POLL_INTERVAL = 0.2  # seconds between AcquireTask calls while idle (local HTTP, cheap)
PRELOAD = ("protofl.flower.client_app",)  # imported (and warm_up() called) before the first task
# The SuperNode offers a task before it has pulled all of the message's objects from the
# SuperLink; a fresh flwr-clientapp process is never that early, this worker often is.
# Flower's object pull then backs off 1 s (PULL_INITIAL_BACKOFF): start at 50 ms instead.
PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP = 0.05, 1.0

_RETRYABLE_STATUS = frozenset({httpx.codes.BAD_GATEWAY, httpx.codes.SERVICE_UNAVAILABLE,
                               httpx.codes.GATEWAY_TIMEOUT})
_RETRYABLE_TRANSPORT = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError,
                        httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


class _Stop(BaseException):
    """SIGTERM/SIGINT, or the SuperNode is gone: leave the loop (not an ``Exception``)."""


def _retry_invoker() -> RetryInvoker:
    """Flower's HTTP retry policy (``make_simple_http_retry_invoker``) minus its SIGINT.

    Transport errors and 502/503/504 are retried with backoff; any other HTTP error
    (e.g. a task token the SuperNode no longer knows) is raised to the caller, which
    fails that task and carries on.
    """
    def giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError):
            return exc.response.status_code not in _RETRYABLE_STATUS
        return any(term in str(exc).lower() for term in ("certificate", "ssl", "tls"))

    return RetryInvoker(lambda: exponential(max_delay=MAX_RETRY_DELAY), (*_RETRYABLE_TRANSPORT, httpx.HTTPStatusError),
                        max_tries=None, max_time=None, should_giveup=giveup)


def pull_task_input(client: RuntimeHttpClient):
    """``flwr.supernode.runtime.run_clientapp.pull_task_input`` with a short object-pull backoff."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, max_tries_per_object=None, initial_backoff=PULL_INITIAL_BACKOFF,
        backoff_cap=PULL_BACKOFF_CAP)
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks its own id
    return message, context, run, fab


class ClientAppWorker:
    """The loop: acquire a ClientApp task from the SuperNode, run it here, repeat."""

    def __init__(self, runtime_api_address: str, *, insecure: bool = True,
                 root_certificates: Optional[bytes] = None, poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        self.address, self.insecure, self.root_certificates = runtime_api_address, insecure, root_certificates
        self.poll_interval = float(poll_interval)
        self._installed: set[str] = set()  # FAB hashes installed by this process
        self._load_app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self._retries: set[RetryInvoker] = set()  # of the clients in use (stop() ends their retries)
        self.stopping = False
        self.tasks = 0
        self.last_times: dict[str, float] = {}

    def _client(self, component: str, token: Optional[str] = None) -> tuple[RuntimeHttpClient, RetryInvoker]:
        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component)]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        invoker = _retry_invoker()
        if self.stopping:
            invoker.max_tries = 1
        self._retries.add(invoker)
        client = RuntimeHttpClient.from_server_address(server_address=self.address, insecure=self.insecure,
                                                       root_certificates=self.root_certificates,
                                                       interceptors=interceptors, retry_invoker=invoker)
        return client, invoker

    def stop(self) -> None:
        """No more retries: calls in flight fail fast (used on SIGTERM/SIGINT)."""
        self.stopping = True
        for invoker in self._retries:
            invoker.max_tries = 1

    # -- one task ------------------------------------------------------------------------
    def run_task(self, token: str) -> bool:
        """Run the task of ``token`` to the end; True if the ClientApp completed.

        ``self.last_times`` gets the seconds spent pulling the input, in the ClientApp
        and pushing the reply and the Context.
        """
        client, invoker = self._client("flwr-clientapp", token)
        rejected = threading.Event()

        def heartbeat() -> bool:
            try:
                ok = client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success
            except httpx.TransportError:
                return False
            except httpx.HTTPStatusError as err:
                if err.response.status_code in (httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT):
                    return False
                rejected.set()
                return True
            if not ok:  # the SuperNode gave the task up; its reply would be refused
                rejected.set()
            return True

        sender = HeartbeatSender(heartbeat)
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        times = self.last_times = {"input": 0.0, "app": 0.0, "output": 0.0}
        t = time.perf_counter()
        try:
            sender.start()
            message, context, run, fab = pull_task_input(client)
            if fab.hash_str not in self._installed:
                install_from_fab(fab.content, skip_prompt=True)
                self._installed.add(fab.hash_str)
            app: ClientApp = self._load_app(run.fab_id, run.fab_version, fab.hash_str)
            times["input"], t = time.perf_counter() - t, time.perf_counter()
            reply = app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # what flwr-clientapp does: an error reply, the node goes on
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reason = f"{type(ex)}:<'{ex}'>"
            if isinstance(ex, LoadClientAppError):
                code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, \
                    "An exception was raised when attempting to load `ClientApp`"
            log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            times["app"], t = time.perf_counter() - t, time.perf_counter()
            try:
                if reply is not None and context is not None and not rejected.is_set():
                    try:
                        push_message(client, reply, context)
                    except Exception as ex:  # noqa: BLE001 - the node then reports the task failed
                        log(ERROR, "Failed to push reply message", exc_info=ex)
                        status = SubStatus.FAILED
                push_task_output(client=client, context=context, sub_status=status, details=details)
                times["output"] = time.perf_counter() - t
            finally:
                if sender.is_running:
                    sender.stop()
                client.close()
                self._retries.discard(invoker)
        self.tasks += 1
        return status == SubStatus.COMPLETED

    # -- the loop ------------------------------------------------------------------------
    def serve(self) -> None:
        control, invoker = self._client("SuperExec")
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        try:
            while not self.stopping:
                res = control.AcquireTask(request)
                if res.HasField("task") and res.token:
                    t0 = time.perf_counter()
                    ok = self.run_task(res.token)
                    log(INFO if ok else WARNING, "[protofl worker] task %d (run %d) %s in %.2f s (%s)",
                        res.task.task_id, res.task.run_id, "done" if ok else "failed", time.perf_counter() - t0,
                        ", ".join(f"{k} {v:.2f}" for k, v in self.last_times.items()))
                    continue  # another message may be waiting already
                time.sleep(self.poll_interval)
        finally:
            control.close()
            self._retries.discard(invoker)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_runtime_api(address: str, parent_pid: Optional[int], timeout: float = 120.0) -> bool:
    """Wait until something listens on ``address`` (host:port); False if the parent died first."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if parent_pid is not None and not _pid_alive(parent_pid):
            return False
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no SuperNode Runtime API on {address} after {timeout:.0f} s")


def run_worker(runtime_api_address: str, *, insecure: bool = True, root_certificates: Optional[str] = None,
               parent_pid: Optional[int] = None, poll_interval: float = DEFAULT_POLL_INTERVAL,
               preload: Sequence[str] = PRELOAD) -> int:
    """Serve the SuperNode's ClientApp tasks until SIGTERM/SIGINT or until ``parent_pid`` exits."""
    worker: Optional[ClientAppWorker] = None
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if stopping:  # already on the way out (a second signal, e.g. Ctrl-C plus the supervisor's SIGTERM)
            return
        stopping.append(signum)
        if worker is not None:
            worker.stop()
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent_pid is not None:  # the SuperNode gone (even SIGKILLed): stop too
        def watch() -> None:
            while _pid_alive(parent_pid):
                time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-monitor", daemon=True).start()

    try:
        t0 = time.perf_counter()
        for name in preload:  # torch, protofl: paid once, before the first message
            try:
                mod = importlib.import_module(name)
                if callable(getattr(mod, "warm_up", None)):
                    mod.warm_up()
            except Exception as ex:  # noqa: BLE001 - the task that needs it will report it
                log(WARNING, "[protofl worker] preloading %s failed: %s", name, ex)
        log(INFO, "[protofl worker] ClientApp worker ready in %.1f s (pid %d); SuperNode Runtime API %s",
            time.perf_counter() - t0, os.getpid(), runtime_api_address)
        if not wait_for_runtime_api(runtime_api_address, parent_pid):
            return 0
        certs = None
        if not insecure and root_certificates:
            with open(root_certificates, "rb") as f:
                certs = f.read()
        worker = ClientAppWorker(runtime_api_address, insecure=insecure, root_certificates=certs,
                                 poll_interval=poll_interval)
        worker.serve()
    except _Stop as stop:
        log(INFO, "[protofl worker] stopped (%s) after %d task(s)", stop, worker.tasks if worker else 0)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m protofl.flower.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                    help="the SuperNode's Runtime API, host:port (its --host/--port; default 127.0.0.1:9094)")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) exits")
    ap.add_argument("--root-certificates", help="CA of the Runtime API's certificate (if it has TLS)")
    ap.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL,
                    help=f"seconds between task polls while idle (default {DEFAULT_POLL_INTERVAL})")
    args = ap.parse_args(argv)
    from .project import plain_flower_logs

    plain_flower_logs()  # colours only on a terminal
    return run_worker(args.runtime_api_address, insecure=args.root_certificates is None,
                      root_certificates=args.root_certificates, parent_pid=args.parent_pid,
                      poll_interval=args.poll_interval)


if __name__ == "__main__":
    sys.exit(main())
