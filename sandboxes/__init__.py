"""Isolated, stateful, forkable Python interpreters for tool-using agents.

``LocalSandbox`` runs one persistent Python session per episode in a worker process;
``fork()`` copies it with ``os.fork`` (copy-on-write, milliseconds whatever the session holds).
``DockerSandbox`` offers the same contract in a Docker container and forks by replaying the
session. Both return a ``Result`` per call; ``Result.render()`` is the tool observation.

Isolation of a ``LocalSandbox`` (``sandbox.isolation.describe()`` lists it):

* with bubblewrap: own PID, network (loopback only), IPC and UTS namespaces; read-only system
  and Python installation and nothing else of the host (no home, working directory, /tmp or
  environment variables); a size-limited tmpfs scratch; its own user, no capabilities,
  no-new-privileges, no user namespaces (so no namespaces at all) inside; setrlimit limits
  that the code cannot raise; everything dies with the container's PID 1.
* without it (a warning at start-up says so): setrlimit limits, a clean environment, a
  wall-clock timeout, output caps and, when run by root, a user of its own, which needs a
  Python installation readable by others. No file system, network or process isolation. Model
  code never runs as root this way: where no user of its own is possible, "auto" and
  "process" refuse, naming the fixes; only ``isolation="unsafe-process"`` runs it as root
  (without capabilities).
* in both, where a cgroup can be made (root, or a delegated cgroup v2 subtree): one memory
  limit (``Limits.total_memory_bytes``) and one process limit for the sandbox and its forks
  together; elsewhere their memory is bounded only by ``max_processes × memory_bytes``.

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
