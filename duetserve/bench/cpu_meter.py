"""How much CPU other processes used while a measurement ran (Linux /proc/stat).

The machines are shared and small: a compile or a test in another checkout during a timed
run inflates what it measures. Benchmarks report `foreign_cpu_s` (machine busy CPU
seconds minus this process's) so a contaminated run can be seen and redone.
"""
from __future__ import annotations

import os
import time


def _machine_ticks_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot (nan when /proc is
    missing). Steal: time the hypervisor gave this VM's CPUs to others, which no process
    here shows but which slows every timed step just the same."""
    try:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    hz = os.sysconf("SC_CLK_TCK")
    steal = ticks[7] / hz if len(ticks) > 7 else 0.0
    return (sum(ticks[:7]) - ticks[3] - ticks[4]) / hz, steal    # minus idle, iowait


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (nan when /proc is missing)."""
    return _machine_ticks_s()[0]


class ForeignCpu:
    """Started at construction; `foreign_s()` = CPU seconds used by other processes since."""

    def __init__(self) -> None:
        (self.machine0, self.steal0), self.own0, self.wall0 = _machine_ticks_s(), \
            time.process_time(), time.perf_counter()

    def steal_s(self) -> float:
        """CPU seconds the hypervisor took from this machine since construction."""
        return max(0.0, _machine_ticks_s()[1] - self.steal0)

    def foreign_s(self) -> float:
        machine = _machine_busy_s() - self.machine0
        return max(0.0, machine - (time.process_time() - self.own0))

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.wall0

    def foreign_fraction(self) -> float:
        """Foreign CPU seconds per wall second (0 = nothing else ran; 1 = a whole core)."""
        return self.foreign_s() / max(1e-9, time.perf_counter() - self.wall0)


def wait_until_quiet(max_fraction: float = 0.1, window_s: float = 5.0,
                     timeout_s: float = 900.0) -> float:
    """Block until other processes used at most `max_fraction` of a core over a window of
    `window_s` (a benchmark's own process is idle meanwhile). Returns the last window's
    fraction (above max_fraction only when timeout_s ran out)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        meter = ForeignCpu()
        time.sleep(window_s)
        fraction = meter.foreign_fraction()
        if fraction <= max_fraction or time.perf_counter() > deadline:
            return fraction
