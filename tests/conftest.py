"""Test setup: Triton kernels run in Triton's interpreter on CPU.

TRITON_INTERPRET must be set before any kernel module is imported (decoration time). Model-level
tests run on the reference backend (fast); kernel tests call the Triton path explicitly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
# Fresh examples on each run (the tests' own max_examples still apply): a search for rare failures,
# HYPOTHESIS_PROFILE=fuzz python -m pytest tests/test_generate.py --hypothesis-seed=$RANDOM
settings.register_profile("fuzz", deadline=None, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _backend_for_test(request):
    """Model-level tests run on the reference ops; tests marked ``triton`` dispatch normally
    (so on CPU, with the interpreter on, they run the Triton kernels)."""
    from mrp_triton import use_backend

    if request.node.get_closest_marker("triton"):
        yield
        return
    with use_backend("reference"):
        yield
