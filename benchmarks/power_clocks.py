"""SM clock and board power while one forward runs back to back, for flashgdn and the anchors side by side.

A kernel's time on a full GPU is cycles over clock rate, and the H200 lowers its SM clock when a load draws its power
limit. This runs each implementation's forward (``flashgdn.bench.impls``) on one shape for ``--seconds`` without
pause, samples ``nvidia-smi`` every 50 ms meanwhile, and reports per implementation: the time per call, the median
SM clock and power of the samples inside the run, and the active clock-throttle reasons. Cycles per call
(time x clock) then say how much of a difference in time is work and how much is clock.

    python benchmarks/power_clocks.py --heads 16/32 --seqlens 4096x8 --impls flashgdn,flashqla --out power.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

FIELDS = ["timestamp", "power.draw", "clocks.sm", "clocks.mem", "temperature.gpu", "clocks_event_reasons.active",
          "power.limit"]


def query_fields():
    """The query, with the older name of the throttle reasons where the driver does not know the newer one."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        fields = ",".join(FIELDS).replace("clocks_event_reasons.active", reasons)
        if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                          capture_output=True).returncode == 0:
            return fields
    return ",".join(FIELDS).replace("clocks_event_reasons.active", "pstate")  # the same columns, a state for reasons


def parse_seqlens(text: str):
    if "x" in text:
        n, c = text.split("x")
        return (int(n),) * int(c)
    return tuple(int(x) for x in text.split("+"))


def run_for(fn, seconds: float) -> tuple:
    """Calls ``fn`` back to back for about ``seconds``; returns (calls, wall seconds, start, end) (epoch times)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    calls = 0
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        calls += 10
    t1 = time.time()
    return calls, t1 - t0, t0, t1


def read_samples(path: str):
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 7 or parts[0].startswith("timestamp"):
                continue
            try:
                stamp, frac = parts[0].split(".") if "." in parts[0] else (parts[0], "0")
                ts = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
                rows.append(dict(t=ts, power_w=float(parts[1].split()[0]), sm_mhz=float(parts[2].split()[0]),
                                 mem_mhz=float(parts[3].split()[0]), temp_c=float(parts[4]), throttle=parts[5],
                                 limit_w=float(parts[6].split()[0])))
            except ValueError:
                continue
    return rows


def summarize_run(r: dict, samples: list) -> dict:
    """Adds to a run's record (``t0``, ``t1``: its epoch start and end; ``ms``: time per call) the median SM clock
    and power of the samples in the run's second half (clocks settle in its first few hundred ms), the hottest
    temperature, the limit, the set of throttle reasons, and the cycles per call at that clock."""
    mid = (r["t0"] + r["t1"]) / 2
    inside = [s for s in samples if mid <= s["t"] <= r["t1"]]
    if inside:
        r["sm_mhz"] = statistics.median(s["sm_mhz"] for s in inside)
        r["power_w"] = statistics.median(s["power_w"] for s in inside)
        r["temp_c"] = max(s["temp_c"] for s in inside)
        r["limit_w"] = inside[0]["limit_w"]
        r["throttle"] = sorted({s["throttle"] for s in inside})
        r["samples"] = len(inside)
        r["mcycles_per_call"] = r["ms"] * r["sm_mhz"] / 1e3
    return r


def main(argv=None) -> int:
    from flashgdn.bench.impls import make_impls, parse_impls
    from flashgdn.bench.inputs import make_inputs
    from flashgdn.bench.shapes import Shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--seqlens", default="4096x8")
    ap.add_argument("--impls", default="flashgdn,flashqla")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--cp", default=None, help="flashgdn's cp argument (default: the library's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    hq, hv = (int(x) for x in args.heads.split("/"))
    shape = Shape("custom", hq, hv, parse_seqlens(args.seqlens))
    dev = torch.device("cuda")
    names, backends = parse_impls(args.impls)
    impls = make_impls(names, backends or ["hopper"], cp=args.cp)
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query_fields()}", "--format=csv,noheader", "-lms", "50"],
                           stdout=open(log, "w"), stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    inp = make_inputs(shape, 128, 128, dev)
    results = []
    try:
        for impl in impls:
            reason = impl.missing_reason(dev) or impl.refuse_reason(inp, "fwd")
            if reason:
                results.append(dict(impl=impl.label, error=reason))
                continue
            prep = impl.prepare(inp, "fwd")
            with torch.no_grad():
                calls, wall, t0, t1 = run_for(prep.forward, args.seconds)
            results.append(dict(impl=impl.label, calls=calls, ms=1e3 * wall / calls, t0=t0, t1=t1))
            time.sleep(1.0)  # idle between implementations, so each starts from the same state
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    samples = read_samples(log)
    for r in results:
        if "error" in r:
            continue
        summarize_run(r, samples)
        print(f"{r['impl']:>16}: {r['ms']:.3f} ms/call, SM {r.get('sm_mhz', 0):.0f} MHz, "
              f"{r.get('power_w', 0):.0f} W of {r.get('limit_w', 0):.0f}, "
              f"{r.get('mcycles_per_call', 0):.3f} Mcycles/call, throttle {r.get('throttle')}", flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stage_timing import results_header

    out = results_header(argv, "power_clocks.py") | dict(
        heads=args.heads, seqlens=args.seqlens, seconds=args.seconds, results=results,
        idle=[s for s in samples if s["t"] < (results[0].get("t0") or 0)][:5])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
