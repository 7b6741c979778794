import asyncio
import copy
import re

import pytest

import agentenv
from agentenv import Env, Text
from agentenv.core import run_sync
from agentenv.testing import EnvCheckError, check_env


def test_text_space_admits_any_string():
    space = Text(max_length=5)
    assert "é€ 漢" in space and "toolong" not in space and 5 not in space
    space.seed(0)
    assert all(isinstance(s, str) and 1 <= len(s) <= 5 for s in (space.sample() for _ in range(20)))


class AsyncOnly(Env):
    """An environment written with the async pair only."""

    async def areset(self, *, seed=None, options=None):
        self.reset_rng(seed)
        self.total = 0
        return "add numbers", {}

    async def astep(self, action):
        await asyncio.sleep(0)
        self.total += int(action) if action.isdigit() else 0
        return str(self.total), 0.0, self.total >= 10, False, {}

    def demo_actions(self):
        return ["3", "4", "5"]


def test_sync_pair_is_derived_from_the_async_pair():
    env = AsyncOnly()
    assert env.reset(seed=1) == ("add numbers", {})
    assert env.step("4")[0] == "4"
    assert env.step("7")[:3] == ("11", 0.0, True)
    check_env(env)


def test_an_env_must_implement_one_pair():
    class Nothing(Env):
        pass

    with pytest.raises(TypeError, match="Nothing must implement step\\(\\) or astep\\(\\)"):
        Nothing().step("x")
    with pytest.raises(TypeError, match="Nothing must implement step\\(\\) or astep\\(\\)"):
        asyncio.run(Nothing().astep("x"))


async def test_run_sync_refuses_inside_a_running_loop():
    async def coro():
        return 1

    with pytest.raises(RuntimeError, match=r"use the async form instead \(`await env.areset\(...\)`"):
        run_sync(coro())


def test_an_async_env_seeding_through_super_reset_is_told_what_to_call():
    class SeedsWrongly(AsyncOnly):
        async def areset(self, *, seed=None, options=None):
            super().reset(seed=seed)  # the sync pattern, which runs areset() again
            return "x", {}

    with pytest.raises(RuntimeError, match=r"seed the episode with self.reset_rng\(seed\), not super\(\).reset"):
        SeedsWrongly().reset(seed=0)


async def test_reset_inside_a_running_loop_names_areset():
    with pytest.raises(
        RuntimeError, match=r"AsyncOnly.reset\(\) was called inside a running event loop.*await env.areset"
    ):
        AsyncOnly().reset(seed=0)
    assert await AsyncOnly().areset(seed=0) == ("add numbers", {})


def test_tasks_is_the_fixed_task_list_or_none_when_resets_draw_their_own():
    assert AsyncOnly().tasks is None  # the contract's default: each reset draws its task from the seed
    qa = agentenv.make("multihop-qa")
    assert len(qa.tasks) == 500
    obs, _ = qa.reset(options={"index": 3})  # reset(options={"index": i}) poses tasks[i]
    assert qa.tasks[3].question in obs


def test_fork_strategy_is_checked_when_the_class_is_defined():
    with pytest.raises(
        TypeError, match=r"Magic.fork_strategy = 'magic' is not one of \('immutable',.*override fork\(\)"
    ):

        class Magic(AsyncOnly):
            fork_strategy = "magic"

    class Replayed(AsyncOnly):
        fork_strategy = "replay"

    assert Replayed.fork_strategy == "replay"


def test_fork_goes_through_gymnasium_wrappers():
    import gymnasium

    env = gymnasium.wrappers.TimeLimit(gymnasium.make("agentenv/multihop-qa"), max_episode_steps=3)
    with pytest.raises(AttributeError):
        env.fork()  # Gymnasium's wrappers do not pass fork on
    env.reset(seed=0, options={"index": 0})
    env.step("<search>Corliss Archer</search>")
    child = agentenv.fork(env)
    assert type(child) is type(env) and type(child.env) is type(env.env)  # the same wrappers
    assert child.unwrapped is not env.unwrapped and child._elapsed_steps == env._elapsed_steps == 1
    child.step("<search>Shirley Temple</search>")
    assert (child._elapsed_steps, env._elapsed_steps) == (2, 1)  # the wrapper's counter is the fork's own
    assert (child.unwrapped.state.turns, env.unwrapped.state.turns) == (2, 1)
    assert child.step("<answer>\\boxed{x}</answer>")[3] is True  # TimeLimit truncates at 3 steps
    assert agentenv.fork(env.unwrapped).unwrapped.state.turns == 1
    with pytest.raises(TypeError, match="CartPoleEnv is not an agentenv.Env"):
        agentenv.fork(gymnasium.make("CartPole-v1"))


def test_render_mode_is_validated():
    with pytest.raises(
        ValueError, match=r"render_mode='human' is not supported by QAEnv; choose one of \['ansi'\] or None"
    ):
        agentenv.make("multihop-qa", render_mode="human")
    env = agentenv.make("multihop-qa", render_mode="ansi")
    env.reset(options={"index": 0})
    env.step("<search>Kiss and Tell</search>")
    assert env.render().split("\n")[-1] == "</result>"


def test_fork_is_copy_on_write_and_independent():
    env = agentenv.make("multihop-qa", max_tool_calls=60, max_turns=60)
    env.reset(options={"index": 0})
    for i in range(50):
        env.step(f"<search>query {i}</search>")
    child = env.fork()
    # The history is shared, not copied: the fork costs the same at any episode length.
    assert child.state is env.state and child.state.last_turn is env.state.last_turn
    child.step("<search>only in the child</search>")
    assert env.state.turns == 50 and child.state.turns == 51
    assert child.state.last_turn.previous is env.state.last_turn
    assert "only in the child" not in env.transcript()
    assert env.step("<answer>\\boxed{Chief of Protocol}</answer>")[1:3] == (1.0, True)
    assert child.state.done is False
    late = env.fork()  # after the end
    assert late.state.done and late.state.reward == 1.0
    with pytest.raises(RuntimeError, match="the episode is over"):
        late.step("<search>x</search>")


def test_fork_forks_stateful_tools():
    class Notebook:
        """Remember notes within an episode."""

        def __init__(self):
            self.notes = []

        def __call__(self, note: str) -> str:
            """Write a note and read all notes back."""
            self.notes.append(note)
            return " | ".join(self.notes)

        def reset(self):
            self.notes = []

    env = agentenv.make("multihop-qa", tools=[Notebook()])
    env.reset(seed=0)
    assert env.step("<Notebook>before</Notebook>")[0] == "before"
    child = env.fork()
    assert child.step("<Notebook>child</Notebook>")[0] == "before | child"
    assert env.step("<Notebook>parent</Notebook>")[0] == "before | parent"
    env.reset(seed=0)
    assert env.step("<Notebook>fresh</Notebook>")[0] == "fresh"
    check_env(env)


class SharedStateFork(Env):
    """A broken environment: its fork shares a mutable list with the parent."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.log = []
        return "start", {}

    def step(self, action):
        self.log.append(action)
        return " ".join(self.log), 0.0, len(self.log) >= 3, False, {}

    def fork(self):
        child = copy.copy(self)  # the bug: self.log is shared
        return child

    def demo_actions(self):
        return ["a", "b", "c"]


def test_check_env_catches_a_fork_that_shares_state():
    with pytest.raises(EnvCheckError, match="SharedStateFork: stepping a fork must not change its parent"):
        check_env(SharedStateFork())


class ForkReturnsSelf(SharedStateFork):
    def fork(self):
        return self


def test_check_env_catches_fork_returning_self():
    with pytest.raises(EnvCheckError, match="fork\\(\\) must return a new object"):
        check_env(ForkReturnsSelf())


def test_check_env_needs_a_first_action_that_does_not_end_the_episode():
    with pytest.raises(EnvCheckError, match="the first check action must not end the episode"):
        check_env(agentenv.make("multihop-qa"), actions=["<answer>\\boxed{x}</answer>", "<search>y</search>"])


def closed_message(env: Env) -> str:
    return (
        f"this {type(env).__name__} was closed: create a new environment with agentenv.make(...), "
        "or fork() it before closing"
    )


def assert_closed_refuses_everything(env: Env, action: str, *, own_astep: bool = True) -> None:
    message = f"^{re.escape(closed_message(env))}$"
    assert env.closed
    calls = [lambda: env.step(action), lambda: env.reset(seed=0), lambda: asyncio.run(env.areset(seed=0)), env.fork]
    if own_astep:
        calls.append(lambda: asyncio.run(env.astep(action)))
    for call in calls:
        with pytest.raises(RuntimeError, match=message):
            call()
    env.close()  # closing twice is allowed


def test_a_closed_qa_env_refuses_step_reset_and_fork():
    env = agentenv.make("multihop-qa")
    env.reset(options={"index": 0})
    env.step("<search>Kiss and Tell</search>")
    child = env.fork()
    assert not env.closed
    env.close()
    assert_closed_refuses_everything(env, "<search>Kiss and Tell</search>")
    assert env.state.turns == 1  # nothing ran
    # A fork made before closing lives on, and closing it does not touch the parent's copy.
    assert child.step("<answer>\\boxed{Chief of Protocol}</answer>")[1:3] == (1.0, True)


def test_a_closed_python_math_env_starts_no_new_sandbox():
    env = agentenv.make("python-math")
    env.reset(seed=0)
    assert env.step("<python>6 * 7</python>")[0] == "42"
    session = env.tools["python"].fn
    env.close()
    assert session.sandbox is None
    assert_closed_refuses_everything(env, "<python>6 * 7</python>")
    assert session.sandbox is None  # neither step nor reset started one


def test_a_closed_custom_env_refuses_through_the_base_class():
    env = AsyncOnly()
    env.reset(seed=0)
    env.close()
    # Its own astep() does not call check_open(), so only what goes through the base class is checked.
    assert_closed_refuses_everything(env, "3", own_astep=False)
