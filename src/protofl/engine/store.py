"""Per-client persistent state, keyed by client id.

The engine hands a client its state with the task and stores what comes back; methods
never hold references to other clients' state. :class:`MemoryStore` keeps everything in
a dict; :class:`SpillStore` (the default) keeps at most ``execution.state_memory_mb`` in
memory and the rest on disk in the run folder; :class:`DiskStore` keeps one file per
client; :class:`ClusterStore` keeps handles to states held in a Ray cluster's object
store (``execution.state: cluster``). A store snapshots into checkpoints as a dict of
plain Records (a :class:`SpillStore` that has spilled: of :class:`Spilled` file
references instead, so a checkpoint never copies the states on disk).

A store is injectable (``Simulation(cfg, store=...)``): any :class:`ClientStateStore`;
:func:`make_store` picks the one the config asks for.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Union

from ..errors import CheckpointError
from ..messages import Record
from .checkpoint import allow_in_checkpoints, load_torch, save_torch

if TYPE_CHECKING:
    from ..config import Config


class ClientStateStore:
    """What the engine asks of a store: ``get``/``put`` a client's state, ``snapshot``/
    ``restore`` for checkpoints; ``clear`` (a fresh run), ``checkpointed`` (a checkpoint now
    holds the snapshot) and ``usage`` (the run summary) do nothing by default."""

    def get(self, cid: int) -> Optional[Record]:
        raise NotImplementedError

    def put(self, cid: int, state: Optional[Record]) -> None:
        raise NotImplementedError

    def snapshot(self) -> Mapping[int, Union[Record, Spilled, None]]:
        raise NotImplementedError

    def restore(self, states: Mapping[int, Record]) -> None:
        raise NotImplementedError

    def resume(self, states: Mapping[int, Union[Record, Spilled]], run_dir: Union[str, os.PathLike[str]]) -> None:
        """Restore a checkpoint's snapshot of the run in ``run_dir``; states a
        :class:`SpillStore` left on disk there (:class:`Spilled` references) are read back."""
        self.restore(load_spilled(states, Path(run_dir) / STATE_DIR))

    def clear(self) -> None:
        """Forget the states of an earlier run (a fresh run in the same folder)."""

    def checkpointed(self) -> None:
        """A checkpoint now holds the last snapshot: what only it referenced may go."""

    def usage(self) -> Optional[dict[str, Any]]:
        """How much state the store holds (the run summary's ``client_state``); None: unknown."""
        return None


class MemoryStore(ClientStateStore):
    def __init__(self) -> None:
        self._states: dict[int, Record] = {}

    def get(self, cid: int) -> Optional[Record]:
        return self._states.get(cid)

    def put(self, cid: int, state: Optional[Record]) -> None:
        if state is None:
            self._states.pop(cid, None)
        else:
            self._states[cid] = state

    def __len__(self) -> int:
        return len(self._states)

    def snapshot(self) -> dict[int, Record]:
        return dict(self._states)

    def restore(self, states: Mapping[int, Record]) -> None:
        self._states = dict(states)

    def usage(self) -> dict[str, Any]:
        """How much state the store holds (the run summary's ``client_state``)."""
        return {"clients": len(self._states), "memory_clients": len(self._states),
                "memory_bytes": sum(s.nbytes() for s in self._states.values() if isinstance(s, Record)),
                "disk_clients": 0, "disk_bytes": 0, "budget_bytes": None}


@allow_in_checkpoints  # a checkpoint's snapshot names them
class Spilled(NamedTuple):
    """A client state on disk: a file under the store's folder (in a checkpoint's snapshot)."""

    file: str
    nbytes: int


STATE_DIR = "client_state"  # the SpillStore's folder inside the run folder
STATE_TYPES = (Record,)  # what a client-state file holds besides tensors and plain values


def _write(path: Path, state: Record) -> None:
    """Atomically, without a sync of its own (a checkpoint syncs the files it names)."""
    save_torch(path, state, sync=False)


def _read(path: Path) -> Record:
    """A state file, loaded as checkpoints are: a file that holds anything but a Record's
    tensors and values (it could run code) is refused, not loaded."""
    state: Record = load_torch(path, STATE_TYPES)
    return state


def load_spilled(states: Mapping[int, Union[Record, Spilled]], root: Union[str, os.PathLike[str]]) -> dict[int, Record]:
    """A snapshot with its :class:`Spilled` references read back (for a store that keeps
    everything in memory, e.g. a cluster store resuming a checkpoint written by a SpillStore)."""
    return {cid: _read(Path(root) / s.file) if isinstance(s, Spilled) else s for cid, s in states.items()}


class SpillStore(ClientStateStore):
    """States in memory up to ``budget_bytes`` (least recently used first out), the rest on disk.

    A state that leaves memory is written to ``root/<cid>.<n>.pkl`` (atomically: a temporary
    file, then a rename) unless an up-to-date file of it exists already; it is read back
    when its client is next sampled. Clients that are not sampled cost nothing per round:
    nothing is scanned or rewritten. ``budget_bytes=None`` never spills (a plain dict).

    Checkpoints: until the first spill, :meth:`snapshot` is the dict of states, as for
    :class:`MemoryStore`. Afterwards it writes the states changed since they were last
    written (at most the budget; in practice the clients of the rounds since the last
    checkpoint), syncs the new files to disk and returns :class:`Spilled` references, so
    a checkpoint holds file names, not states. A file is never overwritten: a client's
    new state goes to a new file, and a file stays as long as one of the two checkpoint
    generations kept on disk (:func:`~.checkpoint.save_checkpoint`) refers to it; call
    :meth:`checkpointed` once the checkpoint is written. :meth:`restore` (resume) deletes
    the files written after the checkpoint it restores.
    """

    def __init__(self, budget_bytes: Optional[int], root: Union[str, os.PathLike[str]]) -> None:
        self.budget = budget_bytes
        self.root = Path(root)
        self._clear_state()

    def _clear_state(self) -> None:
        self._mem: OrderedDict[int, Record] = OrderedDict()  # least recently used first
        self._mem_bytes: dict[int, int] = {}
        self._mem_total = 0
        self._disk: dict[int, Spilled] = {}  # each client's latest file
        self._dirty: set[int] = set()  # in memory and newer than its file (or without one)
        self._kept: tuple[set[str], set[str]] = (set(), set())  # files of the latest / previous checkpoint
        self._pending: Optional[set[str]] = None  # files of the snapshot not yet confirmed written
        self._unsynced: set[str] = set()
        self._bytes: dict[str, int] = {}  # every file of ours on disk -> its size
        self._seq = 0
        self.writes = self.reads = 0

    # -- files ---------------------------------------------------------------------------
    def _drop_file(self, name: str) -> None:
        if name not in self._kept[0] and name not in self._kept[1] and \
                (self._pending is None or name not in self._pending):
            (self.root / name).unlink(missing_ok=True)
            self._bytes.pop(name, None)
            self._unsynced.discard(name)

    def _spill(self, cid: int) -> None:
        """Write ``cid``'s in-memory state to a new file; it becomes the client's latest."""
        state = self._mem[cid]
        self.root.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"{cid}.{self._seq}.pkl"
        _write(self.root / name, state)
        old = self._disk.get(cid)
        self._disk[cid] = Spilled(name, self._mem_bytes[cid])
        self._bytes[name] = self._mem_bytes[cid]
        self._unsynced.add(name)
        self._dirty.discard(cid)
        self.writes += 1
        if old is not None:
            self._drop_file(old.file)

    def _admit(self, cid: int, state: Record, dirty: bool) -> None:
        self._forget_memory(cid)
        size = state.nbytes()
        self._mem[cid] = state
        self._mem_bytes[cid] = size
        self._mem_total += size
        if dirty:
            self._dirty.add(cid)
        if self.budget is None:
            return
        while self._mem_total > self.budget and self._mem:
            old_cid = next(iter(self._mem))
            if old_cid in self._dirty:
                self._spill(old_cid)
            self._forget_memory(old_cid)

    def _forget_memory(self, cid: int) -> None:
        if cid in self._mem:
            del self._mem[cid]
            self._mem_total -= self._mem_bytes.pop(cid)
            self._dirty.discard(cid)

    # -- the store interface -------------------------------------------------------------
    def get(self, cid: int) -> Optional[Record]:
        if cid in self._mem:
            self._mem.move_to_end(cid)
            return self._mem[cid]
        ref = self._disk.get(cid)
        if ref is None:
            return None
        state = _read(self.root / ref.file)
        self.reads += 1
        self._admit(cid, state, dirty=False)  # its file stays up to date until the next put
        return state

    def put(self, cid: int, state: Optional[Record]) -> None:
        if state is None:
            self._forget_memory(cid)
            old = self._disk.pop(cid, None)
            if old is not None:
                self._drop_file(old.file)
            return
        self._admit(cid, state, dirty=True)

    def __len__(self) -> int:
        return len(self._disk.keys() | self._mem.keys())

    def snapshot(self) -> dict[int, Union[Record, Spilled]]:
        if not self._disk:  # nothing ever spilled: the states themselves, as MemoryStore
            self._pending = set()
            return dict(self._mem)
        for cid in sorted(self._dirty):
            self._spill(cid)
        for name in sorted(self._unsynced):  # the checkpoint must not name a file still in a cache
            fd = os.open(self.root / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._unsynced.clear()
        if hasattr(os, "O_DIRECTORY"):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._pending = {ref.file for ref in self._disk.values()}
        return dict(sorted(self._disk.items()))

    def checkpointed(self) -> None:
        """The snapshot taken last is now the latest checkpoint on disk: the files only the
        generation before the previous one referred to can go."""
        if self._pending is None:
            return
        gone = self._kept[1]
        self._kept, self._pending = (self._pending, self._kept[0]), None
        live = {ref.file for ref in self._disk.values()}
        for name in gone - self._kept[0] - self._kept[1] - live:
            self._drop_file(name)

    def resume(self, states: Mapping[int, Union[Record, Spilled]], run_dir: Union[str, os.PathLike[str]]) -> None:
        """A SpillStore keeps the snapshot's file references (its own folder holds them)."""
        self.restore(states)

    def restore(self, states: Mapping[int, Union[Record, Spilled]]) -> None:
        """Resume from a snapshot: its file references become the clients' latest files;
        every other file in the folder (written after that checkpoint) is deleted."""
        self._clear_state()
        refs = {cid: s for cid, s in states.items() if isinstance(s, Spilled)}
        keep = {s.file for s in refs.values()}
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name not in keep:
                    p.unlink()
        for cid, ref in refs.items():
            if not (self.root / ref.file).exists():
                raise CheckpointError(f"cannot resume: the checkpoint names client {cid}'s state file "
                                      f"{self.root / ref.file}, which is missing; start the run again "
                                      "without --resume")
            self._disk[cid] = ref
            self._bytes[ref.file] = ref.nbytes
            self._seq = max(self._seq, int(ref.file.split(".")[1]))
        self._kept = (keep, set())
        for cid, s in sorted(states.items()):
            if isinstance(s, Record):
                self.put(cid, s)

    def clear(self) -> None:
        """A fresh run in this folder: forget everything, delete the state files."""
        self._clear_state()
        if self.root.is_dir():
            for p in self.root.iterdir():
                p.unlink()

    def usage(self) -> dict[str, Any]:
        """How much state the store holds (the run summary's ``client_state``): states in
        memory, clients whose latest state is on disk, and the bytes of all state files
        (those the kept checkpoints refer to included)."""
        on_disk = [cid for cid in self._disk if cid not in self._dirty]
        return {"clients": len(self), "memory_clients": len(self._mem), "memory_bytes": self._mem_total,
                "disk_clients": len(on_disk), "disk_bytes": sum(self._bytes.values()),
                "budget_bytes": self.budget, "spill_writes": self.writes, "spill_reads": self.reads}


def _mb(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GB"
    return f"{n / 2**20:.1f} MB" if n >= 2**20 // 10 or n == 0 else f"{n / 2**10:.0f} kB"


def usage_line(usage: Optional[Mapping[str, Any]]) -> Optional[str]:
    """``client state: 900 clients; 512.0 MB in memory (220), 1.62 GB on disk (700)``, or None
    when no client holds state."""
    if not usage or not usage.get("clients"):
        return None
    line = (f"client state: {usage['clients']:,} clients; {_mb(usage['memory_bytes'])} in memory "
            f"({usage['memory_clients']:,})")
    if usage.get("disk_bytes"):
        line += f", {_mb(usage['disk_bytes'])} on disk ({usage['disk_clients']:,})"
    if usage.get("budget_bytes") is not None:
        line += f"; memory budget {_mb(usage['budget_bytes'])}"
    return line


class DiskStore(ClientStateStore):
    """One file per client under ``root`` (written and read as the SpillStore's); the
    snapshot is the dict of all states."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, cid: int) -> Path:
        return self.root / f"{cid}.pkl"

    def get(self, cid: int) -> Optional[Record]:
        p = self._path(cid)
        return _read(p) if p.exists() else None

    def put(self, cid: int, state: Optional[Record]) -> None:
        p = self._path(cid)
        if state is None:
            p.unlink(missing_ok=True)
            return
        _write(p, state)

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.pkl"))

    def snapshot(self) -> dict[int, Optional[Record]]:  # None: a file deleted meanwhile
        return {int(p.stem): self.get(int(p.stem)) for p in self.root.glob("*.pkl")}

    def restore(self, states: Mapping[int, Record]) -> None:
        for p in self.root.glob("*.pkl"):
            p.unlink()
        for cid, s in states.items():
            self.put(cid, s)


class ClusterStore(MemoryStore):
    """States held in a Ray cluster: the dict maps a client to an ``ObjectRef`` (or a Record).

    The Ray executor returns a client's new state as a second task output that stays in
    the object store of the node that computed it (Ray returns objects under 100 KiB to
    the driver directly); the next task of that client gets the handle as an argument, so
    big states never pass through the driver between rounds. A checkpoint fetches every
    state first (:meth:`snapshot`); a restored checkpoint keeps plain Records here until
    their client's next turn. A state on a node that died is gone with it: the Ray
    executor then starts that client afresh and says so.
    """

    def snapshot(self) -> dict[int, Record]:
        # the ObjectRefs the Ray executor stored as states
        refs: dict[int, Any] = {cid: s for cid, s in self._states.items() if not isinstance(s, Record)}
        out = {cid: s for cid, s in self._states.items() if isinstance(s, Record)}
        if refs:
            import ray

            for cid, value in zip(refs, ray.get(list(refs.values()))):
                if value is not None:
                    out[cid] = value
        return dict(sorted(out.items()))


def make_store(cfg: Config, run_dir: Union[str, os.PathLike[str]]) -> ClientStateStore:
    """The store ``execution.state`` asks for: in the cluster, or on the driver (default)
    within ``execution.state_memory_mb`` of memory, spilling to ``run_dir/client_state``."""
    if cfg.execution.state == "cluster":
        return ClusterStore()
    mb = cfg.execution.state_memory_mb
    return SpillStore(None if mb is None else int(mb * 2**20), Path(run_dir) / STATE_DIR)
