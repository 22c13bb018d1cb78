"""Suite-wide settings: one intra-op thread in the pytest process too (CI has 2 cores and ranks
run beside it; two threads were 4x slower under that load)."""

import torch

torch.set_num_threads(1)


def pytest_unconfigure(config):
    """Kept rank groups leave before pytest does, so that their coverage data is written."""
    from tests.harness import close_kept_groups

    close_kept_groups()


# The modules that take longest (a minute or more of a worker, docs/bench/test_suite.txt), handed out
# first: pytest-xdist's loadfile gives modules to workers in collection order, and one of these
# collected last (alphabetically, test_trl.py is) left a worker idle for a minute at the end.
LONGEST_FIRST = ("test_bench.py", "test_trl.py", "test_multinode.py", "test_train.py")


def pytest_collection_modifyitems(config, items):
    """Move the LONGEST_FIRST modules to the front, each module's tests in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
