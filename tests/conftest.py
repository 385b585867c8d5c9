import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_finish(session):
    # The sm_90 compiles of test_fake_gpu_compile.py take minutes of one core each: start them
    # now, in child processes, so they run beside the rest of the suite.
    module = sys.modules.get("tests.test_fake_gpu_compile")
    if module is not None:
        module.start_children(session.items)
