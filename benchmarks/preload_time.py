"""How long ``flashgdn.preload`` takes with TileLang's rewrite memoised (``kernels/hopper/trace_memo.py``) and
without it (``FLASHGDN_TRACE_MEMO=0``), each in fresh processes, alternating, on a warm disk cache: what a server or a
training job pays at start-up to have every kernel of a head configuration loaded. Runs with or without a GPU (without
one, the kernels are traced and their cache entries found and loaded, as on a GPU machine).

    python benchmarks/preload_time.py --heads 16/32 --rounds 3 --out benchmarks/results/cpu/preload-time.json
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import tilelang  # (its import is the same either way; timed apart)
t1 = time.perf_counter()
from flashgdn.precompile import preload
from flashgdn.kernels.hopper import trace_memo
n = preload(sys.argv[1], training=sys.argv[2] == "training", flags=sys.argv[3])
t2 = time.perf_counter()
print(json.dumps({"kernels": n, "import_s": t1 - t0, "preload_s": t2 - t1, "memo": trace_memo._installed,
                  "stats": trace_memo.stats, "tilelang": tilelang.__version__}))
"""


def run(heads: str, kernels: str, flags: str, memo: bool) -> dict:
    env = dict(os.environ, FLASHGDN_TRACE_MEMO="1" if memo else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, heads, kernels, flags], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16/32", help="head configurations, e.g. 16/32,2/4")
    ap.add_argument("--kernels", choices=("training", "serving"), default="training")
    ap.add_argument("--flags", choices=("common", "all"), default="common")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side, alternating")
    ap.add_argument("--out", help="JSON file for the results (a Markdown summary is written beside it)")
    args = ap.parse_args()

    print(f"# warm-up (fills the disk cache if it lacks these kernels): {run(args.heads, args.kernels, args.flags, True)}")
    rows = {True: [], False: []}
    for _ in range(args.rounds):
        for memo in (False, True):
            r = run(args.heads, args.kernels, args.flags, memo)
            assert r["memo"] == memo, r
            rows[memo].append(r)
            print(f"memo={int(memo)} {r['kernels']} kernels: preload {r['preload_s']:.2f} s "
                  f"(tilelang import {r['import_s']:.2f} s) {r['stats']}")
    med = {memo: statistics.median(r["preload_s"] for r in rs) for memo, rs in rows.items()}
    kernels = rows[True][0]["kernels"]
    summary = (f"{args.heads} {args.kernels} ({args.flags}), {kernels} kernels: preload {med[False]:.2f} s without "
               f"the memo, {med[True]:.2f} s with it ({med[False] / med[True]:.2f}x; {med[False] / kernels:.3f} -> "
               f"{med[True] / kernels:.3f} s a kernel), medians of {args.rounds} processes each")
    print(summary)
    if args.out:
        record = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                      date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=platform.machine(),
                      cpus=os.cpu_count(), python=platform.python_version(), tilelang=rows[True][0]["tilelang"],
                      gpu=_gpu_name(), heads=args.heads, kernels=args.kernels, flags=args.flags,
                      median_s={"memo": med[True], "no_memo": med[False]}, runs={"memo": rows[True], "no_memo": rows[False]},
                      summary=summary)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(f"# preload time\n\n`{record['command']}` on {record['date']} ({record['cpus']} CPUs, "
                    f"{record['gpu'] or 'no GPU'}, TileLang {record['tilelang']}):\n\n{summary}\n")
    return 0


def _gpu_name():
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
