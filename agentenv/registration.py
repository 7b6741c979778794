"""The environment registry: ``register``, ``make``, ``spec`` and ``registry``.

Ids follow Gymnasium's grammar ``[namespace/]name[-vN]`` (names may hold ``:`` for variants, as
in ``multihop-qa:2wiki``). ``make("name")`` picks the highest registered version when only
versioned ids exist.

Every environment is also registered with Gymnasium, as ``agentenv/<id>`` with ``:`` and ``/``
written as ``.`` (Gymnasium reads ``:`` as ``module:env``): ``gymnasium.make("agentenv/multihop-qa")``
and ``gymnasium.make("agentenv/multihop-qa.2wiki")`` work once agentenv is imported, and
``gymnasium.make("agentenv:agentenv/multihop-qa")`` imports it first.

Other installed packages add environments through the entry-point group ``agentenv.envs``; an
entry point may name an :class:`~agentenv.core.Env` subclass (registered under the entry
point's name), a function (called once, it registers what it likes) or a module (imported).
Plugins are loaded on first use of the registry, not at import.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import gymnasium
from gymnasium.envs.registration import parse_env_id

from agentenv.core import Env
from agentenv.options import OptionError, OptionTypeError, unknown_option
from agentenv.tools import close_tools

__all__ = [
    "EnvSpec",
    "OptionError",
    "OptionTypeError",
    "UnknownEnvError",
    "load_entry_point",
    "make",
    "register",
    "registry",
    "spec",
]

ENTRY_POINT_GROUP = "agentenv.envs"


def load_entry_point(name: str) -> Any:
    """The object a ``"module:attr"`` string names (the module imported); ImportError or AttributeError
    when there is none."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


class UnknownEnvError(KeyError):
    """No environment with that id; the message lists close matches."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


@dataclass(frozen=True)
class EnvSpec:
    """How to build one registered environment."""

    id: str
    entry_point: str | Callable[..., Env]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    nondeterministic: bool = False
    description: str = ""

    @property
    def namespace(self) -> str | None:
        return parse_env_id(self.id)[0]

    @property
    def name(self) -> str:
        return parse_env_id(self.id)[1]

    @property
    def version(self) -> int | None:
        return parse_env_id(self.id)[2]

    @property
    def gymnasium_id(self) -> str:
        """The id under which Gymnasium knows this environment.

        Gymnasium reads ``a:b`` as ``module:env`` and allows one namespace, so ``:`` and ``/``
        become ``.``: ``multihop-qa:2wiki`` is ``agentenv/multihop-qa.2wiki`` there.
        """
        return "agentenv/" + self.id.replace("/", ".").replace(":", ".")

    def load(self) -> Callable[..., Env]:
        """The class or factory named by ``entry_point``."""
        if callable(self.entry_point):
            return self.entry_point
        return load_entry_point(self.entry_point)

    def make(self, **overrides: Any) -> Env:
        """Build the environment with the registered defaults updated by ``overrides``.

        A bad option raises :class:`~agentenv.options.OptionError` (a ``ValueError``; for a wrong type
        or an option the environment does not take, :class:`~agentenv.options.OptionTypeError`, also
        a ``TypeError``), one line starting ``make(id):`` that names the option, the value and
        what is allowed, or lists the valid options.
        """
        kwargs = {**self.kwargs, **overrides}
        try:
            env = self._build(kwargs)
        except Exception:
            # The env owns the tools it is given (its close() closes them); one never built must close
            # them itself, or an MCP server's processes outlive the failed make().
            tools = kwargs.get("tools")
            if isinstance(tools, list | tuple):
                close_tools(tools)
            raise
        env.spec = dataclasses.replace(gymnasium.spec(self.gymnasium_id), kwargs=kwargs)
        return env

    def _build(self, kwargs: dict[str, Any]) -> Env:
        factory = self.load()
        where = f"make({self.id!r})"
        _check_binds(factory, kwargs, where)
        try:
            env = factory(**kwargs)
        except OptionError as e:  # the shipped environments check every option before doing any work
            raise e.in_context(where) from None
        except TypeError as e:
            if "unexpected keyword argument" not in str(e):
                raise
            # An override that a factory taking **kwargs passes on to a constructor that does not take it.
            raise OptionTypeError(f"{where}: {e}") from None
        if not isinstance(env, Env):
            raise TypeError(f"the entry point of {self.id!r} returned {type(env).__name__}, not an agentenv.Env")
        return env


def _check_binds(factory: Callable[..., Env], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise :class:`OptionTypeError` unless ``factory(**kwargs)`` fits its signature; an unknown name lists the valid ones."""
    signature = inspect.signature(factory)
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        params = signature.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = next((name for name in kwargs if name not in names), None)
        if unknown is not None and not takes_any:
            raise unknown_option(unknown, names).in_context(where) from None
        raise OptionTypeError(f"{where}: {e}") from None


class Registry(Mapping[str, EnvSpec]):
    """Id -> :class:`EnvSpec`; loads the ``agentenv.envs`` entry points on first read."""

    def __init__(self) -> None:
        self._specs: dict[str, EnvSpec] = {}
        self._plugins_loaded = False
        self._lock = threading.RLock()

    def _load_plugins(self) -> None:
        with self._lock:
            if self._plugins_loaded:
                return
            self._plugins_loaded = True
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    target = ep.load()
                except Exception as e:  # a broken plugin must not break every other environment
                    warnings.warn(
                        f"agentenv: could not load environment plugin {ep.name!r} ({ep.value}): {e}", stacklevel=3
                    )
                    continue
                if inspect.isclass(target) and issubclass(target, Env):
                    if ep.name not in self._specs:
                        register(ep.name, target)
                elif callable(target):
                    target()

    def add(self, spec: EnvSpec) -> None:
        self._specs[spec.id] = spec

    def __getitem__(self, env_id: str) -> EnvSpec:
        self._load_plugins()
        if env_id in self._specs:
            return self._specs[env_id]
        ns, name, version = parse_env_id(env_id)
        if version is None:
            versions = [
                s for s in self._specs.values() if s.namespace == ns and s.name == name and s.version is not None
            ]
            if versions:
                return max(versions, key=lambda s: s.version or 0)
        raise UnknownEnvError(self._unknown_message(env_id))

    def _unknown_message(self, env_id: str) -> str:
        close = difflib.get_close_matches(env_id, self._specs, n=5, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        return f"No environment registered as {env_id!r}.{hint} Registered: {', '.join(sorted(self._specs))}."

    def __iter__(self) -> Iterator[str]:
        self._load_plugins()
        return iter(self._specs)

    def __len__(self) -> int:
        self._load_plugins()
        return len(self._specs)


#: Every registered environment, id -> :class:`EnvSpec`.
registry = Registry()


def register(
    id: str,
    entry_point: str | Callable[..., Env],
    *,
    nondeterministic: bool = False,
    description: str = "",
    **defaults: Any,
) -> EnvSpec:
    """Register an environment under ``id`` with default constructor arguments.

    ``entry_point`` is an :class:`~agentenv.core.Env` subclass, a factory returning one, or a
    ``"module:attr"`` string (imported lazily). Re-registering an id replaces it.
    """
    parse_env_id(id)  # validates the id's grammar, raising a clear error
    env_spec = EnvSpec(id, entry_point, dict(defaults), nondeterministic, description)
    registry.add(env_spec)
    gymnasium.register(
        id=env_spec.gymnasium_id,
        entry_point=entry_point,
        kwargs=dict(defaults),
        nondeterministic=nondeterministic,
        disable_env_checker=True,  # agentenv.testing.check_env runs Gymnasium's checker and more
    )
    return env_spec


def spec(id: str) -> EnvSpec:
    """The :class:`EnvSpec` registered under ``id`` (raises :class:`UnknownEnvError`)."""
    return registry[id]


def make(id: str, **overrides: Any) -> Env:
    """Build a registered environment; ``overrides`` replace its default arguments."""
    return registry[id].make(**overrides)
