import os

import pytest
import torch

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
