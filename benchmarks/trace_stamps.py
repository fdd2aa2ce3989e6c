"""What the kernels' trace builds have in common, for the scripts that read them (``fused_backward_trace.py``,
``rso_trace.py``): a trace is ``stamps[role][chunk][point]``, the SM's cycle counter at fixed points of each role's
chunk (0 where never written), and it is read as medians counted from one role's first point of the same chunk."""
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
