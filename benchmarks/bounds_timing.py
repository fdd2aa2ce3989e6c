"""The CP bounds alone (``flashgdn.cp.bounds``), the device ops that run beside stage 1: each one's time against
the packed tokens, and PyTorch's one-level scan over dim 0 beside the blocked ``_token_scan`` that replaced it.

    python benchmarks/bounds_timing.py --tokens 8192,131072 --heads 2/4,8/16 --out bounds.json

The bounds' inputs are random (their values do not change the work); segments of 64 chunks.
"""
import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    from flashgdn.bench.timing import measure, timed_call
    from flashgdn.cp import bounds
    from stage_timing import results_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,131072")
    ap.add_argument("--heads", default="2/4,8/16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    header = results_header(argv, "bounds_timing.py") if dev.type == "cuda" else {"device": "cpu"}
    records = []
    for heads in args.heads.split(","):
        Hqk, Hv = (int(x) for x in heads.split("/"))
        for T in (int(x) for x in args.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(T)
            k = torch.randn(1, T, Hqk, 128, device=dev, generator=gen).to(torch.bfloat16)
            v = torch.randn(1, T, Hv, 128, device=dev, generator=gen).to(torch.bfloat16)
            g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, device=dev, generator=gen)) / 16
            beta = torch.rand(1, T, Hv, device=dev, generator=gen)
            seg_cu = torch.arange(0, T + 1, 64 * 64, device=dev, dtype=torch.int32)
            if int(seg_cu[-1]) != T:
                seg_cu = torch.cat([seg_cu, torch.tensor([T], device=dev, dtype=torch.int32)])
            num_chunks = bounds.chunk_count(seg_cu.cpu())
            per_token = bounds.token_log_growth(k, g, beta).to(torch.float64)
            cases = {
                "token_log_growth": lambda: bounds.token_log_growth(k, g, beta),
                "transition_log_bounds": lambda: bounds.transition_log_bounds(k, g, beta, seg_cu),
                "b_start_chunks": lambda: bounds.b_start_chunks(k, v, g, beta, seg_cu, num_chunks),
                "walk_stop_chunks": lambda: bounds.walk_stop_chunks(k, k, g, beta, v, 0.1, seg_cu, num_chunks),
                "cumsum dim 0 (one level)": lambda: per_token.cumsum(0),
                "cumsum blocked": lambda: bounds._token_scan(per_token, log=False),
                "logcumsumexp dim 0 (one level)": lambda: per_token.logcumsumexp(0),
                "logcumsumexp blocked": lambda: bounds._token_scan(per_token, log=True),
            }
            for name, fn in cases.items():
                fn()
                _, steady = timed_call(fn, dev)
                t = measure(fn, dev, steady)
                ms = t.ms
                records.append(dict(heads=heads, tokens=T, case=name, ms=ms))
                print(f"{heads:6s} {T:7d}  {name:32s} {ms:9.4f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=header, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
