#!/usr/bin/env python3
"""The SM clock and power a GPU ran at, per step of a device script.

    gpu_clocks.py SAMPLES MARKS

SAMPLES: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 200` output. MARKS: one line
per step, `YYYY/MM/DD HH:MM:SS.NNNNNNNNN NAME` (`date +%Y/%m/%d\\ %H:%M:%S.%N`), written when
the step starts. Prints, per step, the samples drawn while the GPU was busy (above 300 W),
their median SM clock (and lowest), median power, the hottest reading and the clock event
reasons seen (0x4: the software power cap). An H200 runs long attention kernels at its 700 W
cap, so its clock, and with it a kernel's TFLOP/s, follows the power a kernel draws and the
chip's temperature (docs/benchmarks.md, session 27).
"""
import datetime
import statistics
import sys

BUSY_W = 300.0


def parse(stamp):
    # nvidia-smi writes milliseconds, date nanoseconds: both cut to microseconds
    return datetime.datetime.strptime(stamp.strip()[:26], "%Y/%m/%d %H:%M:%S.%f")


def main(samples_path, marks_path):
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
    if len(sys.argv) != 3:
        sys.exit("usage: gpu_clocks.py SAMPLES MARKS")
    main(sys.argv[1], sys.argv[2])
