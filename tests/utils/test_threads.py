"""CPU threads when a command is not told (loramcl.utils.threads): the free cores, a bad --threads refused by name, and
OpenMP's waiting threads asleep when a core is busy."""

import os
import subprocess
import sys

import pytest
import torch

from loramcl.cli import main
from loramcl.utils import threads


@pytest.fixture
def untold(monkeypatch):
    """No OMP_NUM_THREADS in the environment (the tests set it to 1); torch's threads restored afterwards."""
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.setattr(threads, "_free_at_start", None)  # no command line measured them
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("free, expected", [(0.0, 1), (0.6, 1), (1.0, 1), (1.8, 2), (2.0, 2), (64.0, 2)])
def test_the_default_is_the_free_cores(untold, monkeypatch, free, expected):
    """Rounded down unless nearly free, at least one, at most one per physical core (torch's own default)."""
    monkeypatch.setattr(threads, "free_cores", lambda seconds=threads.MEASURE_SECONDS: free)
    monkeypatch.setattr(threads, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr("psutil.cpu_count", lambda logical=True: 2)
    assert threads.use_threads(None) == expected == torch.get_num_threads()


def test_given_threads_and_the_environment_win(untold, monkeypatch):
    monkeypatch.setattr(threads, "free_cores", lambda seconds=threads.MEASURE_SECONDS: pytest.fail("measured"))
    assert threads.use_threads(1) == 1 == torch.get_num_threads()
    monkeypatch.setenv(threads.THREADS_ENV, "1")
    torch.set_num_threads(1)
    assert threads.use_threads(None) == 1


def test_a_busy_core_is_not_free():
    """A process spinning on one of our cores leaves at most the others free (whatever else runs)."""
    cores = threads.usable_cores()
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[0]}}})\n"
                             "while True: pass"])
    try:
        import time

        time.sleep(0.3)  # started and spinning
        assert threads.free_cores(0.5) <= len(cores) - 0.5
    finally:
        spin.kill()
        spin.wait()


def test_a_command_refuses_a_bad_thread_count_before_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["markov", "--out", str(tmp_path / "m"), "--threads", "0"])
    assert stopped.value.code == 2
    assert "error: --threads must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("free, policy", [(0.5, "PASSIVE"), (2.0, None)])
def test_a_command_on_a_busy_machine_lets_waiting_threads_sleep(untold, monkeypatch, tmp_path, free, policy):
    """A command that runs a model measures the free cores once, before torch would load: with a core busy, OpenMP's
    waiting threads sleep (OMP_WAIT_POLICY=PASSIVE); on an idle machine OpenMP keeps its own waits; the measure is
    the threads' default."""
    measured = []
    monkeypatch.delenv(threads.WAIT_POLICY_ENV, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(threads, "free_cores", lambda seconds=threads.MEASURE_SECONDS: measured.append(1) or free)
    with pytest.raises(SystemExit):  # stops at its options, after the measure
        main(["markov", "--out", str(tmp_path / "m"), "--threads", "0"])
    assert measured == [1] and os.environ.get(threads.WAIT_POLICY_ENV) == policy
    monkeypatch.setattr("psutil.cpu_count", lambda logical=True: 2)
    assert threads.default_threads() == (1 if free < 1 else 2) and measured == [1]  # measured once
    monkeypatch.setenv(threads.WAIT_POLICY_ENV, "ACTIVE")
    monkeypatch.setenv(threads.THREADS_ENV, "2")
    with pytest.raises(SystemExit):
        main(["markov", "--out", str(tmp_path / "m"), "--threads", "0"])
    assert measured == [1] and os.environ[threads.WAIT_POLICY_ENV] == "ACTIVE"  # the environment chose both
