"""Does the fastest nest depend on whether the other cores are free?

On a machine shared with other processes, the planner's question "which nest is
fastest?" can have two answers: XLA:CPU splits a big kernel (a full vmap, a big
chunk) over the cores, a scan's small per-iteration kernels run on one. This script
compiles three fixed nests of one workload of `benchmarks/planner.py` ("sumexp @ b,
full vmap fits": `sum(exp(a[:, None] * b[None, :]) @ b)`, mapped over `T` and `B`),
and times them side by side, interleaved round by round, in four phases: idle, with
a busy loop in another process (twice), idle again. Reported: the median time of
each nest per phase, and its ratio to the fastest of that phase.

    python benchmarks/contention.py               # about 20 s
    python benchmarks/contention.py --seconds 1   # timing per phase

Nothing passes or fails; the busy loop is one process, so on a machine with more
than two cores it takes a smaller share.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(__file__))

import jax
import planner as workloads_of_the_planner
from _timing import compiled, time_calibrated
from eqx_multimap import filter_multi_vmap


NESTS = {
    "scan(T: chunks of 2) -> vmap(B)": dict(scan={"T": 2}),
    "scan(T) -> scan(B: chunks of 8)": dict(scan={"T": 1, "B": 8}),
    "vmap(T) -> vmap(B)": dict(),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per phase")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    name, body, kw, args, _ = next(
        w
        for w in workloads_of_the_planner.workloads(quick=True)
        if w[0] == "sumexp @ b, full vmap fits"
    )
    programs = [
        compiled(filter_multi_vmap(body, **kw, **n), *args) for n in NESTS.values()
    ]
    fns = [lambda p=p: p(*args) for p in programs]
    print(
        f"python benchmarks/contention.py\njax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores; workload {name!r}, "
        f"sizes {[a.shape for a in args]}\n"
    )
    rows = []
    for phase in ("idle", "one core busy", "one core busy", "idle"):
        hog = None
        if phase != "idle":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            times = time_calibrated(
                fns, budget_s=opts.seconds, max_rounds=60, min_sample_s=0.02, settle=1
            )
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        medians = [statistics.median(ts) for ts in times]
        rows.append((phase, medians))
    width = max(len(n) for n in NESTS)
    print(f"{'nest':{width}}  " + "  ".join(f"{p:>22}" for p, _ in rows))
    for i, nest in enumerate(NESTS):
        cells = []
        for _, medians in rows:
            best = min(medians)
            cells.append(f"{medians[i] * 1e3:7.2f} ms ({medians[i] / best:4.2f}x)")
        print(f"{nest:{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"\nTotal: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
