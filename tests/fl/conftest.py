"""Every test in tests/fl creates Flower messages: stamp the process-wide task identity first."""

import pytest

from fedge.flower.compat import set_task_identity


@pytest.fixture(autouse=True)
def _task_identity():
    set_task_identity(run_id=1)
