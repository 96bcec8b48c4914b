import os

import pytest
import torch

from tests.helpers.launch import end_process_tree

# Nothing may reach a hub during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a busy small machine OpenMP's
    spin-waiting makes them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo) -> None:
    """Ctrl-C (or SIGINT to scripts/test.sh): end every process the tests started, now.

    The terminal's SIGINT reaches the processes of its foreground group only: a rank launched in a
    session of its own (tests/helpers/launch.py) never gets it, and gloo workers blocked in a
    collective wait out its timeout; both ran on for seconds after pytest had stopped.
    """
    end_process_tree()
