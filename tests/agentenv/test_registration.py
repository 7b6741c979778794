import sys
import textwrap

import gymnasium
import pytest

import agentenv
from agentenv import Env, UnknownEnvError
from agentenv.registration import registry
from agentenv.testing import check_env


class Countdown(Env):
    """A tiny user environment: say numbers counting down from `start`; reward 1 for reaching 0."""

    def __init__(self, start: int = 3, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.start = start
        self.n = start

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = self.start
        return f"Count down from {self.n}.", {"n": self.n}

    def step(self, action):
        if self.n <= 0:
            raise RuntimeError("the episode is over")
        if action.strip() == str(self.n - 1):
            self.n -= 1
            obs = "ok"
        else:
            obs = f"expected {self.n - 1}"
        done = self.n == 0
        return obs, float(done), done, False, {"n": self.n}

    def demo_actions(self):
        return [str(i) for i in range(self.start - 1, -1, -1)]


@pytest.fixture
def clean_registry():
    before = dict(registry._specs)
    yield
    registry._specs.clear()
    registry._specs.update(before)


def test_register_make_and_check_a_custom_environment(clean_registry):
    agentenv.register("countdown", Countdown, start=3, description="count down")
    env = agentenv.make("countdown")
    assert isinstance(env, Countdown) and env.start == 3
    assert agentenv.make("countdown", start=5).start == 5
    assert env.spec.id == "agentenv/countdown" and env.spec.kwargs == {"start": 3}
    assert Countdown.fork_strategy == "deepcopy"
    check_env(env)
    assert gymnasium.make("agentenv/countdown").unwrapped.start == 3
    with pytest.raises(TypeError, match=r"make\('countdown'\): got an unexpected keyword argument 'stop'"):
        agentenv.make("countdown", stop=1)


def test_versions_and_namespaces(clean_registry):
    agentenv.register("myorg/countdown-v0", Countdown, start=2)
    agentenv.register("myorg/countdown-v1", Countdown, start=4)
    assert agentenv.make("myorg/countdown").start == 4  # the highest version
    assert agentenv.make("myorg/countdown-v0").start == 2
    spec = agentenv.spec("myorg/countdown-v1")
    assert (spec.namespace, spec.name, spec.version, spec.gymnasium_id) == (
        "myorg",
        "countdown",
        1,
        "agentenv/myorg.countdown-v1",
    )
    assert gymnasium.make("agentenv/myorg.countdown-v1").unwrapped.start == 4
    with pytest.raises(
        UnknownEnvError,
        match=r"No environment registered as 'myorg/countdown-v7'\. Did you mean: myorg/countdown-v1, myorg/countdown-v0\?",
    ):
        agentenv.make("myorg/countdown-v7")


def test_unknown_ids_list_close_matches():
    with pytest.raises(UnknownEnvError) as e:
        agentenv.make("multihop_qa")
    assert str(e.value).startswith("No environment registered as 'multihop_qa'. Did you mean: multihop-qa")
    assert "Registered: multihop-qa, multihop-qa:2wiki" in str(e.value)


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch, clean_registry):
    pkg = tmp_path / "countdown_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent('''
        import agentenv
        from agentenv import Env

        class Echo(Env):
            """Echo the action back."""
            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return "say something", {}
            def step(self, action):
                return action, 0.0, True, False, {}

        def register_all():
            agentenv.register("plugin/echo-loud", Echo)
    ''')
    )
    dist = tmp_path / "countdown_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: countdown-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[agentenv.envs]\nplugin/echo = countdown_plugin:Echo\nregister = countdown_plugin:register_all\n"
        "broken = countdown_plugin:missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    with pytest.warns(UserWarning, match=r"could not load environment plugin 'broken'"):
        ids = set(registry)
    assert {"plugin/echo", "plugin/echo-loud"} <= ids
    assert agentenv.make("plugin/echo").step("hi")[0] == "hi"
    sys.modules.pop("countdown_plugin", None)


def test_malformed_id():
    with pytest.raises(gymnasium.error.Error, match="Malformed environment ID"):
        agentenv.register("bad id!", Countdown)


def test_command_line_lists_and_checks(capsys):
    from agentenv.__main__ import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("multihop-qa ") and "singlehop-qa:popqa" in out
    assert main(["check", "multihop-qa:2wiki", "multihop_qa"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok   multihop-qa:2wiki"
    assert out[1].startswith("FAIL multihop_qa: No environment registered as 'multihop_qa'. Did you mean: multihop-qa")


def test_an_entry_point_string_names_the_object_in_its_module():
    from agentenv.registration import load_entry_point

    assert load_entry_point("agentenv.envs.qa:QAEnv").__name__ == "QAEnv"
    with pytest.raises(AttributeError):
        load_entry_point("agentenv.envs.qa:NoSuchEnv")
    with pytest.raises(ModuleNotFoundError):
        load_entry_point("agentenv.no_such_module:Env")
