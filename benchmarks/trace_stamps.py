"""What the kernels' trace builds have in common, for the scripts that read them (``fused_backward_trace.py``,
``rso_trace.py``, ``fused_trace.py``): a trace is ``stamps[role][chunk][point]``, the SM's cycle counter at fixed
points of each role's chunk (0 where never written), and it is read as medians counted from one role's first point of
the same chunk. The chunk loops' scripts also share their random inputs (``loop_tensors``) and printout."""
import statistics


def medians_by_point(stamps, points_of, roles, ref_role, skip=2):
    """Medians over chunks ``skip`` .. n - 2 (those whose reference stamp and the next chunk's are written), each
    point counted from role ``ref_role``'s point 0 of the same chunk: ``(median chunk length or None, {role name:
    [(point description, median offset or None), ...]})``."""
    ref = [row[0] for row in stamps[ref_role]]
    chunks = [c for c in range(skip, len(ref) - 1) if ref[c] and ref[c + 1]]
    length = statistics.median(ref[c + 1] - ref[c] for c in chunks) if chunks else None
    out = {}
    for role, name in enumerate(roles):
        rows = []
        for point, desc in enumerate(points_of[role]):
            vals = [stamps[role][c][point] - ref[c] for c in chunks if stamps[role][c][point]]
            rows.append((desc, statistics.median(vals) if vals else None))
        out[name] = rows
    return length, out


def time_both(fns, reps=5):
    """``{name: ms}``: each ``fns[name]()`` (the trace build and the plain one) run once, then ``reps`` times between
    two CUDA events, the mean per call."""
    import torch

    times = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / reps
    return times


def loop_tensors(Hqk, Hv, seqlens, seed=0):
    """Random inputs of a chunk loop (bf16 q, k, v with K = V = 128, the harness's decay, an initial state) on the GPU:
    ``(q, k, v, g, beta, h0, cu, outputs)``, ``outputs()`` fresh NaN-filled ``[o, ht]``. The loops' trace scripts
    (``rso_trace.py``, ``fused_trace.py``) build their arguments from these."""
    import torch

    from flashgdn.kernels.hopper.forward import _output

    K = V = 128
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(seqlens)
    N = len(seqlens)
    cu = torch.tensor([0] + list(seqlens), device=dev).cumsum(0).to(torch.int32)
    bf = torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, Hv, V, generator=gen, device=dev).to(bf)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen, device=dev)) / 16
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen, device=dev))
    h0 = torch.randn(N, Hv, K, V, generator=gen, device=dev)

    def outputs():
        return [_output((1, T, Hv, V), bf, dev), _output((N, Hv, K, V), torch.float32, dev)]

    return q, k, v, g, beta, h0, cu, outputs


def print_roles(roles):
    """A summary's ``{role: [(point description, median offset or None), ...]}``, a line a point."""
    for role, rows in roles.items():
        print(f"  {role}:")
        for desc, off in rows:
            print(f"    {'-' if off is None else off:>8}  {desc}")
