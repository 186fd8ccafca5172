"""Run PFLlib (TsingZ0/PFLlib, commit d832e76) on the peers' workload, unchanged.

Executed by benchmarks/peers.py with PFLlib's own Python (its virtual environment),
never with protofl's. It imports PFLlib from the checkout given by ``--root`` and
changes none of its source files: it wraps ``Server.select_clients`` (called once at
the start of every round) to note the training samples of the round, then
runs PFLlib's ``system/main.py`` as a script with the workload's arguments; the seconds
per round are PFLlib's own (``self.Budget``: from client selection to aggregation). One
line per round on stdout:

    PEER_ROUND {"round": r, "seconds": s, "samples": n}

PFLlib's rounds are numbered 0..gr, so ``--rounds R`` passes ``-gr R-1``. A round
includes PFLlib's own evaluation (every client's test set and training loss, every
``eval_gap`` rounds; round 0 always evaluates).

    python pfllib.py prepare --root PFLLIB --data-dir DATA   # MNIST Dir(0.3), 100 clients
    python pfllib.py run --root PFLLIB --rounds 6 --eval default
    python pfllib.py run --root PFLLIB --rounds 3 --eval off --device cuda --clients-per-round 100

PFLlib's ``main.py`` imports ``cvxpy``, ``calmsize``, ``h5py``, ``torchvision`` and ``matplotlib``
at load time, which its FedAvg's rounds never use: where they are not installed (a machine
that has only torch, numpy and scikit-learn, such as a GPU box without a package index),
``stand_ins/`` is put on the path and provides modules that only say so if anything calls
them. PFLlib's bookkeeping after its last round (its results file, its memory report) then
stops on a stand-in; the rounds measured before it are reported, with one line on stderr.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from _peer import copy_mnist, parser, print_round  # importing it installs the torchvision shim


def prepare(root: Path, data_dir: Path) -> None:
    # generate_MNIST.py reads MNIST with torchvision under MNIST/rawdata; with the official
    # .gz files in MNIST/rawdata/MNIST/raw it extracts them instead of downloading.
    # Its client count (20) and Dirichlet alpha (0.1) are module constants: set here.
    ds = root / "dataset"
    raw = ds / "MNIST" / "rawdata" / "MNIST" / "raw"
    copy_mnist(data_dir, raw)
    os.chdir(ds)
    sys.path.insert(0, str(ds))
    import utils.dataset_utils as du

    du.alpha = 0.3
    import generate_MNIST  # seeds random and numpy (1) on import, as its script does

    generate_MNIST.generate_dataset("MNIST/", 100, True, False, "dir")  # noniid, unbalanced, Dirichlet


STAND_INS = Path(__file__).resolve().parent / "stand_ins"
# imported by PFLlib at load time, never used by its FedAvg's rounds (h5py: its results file after
# the last round; calmsize: its memory report after that)
STANDING_IN = ("cvxpy", "calmsize", "h5py", "torchvision", "matplotlib")


def run(root: Path, rounds: int, eval_on: bool, per_round: int = 10, epochs: int = 5, device: str = "cpu") -> None:
    import importlib.util

    system = root / "system"
    os.chdir(system)
    sys.path.insert(0, str(system))
    if any(importlib.util.find_spec(m) is None for m in STANDING_IN):
        sys.path.append(str(STAND_INS))  # after the real ones: only what is missing comes from here
    from flcore.servers.serveravg import FedAvg
    from flcore.servers.serverbase import Server

    samples: list[int] = []
    budget: list[float] = []
    select, train = Server.select_clients, FedAvg.train

    def counted_select(self):
        chosen = select(self)
        samples.append(sum(c.train_samples * c.local_epochs for c in chosen))
        return chosen

    def kept_train(self):
        try:
            train(self)
        finally:
            budget.extend(self.Budget)  # PFLlib's own seconds per round (select .. aggregate)

    Server.select_clients, FedAvg.train = counted_select, kept_train
    sys.argv = ["main.py", "-data", "MNIST", "-m", "CNN", "-algo", "FedAvg", "-gr", str(rounds - 1),
                "-dev", device, "-nc", "100", "-jr", str(per_round / 100), "-ls", str(epochs), "-lbs", "64",
                "-lr", "0.01", "-eg", "1" if eval_on else str(rounds + 1)]
    try:
        runpy.run_path("main.py", run_name="__main__")
    except NotImplementedError as e:  # a stand-in, called by PFLlib's bookkeeping after its last round
        if len(budget) < rounds:
            raise
        print(f"pfllib.py: after its {rounds} rounds PFLlib stopped on a stand-in: {e}", file=sys.stderr)
    for r, (n, s) in enumerate(zip(samples, budget)):
        print_round(r + 1, s, n)


def main() -> None:
    p = parser(__doc__.splitlines()[0], "PFLlib checkout at d832e76")
    a = p.parse_args()
    root = a.root.resolve()
    if a.command == "prepare":
        prepare(root, a.data_dir.resolve())
    else:
        run(root, a.rounds, a.eval == "default", a.clients_per_round, a.epochs, a.device)


if __name__ == "__main__":
    main()
