"""Isolated, stateful, forkable Python interpreters for tool-using agents.

``LocalSandbox`` runs one persistent Python session per episode in a worker process;
``fork()`` copies it with ``os.fork`` (copy-on-write, milliseconds whatever the session holds).
``DockerSandbox`` offers the same contract in a Docker container and forks by replaying the
session. Both return a ``Result`` per call; ``Result.render()`` is the tool observation.

Isolation of a ``LocalSandbox`` (``sandbox.isolation.describe()`` lists it):

* with bubblewrap: own PID, network (loopback only), IPC and UTS namespaces; read-only system
  and Python installation and nothing else of the host (no home, working directory, /tmp or
  environment variables); a size-limited tmpfs scratch; its own user, no capabilities,
  no-new-privileges; setrlimit limits; everything dies with the container's PID 1.
* without it (a warning at start-up says so): setrlimit limits, a clean environment, a
  wall-clock timeout, output caps and, when run by root, a user of its own if the Python
  installation is readable to it. No file system, network or process isolation.

A sandbox and its forks share one container (the same rollout tree): each has its own memory
and its own copy of the scratch folder, but they can reach each other's folders, see and
signal each other's processes and share the process limit. Separate ``LocalSandbox()``
objects share nothing.

>>> from sandboxes import LocalSandbox
>>> with LocalSandbox() as box:
...     box.run("import numpy as np; a = np.arange(4)").ok
...     with box.fork() as child:     # a copy-on-write copy of the whole session
...         child.run("a += 1; int(a.sum())").value, box.run("int(a.sum())").value
True
('10', '6')
"""

from sandboxes.base import Sandbox, SandboxError
from sandboxes.docker_sandbox import DockerSandbox
from sandboxes.isolation import Isolation
from sandboxes.limits import Limits
from sandboxes.local_sandbox import DEFAULT_PREIMPORT, LocalSandbox
from sandboxes.result import KilledBy, Result

__all__ = [
    "DEFAULT_PREIMPORT",
    "DockerSandbox",
    "Isolation",
    "KilledBy",
    "Limits",
    "LocalSandbox",
    "Result",
    "Sandbox",
    "SandboxError",
]
