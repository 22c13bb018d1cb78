"""Suite-wide settings: one intra-op thread in the pytest process too (CI has 2 cores and ranks
run beside it; two threads were 4x slower under that load)."""

import torch

torch.set_num_threads(1)


def pytest_unconfigure(config):
    """Kept rank groups leave before pytest does, so that their coverage data is written."""
    from tests.harness import close_kept_groups

    close_kept_groups()
