"""Only GPU tests and tests that mount a filesystem may skip, and each skip says why (`-ra` prints it
in the summary).

A test marked `gpu` is skipped where torch sees no CUDA device, one marked `mount` where the machine
refuses its mount (not root); any other test that skips fails, so a test that can run on the CPU
never passes unnoticed as a skip.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped, with the reason, where there is none")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU-only: torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and item.get_closest_marker("gpu") is None and item.get_closest_marker("mount") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped ({reason}), but only tests marked gpu or mount may skip"
