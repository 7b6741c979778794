"""One local Ray instance for the whole test session (starting Ray costs ~15 s on two cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """Ray started on this machine (as ``cluster.address=local`` does), shut down after the session."""
    from agents.cluster.runtime import ensure_ray

    ray = ensure_ray("local", processes=4)
    yield ray
    ray.shutdown()
