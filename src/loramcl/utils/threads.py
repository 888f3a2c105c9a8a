"""How many CPU threads torch runs on when a command is not told: the cores that are free when it starts.

torch's own default is one OpenMP thread per core. When another job holds a core, every parallel region of a forward
then waits for a thread that shares its core with that job, and the waiting threads spin: measured on 2 cores beside
another job, the docs' first `loramcl train` and a Markov run took 1.6 to 1.9 times as long as on the free cores
(docs/benchmarks.md, "CPU threads"). So a command that runs a model measures, once, how busy the cores it may use are
(a quarter of a second, before torch loads) and takes the free ones when it gets no `--threads`: at least one, at most
torch's default. When some core is busy at that moment, the command line also lets OpenMP's waiting threads sleep
(`OMP_WAIT_POLICY=PASSIVE`): beside a busy core they cost less that way, while on an idle machine OpenMP's own short
spin is faster (sleeping cost the Markov run 20%). An environment that sets OMP_NUM_THREADS or OMP_WAIT_POLICY keeps its
own choice.
"""

from __future__ import annotations

import math
import os
import warnings

from loramcl.utils.validate import require

THREADS_ENV = "OMP_NUM_THREADS"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
MEASURE_SECONDS = 0.25
# A core counts as free when at most this much of it is used by others (a desktop's or a CI runner's background).
BUSY_TOLERANCE = 0.25
# More CPU threads than any machine has (the largest servers have a few hundred cores); torch's own limit is 2^31.
MAX_THREADS = 4096


_free_at_start: float | None = None  # free cores, measured by ``settle_before_torch`` (the command line)


def settle_before_torch() -> None:
    """For a command that runs a model, before torch is imported (OpenMP reads its settings when it loads): measure
    the free cores once (``default_threads`` uses the measure), and if some core is busy let OpenMP threads that
    wait for work sleep instead of spinning, unless the environment chose."""
    global _free_at_start
    if os.environ.get(THREADS_ENV, "").strip() and os.environ.get(WAIT_POLICY_ENV, "").strip():
        return  # the environment chose both
    _free_at_start = free_cores()
    if _free_at_start + BUSY_TOLERANCE < len(usable_cores()):
        os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, `taskset`)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def free_cores(seconds: float = MEASURE_SECONDS) -> float:
    """How many of the usable CPUs other processes leave free, measured over ``seconds`` (this process idles)."""
    import psutil

    cores = usable_cores()
    per_core = psutil.cpu_percent(interval=seconds, percpu=True)
    busy = sum(per_core[c] for c in cores if c < len(per_core)) / 100
    return max(len(cores) - busy, 0.0)


def default_threads() -> int:
    """The free cores, rounded down unless nearly free, at least 1 and at most torch's own default (one thread per
    physical core)."""
    import psutil

    cores = len(usable_cores())
    physical = min(psutil.cpu_count(logical=False) or cores, cores)
    free = _free_at_start if _free_at_start is not None else free_cores()
    return max(1, min(physical, math.floor(free + BUSY_TOLERANCE)))


def check_threads(threads: int | None) -> None:
    """``threads`` is None or an integer in [1, MAX_THREADS]: checked before any work, as often as a command likes
    (``use_threads`` says once if it is more than the cores)."""
    if threads is None:
        return
    require(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
            f"threads must be an integer >= 1 (torch CPU threads; leave it out to use the free cores), got {threads!r}",
            "threads")
    require(threads <= MAX_THREADS, f"threads must be at most {MAX_THREADS} (no machine has that many cores; leave it "
            f"out to use the free cores), got {threads!r}", "threads")


def use_threads(threads: int | None) -> int:
    """Set torch's CPU threads for a command: ``threads`` if given; else those of OMP_NUM_THREADS if it is set (torch
    read it); else the cores free now (``default_threads``). Returns the number set. More threads than the usable
    cores is a warning (no recipe asks for that, but a machine may be about to change)."""
    import torch

    check_threads(threads)
    if threads is None and os.environ.get(THREADS_ENV, "").strip():
        return torch.get_num_threads()
    cores = len(usable_cores())
    if threads is not None and threads > cores:  # warned from here, one place: Python shows it once per process
        warnings.warn(f"threads {threads} is more than the {cores} CPU cores this process may use: the extra threads "
                      "share cores and slow every step down; leave it out to use the free cores", stacklevel=1)
    chosen = threads if threads is not None else default_threads()
    torch.set_num_threads(chosen)
    return chosen
