import pytest
import torch


@pytest.fixture
def torch_threads():
    """Set torch's intra-op threads for one test (a kernel's multi-thread split); restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
