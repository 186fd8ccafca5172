"""A client's persistent state on its SuperNode's disk, per round, so that restarts lose nothing.

Flower keeps a client's state in ``Context.state`` -- in the memory of the SuperNode
process, gone when that process dies. protofl also writes it to the node's disk after
every round the client trains (atomically, :func:`~protofl.engine.checkpoint.save_torch`):

    <state-dir>/<run key>/client-<partition-id>/r000007-<run id>.pt   # the state after round 7

The *run key* names the run folder on the server (its name and a hash of its path and
of the config's fingerprint), not Flower's run id: ``protofl flower run --resume``
submits a new Flower run (a new run id) that continues the same run folder, and its
nodes find their files again.

Which state a ``train`` message of round ``t`` gets (the rule): every message carries
the run key, the Flower run id of the ServerApp that sent it and the round ``c`` its
ServerApp started from (its checkpoint round; 0 for a fresh run). A state file written
in round ``s`` is valid for it when ``s < t`` and either ``s <= c`` (it belongs to the
history up to the checkpoint) or it was written under the same Flower run id (this
ServerApp's own rounds). The node uses the latest valid file (for equal rounds, its
own run's). Files written in rounds
after ``c`` by an earlier ServerApp (the part of a killed run that the resumed one
repeats) and files of an earlier run into the same folder (``c = 0``) are deleted. So
on resume the node hands back its state *as of the checkpoint round*, whatever it did
later, and a restarted SuperNode continues from its last round on disk.

Old files are pruned: after round ``s`` the node keeps every file newer than the round
the server may fall back to (the checkpoint before the last one, from
``output.checkpoint_every``) and the newest file at or before it; with
``checkpoint_every: 0`` (no checkpoints before the end) the newest two.

A reply the server counted as lost (it came after the round's deadline) still advanced
the node's state, as Flower's ``Context.state`` does: the in-process engine, which
never runs such a client, does not. Results equal the in-process run's when every
reply arrives.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional

from ..engine.checkpoint import load_torch, save_torch
from ..engine.store import STATE_TYPES

_FILE = re.compile(r"^r(\d{6,})-(\d+)\.pt$")  # r<round>-<Flower run id>.pt

def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/protofl/node-state`` (``~/.cache/protofl/node-state``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "protofl" / "node-state"


def run_key(run_dir: str | Path, fingerprint: str) -> str:
    """A folder name for a run folder: readable name plus a hash of its full path and config."""
    p = str(Path(run_dir).resolve())
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(p).name)[:80] or "run"
    return f"{name}-{hashlib.sha256(f'{p}|{fingerprint}'.encode()).hexdigest()[:12]}"


class NodeStateStore:
    """The per-round state files of one client (``partition_id``) of one run (``key``)."""

    def __init__(self, root: str | Path, key: str, partition_id: int, checkpoint_every: int) -> None:
        self.dir = Path(root) / key / f"client-{int(partition_id)}"
        self.every = int(checkpoint_every)

    def _files(self) -> list[tuple[int, int, Path]]:
        """(round, Flower run id, path) of every state file, oldest round first."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _FILE.match(p.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), p))
        return sorted(out)

    def load(self, rnd: int, run_id: int, base_round: int) -> tuple[Optional[Any], Optional[int]]:
        """The client's state before round ``rnd`` (see the module's rule) and its round, or (None, None)."""
        best: Optional[tuple[int, bool, Path]] = None
        for s, rid, p in self._files():
            if s > base_round and rid != run_id:
                p.unlink(missing_ok=True)  # a future the server rolled back, or another run's
                continue
            if s < rnd and (best is None or (s, rid == run_id) > best[:2]):
                best = (s, rid == run_id, p)
        if best is None:
            return None, None
        # complete or absent: every write is atomic; a file that holds more than a client
        # state (it could run code: the folder may be shared) is refused, not loaded
        obj = load_torch(best[2], STATE_TYPES)
        return obj["state"], best[0]

    def save(self, rnd: int, run_id: int, state: Optional[Any]) -> None:
        """Write the state after round ``rnd`` (None: the client holds no state) and prune."""
        files = self._files()
        if state is None and not files:
            return  # a method without client state writes nothing
        for stray in self.dir.glob(".r*.pt.*"):  # the temporary file of a write a kill cut short
            stray.unlink(missing_ok=True)
        save_torch(self.dir / f"r{int(rnd):06d}-{int(run_id)}.pt", {"round": int(rnd), "state": state})
        if self.every > 0:
            last = (rnd - 1) // self.every * self.every  # the server's last checkpoint before this round
            keep_from = max(0, last - self.every)  # ... and the one it falls back to if that is damaged
        else:
            keep_from = rnd
        older = sorted({s for s, _, _ in files if s <= keep_from})
        for s, _, p in files:
            if older and s < older[-1]:  # the newest round at or before keep_from stays
                p.unlink(missing_ok=True)

KEY_FILE = "noise-key"  # beside the client's state files: its privacy.noise: secret key, mode 0600


def noise_key(folder: Path) -> bytes:
    """The client's noise key for differential privacy (``privacy.noise: secret``), kept in
    ``folder/noise-key`` with file mode 0600: made from OS entropy on the first call, read
    back afterwards, so a restarted node (or a resumed run) continues the same streams.
    It never leaves the node: the server derives none of it, no message carries it."""
    from ..engine.privacy import new_secret, SECRET_BYTES

    path = Path(folder) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != SECRET_BYTES:
            raise ValueError(f"{path} is not a noise key ({len(key)} bytes, expected {SECRET_BYTES}): remove it "
                             "to make a new one") from None
        return key
    key = new_secret()
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    return key


def store_for(node_config, run_info, partition_id: int, checkpoint_every: int) -> Optional[NodeStateStore]:
    """The node's store for a ``train`` message's run (``run_info``: the message's ``RUN_INFO_KEY``
    record), or None: the server sent no run key (an older ServerApp) or the node was
    started with ``state-dir="off"`` (state then lives in ``Context.state`` only)."""
    root = str(node_config.get("state-dir", "") or "")
    if run_info is None or "key" not in run_info or root.lower() == "off":
        return None
    return NodeStateStore(Path(root) if root else default_state_dir(), str(run_info["key"]), partition_id,
                          checkpoint_every)
