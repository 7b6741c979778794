"""Credit assignment, importable by their short path; the home is :mod:`agents.training.credit`."""

from agents.training.credit import *  # noqa: F403
from agents.training.credit import __all__  # noqa: F401
