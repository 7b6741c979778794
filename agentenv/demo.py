"""A walk-through of one ``multihop-qa`` episode, driven by a scripted oracle policy.

    python -m agentenv.demo [--index I]

The oracle searches the question, then answers the gold answer; a fork made after the search
answers wrongly instead. Both transcripts and rewards are printed: the fork branched the episode
without disturbing it.
"""

from __future__ import annotations

import argparse
import textwrap

import agentenv


def _show(title: str, text: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 72 - len(title)))
    print(textwrap.indent(text, "  "))


def main() -> None:
    parser = argparse.ArgumentParser(description="Walk through one multihop-qa episode with a scripted oracle.")
    parser.add_argument("--index", type=int, default=0, help="which HotpotQA question to pose (default 0)")
    args = parser.parse_args()

    env = agentenv.make("multihop-qa", render_mode="ansi")
    prompt, info = env.reset(options={"index": args.index})
    _show("prompt (the first observation)", prompt)

    action = f"<think>I should look this up.</think>\n<search>{info['question']}</search>"
    obs, reward, terminated, truncated, info = env.step(action)
    _show("turn 1: the oracle searches the question", action)
    _show("observation: top-3 passages", obs)

    branch = env.fork()  # same state, independent from here on

    gold = info["answers"][0]
    _, reward, terminated, _, info = env.step(f"<answer> \\boxed{{{gold}}} </answer>")
    _, branch_reward, _, _, branch_info = branch.step("<answer> \\boxed{I do not know} </answer>")

    _show("main line: full transcript", env.render() or "")
    _show("fork after turn 1: answers wrongly", branch.render() or "")
    print("\n=== rewards " + "=" * 61)
    print(f"  {'line':<28}{'answer':<28}{'EM':>6}{'reward':>8}")
    for name, grade in (("main (gold answer)", info["grade"]), ("fork (wrong answer)", branch_info["grade"])):
        print(f"  {name:<28}{str(grade['answer']):<28}{grade['em']:>6.1f}{grade['reward']:>8.1f}")
    if not (terminated and reward == 1.0 and branch_reward == 0.0):
        raise SystemExit(f"demo check failed: rewards {reward} (main) and {branch_reward} (fork), expected 1.0 and 0.0")


if __name__ == "__main__":
    main()
