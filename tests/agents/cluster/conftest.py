"""One local Ray instance for the whole test session (starting Ray costs ~15 s on two cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """Ray started on this machine (as ``cluster.address=local`` does), shut down after the session."""
    from agents.cluster.runtime import ensure_ray

    # Logical CPUs for every actor alive at once in one module (a module's worker pool plus a run's
    # two workers and two ranks); Ray would otherwise wait for free CPUs forever.
    ray = ensure_ray("local", processes=8)
    yield ray
    ray.shutdown()
