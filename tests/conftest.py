import os

import pytest
import torch

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription,
# which on a 2-core machine makes small CPU kernels orders of magnitude slower.
torch.set_num_threads(1)

# The suite builds hundreds of engines in each worker and rarely shuts them down: with the
# startup heap frozen (`freeze_gc`, runner/gc_heap.py) the cyclic garbage of earlier engines
# would stay until one shuts down. tests/runner/test_gc_heap.py turns it back on.
os.environ.setdefault("UNIFIED_ATTN_FREEZE_GC", "0")

# Without a GPU, Triton kernels run in its interpreter. The flag is read when kernels are
# decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--soak-steps", type=int, default=40, help="steps per engine soak run")
    parser.addoption("--soak-seeds", type=int, default=1, help="seeds per preset in the soak")


@pytest.fixture
def soak_steps(request):
    return request.config.getoption("--soak-steps")


@pytest.fixture
def soak_seeds(request):
    return request.config.getoption("--soak-seeds")
