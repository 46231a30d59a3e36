#!/usr/bin/env python3
"""The SM clock and power a GPU ran at, per step of a device script.

    gpu_clocks.py sample SAMPLES [INTERVAL_MS]   (in the background; stop it with kill)
    gpu_clocks.py report SAMPLES MARKS

`sample` becomes nvidia-smi writing one line per INTERVAL_MS (default 200) to SAMPLES: time,
SM clock, power, temperature and clock event reasons, the fields `report` reads (so both
ends of the format live here). MARKS: one line per step, `YYYY/MM/DD HH:MM:SS.NNNNNNNNN NAME`
(`date +%Y/%m/%d\\ %H:%M:%S.%N`), written when the step starts. `report` prints, per step,
the samples drawn while the GPU was busy (above 300 W), their median SM clock (and lowest),
median power, the hottest reading and the clock event reasons seen (0x4: the software power
cap). An H200 runs long attention kernels at its 700 W cap, so its clock, and with it a
kernel's TFLOP/s, follows the power a kernel draws and the chip's temperature
(docs/benchmarks.md, session 27).
"""
import datetime
import os
import statistics
import sys

BUSY_W = 300.0
FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def sample(path, interval_ms):
    """Replace this process by nvidia-smi sampling FIELDS into `path` (the caller's pid is
    then nvidia-smi's, so killing it stops the sampling)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.execvp("nvidia-smi", ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", str(interval_ms)])


def parse(stamp):
    # nvidia-smi writes milliseconds, date nanoseconds: both cut to microseconds
    return datetime.datetime.strptime(stamp.strip()[:26], "%Y/%m/%d %H:%M:%S.%f")


def report(samples_path, marks_path):
    marks = []
    for line in open(marks_path):
        if line.strip():
            date, clock, name = line.split(" ", 2)
            marks.append((parse(f"{date} {clock}"), name.strip()))
    steps = {}
    for line in open(samples_path):
        f = [x.strip() for x in line.split(",")]
        try:
            t, clk, pw, temp, why = parse(f[0]), float(f[1]), float(f[2]), float(f[3]), f[4]
        except (ValueError, IndexError):
            continue  # a header, an "[N/A]" reading, a cut line
        name = next((n for m, n in reversed(marks) if t >= m), None)
        if name is not None and pw > BUSY_W:
            steps.setdefault(name, []).append((clk, pw, temp, why))
    for name, v in steps.items():
        print(
            f"clock {name}: {len(v)} busy samples, SM {statistics.median(x[0] for x in v):.0f} MHz median "
            f"(min {min(x[0] for x in v):.0f}), power {statistics.median(x[1] for x in v):.0f} W median, "
            f"up to {max(x[2] for x in v):.0f} C, reasons {'/'.join(sorted(set(x[3] for x in v)))}"
        )


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "sample":
        ms = sys.argv[3] if len(sys.argv) == 4 else "200"
        if not ms.isdigit() or int(ms) == 0:
            sys.exit(f"gpu_clocks.py sample: INTERVAL_MS {ms!r}: expected a whole number of milliseconds above 0")
        sample(sys.argv[2], int(ms))
    elif len(sys.argv) == 4 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: gpu_clocks.py sample SAMPLES [INTERVAL_MS] | gpu_clocks.py report SAMPLES MARKS")
