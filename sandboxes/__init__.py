"""Isolated, stateful, forkable Python interpreters for tool-using agents.

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

__all__ = ["DEFAULT_PREIMPORT", "DockerSandbox", "Isolation", "KilledBy", "Limits", "LocalSandbox",
           "Result", "Sandbox", "SandboxError"]
