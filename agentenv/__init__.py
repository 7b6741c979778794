"""agentenv: multi-turn tool-use environments for agent RL, with forkable state.

    import agentenv
    env = agentenv.make("multihop-qa")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("<search>Corliss Archer</search>")
    branch = env.fork()  # an independent copy of this state

See docs/environments.md for the tour: tools, parsers, graders, datasets, search, check_env; docs/rollouts.md for TokenEnv.
"""

import agentenv.envs  # noqa: F401  (registers the shipped environments)
from agentenv.core import Env, ForkStrategy, Text, fork
from agentenv.datasets import Example, Paragraph, load_examples
from agentenv.graders import Grade, grade
from agentenv.mcp_client import MCPHttpServer, MCPStdioServer, mcp_tools
from agentenv.options import OptionError, OptionTypeError
from agentenv.parsers import Action, JSONToolCallParser, ToolCall, ToolCallParser, XMLTagParser
from agentenv.registration import EnvSpec, UnknownEnvError, make, register, registry, spec
from agentenv.search import BM25Search, Passage, SearchBackend
from agentenv.tool_env import EpisodeState, ToolEnv, Turn
from agentenv.tools import Tool, ToolError, tool
from agentenv.wrappers import TokenEnv

__version__ = "0.1.0"

__all__ = [
    "Action",
    "BM25Search",
    "Env",
    "EnvSpec",
    "EpisodeState",
    "Example",
    "ForkStrategy",
    "Grade",
    "JSONToolCallParser",
    "MCPHttpServer",
    "MCPStdioServer",
    "OptionError",
    "OptionTypeError",
    "Paragraph",
    "Passage",
    "SearchBackend",
    "Text",
    "TokenEnv",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnv",
    "ToolError",
    "Turn",
    "UnknownEnvError",
    "XMLTagParser",
    "fork",
    "grade",
    "load_examples",
    "make",
    "mcp_tools",
    "register",
    "registry",
    "spec",
    "tool",
]
