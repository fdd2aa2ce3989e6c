"""``benchmarks/power_clocks.py`` (CPU): nvidia-smi's samples parsed, and a run summarised from the samples inside
its second half."""
import time

from helpers import load_benchmark

pc = load_benchmark("power_clocks")


def _line(t, watts, mhz, reasons="0x0000000000000004"):
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(t))) + f".{int(round((t % 1) * 1000)):03d}"
    return f"{stamp}, {watts:.2f} W, {mhz} MHz, 3201 MHz, 54, {reasons}, 700.00 W\n"


def test_samples_are_parsed_and_a_run_is_summarised_from_its_second_half(tmp_path):
    t0 = 1_800_000_000.0
    # idle, then a run from t0 to t0 + 2 s: clocks high in its first second, settled at the cap in its second
    lines = [_line(t0 - 0.5, 80.0, 345, "0x0000000000000001")]
    lines += [_line(t0 + 0.1 * i, 650.0, 1980) for i in range(10)]
    lines += [_line(t0 + 1.0 + 0.1 * i, 692.0 + i % 2, 1770 + 10 * (i % 3)) for i in range(10)]
    lines += ["not a sample\n", "timestamp, power.draw [W], ...\n"]
    path = tmp_path / "smi.csv"
    path.write_text("".join(lines))
    samples = pc.read_samples(str(path))
    assert len(samples) == 21
    assert samples[0]["power_w"] == 80.0 and samples[0]["sm_mhz"] == 345.0 and samples[0]["limit_w"] == 700.0
    assert abs(samples[1]["t"] - t0) < 1e-3
    run = pc.summarize_run(dict(impl="x", ms=0.5, t0=t0, t1=t0 + 2.0), samples)
    assert run["samples"] == 10  # t0 + 1.0 .. t0 + 1.9: the second half only
    assert run["sm_mhz"] == 1780.0 and run["power_w"] == 692.5
    assert run["throttle"] == ["0x0000000000000004"]
    assert abs(run["mcycles_per_call"] - 0.5 * 1780.0 / 1e3) < 1e-9
    # a run with no sample inside gets nothing added
    assert "sm_mhz" not in pc.summarize_run(dict(impl="y", ms=1.0, t0=t0 + 10, t1=t0 + 11), samples)
