"""The policy losses, importable by their short path; the home is :mod:`agents.training.losses`."""

from agents.training.losses import *  # noqa: F403
from agents.training.losses import __all__  # noqa: F401
