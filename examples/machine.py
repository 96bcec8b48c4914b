"""How many torch threads the demo should use on this machine now, and the words that say why.

torch starts one intra-op thread per physical core. On a machine where other work holds some of
the cores, those threads wait for each other at every operation's barrier while the busy cores
run something else, and training gets many times slower, not just a core's share slower (on a
2-core machine with one core busy, 2 threads trained MiniLM-L6 several times slower than 1 thread:
README, "Times on your machine"). So the demo uses the cores that are free now: the CPUs this
process may run on, minus those other work kept busy over a short sample of ``/proc/stat``,
capped at the physical cores, at least one::

    python examples/machine.py               # "THREADS CPUS BUSY" (e.g. "1 2 1.0"), then two lines saying why
    python examples/machine.py --threads 2   # the same for a thread count chosen elsewhere (OMP_NUM_THREADS)

scripts/demo.sh reads both lines, sets ``OMP_NUM_THREADS`` (unless it is set) and hands the first
to examples/reference.py, which compares this machine's speed with the README's.

Linux reads ``/proc/stat`` and ``/sys``; elsewhere the 1-minute load average stands in for the busy
CPUs, and the CPU count for the physical cores.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Machine", "busy_cpus", "choose_threads", "main", "physical_cores", "usable_cpus"]


@dataclass(frozen=True)
class Machine:
    """What the thread count was chosen from: usable CPUs, physical cores among them, CPUs busy with other work."""

    cpus: int
    cores: int
    busy: float
    threads: int

    chosen: bool = False  # the thread count came from OMP_NUM_THREADS, not from the free cores

    def words(self) -> tuple[str, str]:
        """What was chosen and why, in two lines of under 80 columns with the demo's prefix."""
        thread = "thread" if self.threads == 1 else "threads"
        why = "set by OMP_NUM_THREADS" if self.chosen else "one per free core, at least 1; OMP_NUM_THREADS=N to choose"
        return f"{self.threads} torch {thread}: {self.cpus} CPU(s), {self.busy:.1f} of them busy with other work", f"({why})"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, e.g. a container's or taskset's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def physical_cores(cpus: int) -> int:
    """Physical cores among the usable CPUs (hyperthreads of one core count once); ``cpus`` where unknown."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
        siblings = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip() for c in allowed}
    except (AttributeError, OSError):
        return cpus
    return max(1, min(cpus, len(siblings)))


def _allowed() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies summed over the CPUs this process may use, from ``/proc/stat``'s per-CPU lines
    (``None`` where unreadable). Other CPUs' load (a container's neighbours) does not count."""
    allowed = _allowed()
    busy = total = 0.0
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu" or (allowed is not None and int(name[3:]) not in allowed):
                continue
            fields = [float(x) for x in values]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
            spent = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
            busy, total = busy + spent - idle, total + spent
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total > 0 else None


def busy_cpus(sample_s: float = 1.0) -> float:
    """How many of the usable CPUs other work keeps busy: their busy share of time over ``sample_s`` seconds, times
    their count (this process sleeps meanwhile, so the share is the others'). Without ``/proc/stat``: the
    1-minute load average (0 where that is unknown too)."""
    first = _cpu_times()
    if first is None:
        try:
            return float(os.getloadavg()[0])
        except (AttributeError, OSError):
            return 0.0
    time.sleep(sample_s)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return 0.0
    return (second[0] - first[0]) / (second[1] - first[1]) * usable_cpus()


def choose_threads(cpus: int, cores: int, busy: float) -> int:
    """The free cores: usable CPUs minus the busy ones (rounded), at most the physical cores, at least 1."""
    return max(1, min(cores, cpus - int(busy + 0.5)))


def measure(sample_s: float = 1.0, threads: int | None = None) -> Machine:
    """This machine now: its CPUs, cores, the busy ones over ``sample_s`` seconds, and the threads to use
    (``threads``: chosen elsewhere, e.g. ``OMP_NUM_THREADS``; ``None``: the free cores)."""
    cpus = usable_cpus()
    cores = physical_cores(cpus)
    busy = min(float(cpus), busy_cpus(sample_s))
    if threads is not None:
        return Machine(cpus=cpus, cores=cores, busy=busy, threads=threads, chosen=True)
    return Machine(cpus=cpus, cores=cores, busy=busy, threads=choose_threads(cpus, cores, busy))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="a thread count chosen elsewhere (OMP_NUM_THREADS)")
    parser.add_argument("--sample", type=float, default=1.0, help="seconds to sample the CPUs' load over (default 1)")
    args = parser.parse_args(argv)
    machine = measure(args.sample, args.threads)
    print(f"{machine.threads} {machine.cpus} {machine.busy:.1f}")
    print("\n".join(machine.words()))


if __name__ == "__main__":
    main()
