"""FedProto vs FedAvg client updates on the peers' workload, paired client by client.

Workload: MNIST, 100 clients, Dirichlet(0.3), ``fedavg_cnn``, 5 local epochs, batch 64,
SGD lr 0.01 (benchmarks/peers.py). For each client that rounds 1..R select, the script
runs, back to back in one process with one thread, the client's FedAvg update, its
FedProto update with the local prototypes embedded in batches of 1024 (before) and in
the current batches (:data:`protofl.engine.train.EMBED_BATCH_SIZE`), each without the
personalized evaluation, i.e. the work a round cannot skip. FedProto gets global
prototypes for every class, so its L_R term is active as from round 2. Reported:
samples/s (epochs x client size / time) from process CPU time, which a shared machine
disturbs far less than wall time, and from wall time; the FedProto replies of both
variants must be bit-identical (checked). ``--profile`` adds a cProfile table of the
FedProto updates.

    python benchmarks/fedproto_speed.py --data-dir ../shared/data --rounds 2 --out benchmarks/results/fedproto_speed.md
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402
from peers import workload  # noqa: E402

from protofl.algorithms.fedproto import ProtoState  # noqa: E402
from protofl.engine import client as client_mod  # noqa: E402
from protofl.engine.client import ClientTask  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402


def setup(method: str, data_dir: str, rounds: int, tmp: str) -> Simulation:
    cfg = workload(method, "fedavg_cnn", data_dir, rounds, 0, 1, False, tmp)
    return Simulation(cfg, run_dir=Path(tmp) / method)


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--rounds", type=int, default=2, help="the clients of rounds 1..R are measured")
    p.add_argument("--clients", type=int, default=0, help="at most this many clients per round (0: all)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tmp", default="/tmp/protofl-fedproto-speed")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    avg, pro = setup("fedavg", args.data_dir, args.rounds, args.tmp), setup("fedproto", args.data_dir, args.rounds,
                                                                              args.tmp)
    C, d = pro.info.num_classes, pro.info.feature_dim
    g = torch.Generator().manual_seed(0)
    proto_state = ProtoState(torch.randn(C, d, generator=g).abs(), torch.full((C,), 100, dtype=torch.int64))
    avg_state = avg.algorithm.server_init(avg.server)
    variants = {
        "FedAvg": lambda cid, rnd: avg.runtime.run(
            ClientTask(cid, rnd, avg.algorithm.configure(avg_state, rnd, avg.server), None, None, evaluate=False)),
        "FedProto, embed batch 1024 (before)": lambda cid, rnd: run_proto(pro, proto_state, cid, rnd, 1024),
        f"FedProto, embed batch {client_mod.EMBED_BATCH_SIZE} (now)":
            lambda cid, rnd: run_proto(pro, proto_state, cid, rnd, client_mod.EMBED_BATCH_SIZE),
    }
    cpu = {k: 0.0 for k in variants}
    wall = {k: 0.0 for k in variants}
    samples = 0
    prof = cProfile.Profile() if args.profile else None
    names, turn = list(variants), 0
    for rnd in range(1, args.rounds + 1):
        for cid in pro.participation.selected(rnd)[:args.clients or None]:
            samples += pro.cfg.training.epochs * len(pro.fed.train_idx[cid])
            replies = {}
            order = names[turn % 3:] + names[:turn % 3]  # who goes first rotates
            turn += 1
            for name in order:
                fn = variants[name]
                if prof is not None and name.startswith("FedProto") and name.endswith("(now)"):
                    prof.enable()
                out, c, w = timed(lambda: fn(cid, rnd))
                if prof is not None:
                    prof.disable()
                cpu[name] += c
                wall[name] += w
                if name.startswith("FedProto"):
                    replies[name] = out.reply.arrays
            a, b = replies.values()
            same = all(torch.equal(a[k], b[k]) for k in a)
            if not same:
                raise SystemExit(f"client {cid}: FedProto's reply changed with the embedding batch")
            print(f"round {rnd} client {cid}: " + ", ".join(f"{k.split(',')[0]} {cpu[k]:.1f} s" for k in cpu),
                  file=sys.stderr, flush=True)

    base = "FedAvg"
    which = f"the first {args.clients} clients" if args.clients else "the clients"
    lines = [header(f"One process, one thread; {which} of rounds 1-{args.rounds} "
                    f"({samples:,} training samples x epochs per variant), variants alternated client by client."),
             "", "| variant | samples/s (CPU time) | vs FedAvg | samples/s (wall) | vs FedAvg |", "|---|---|---|---|---|"]
    for k in variants:
        lines.append(f"| {k} | {samples / cpu[k]:,.0f} | {100 * (cpu[base] / cpu[k] - 1):+.1f} % | "
                     f"{samples / wall[k]:,.0f} | {100 * (wall[base] / wall[k] - 1):+.1f} % |")
    lines += ["", "FedProto's replies (local prototypes) were bit-identical between the two embedding batches "
                  "for every client."]
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(25)
        lines += ["", "```", s.getvalue().strip(), "```"]
    emit(lines, args.out)
    return 0


def run_proto(sim: Simulation, state: ProtoState, cid: int, rnd: int, batch: int):
    saved = client_mod.EMBED_BATCH_SIZE
    client_mod.EMBED_BATCH_SIZE = batch
    try:
        return sim.runtime.run(ClientTask(cid, rnd, sim.algorithm.configure(state, rnd, sim.server), None, None,
                                          evaluate=False))
    finally:
        client_mod.EMBED_BATCH_SIZE = saved


if __name__ == "__main__":
    sys.exit(main())
