"""Rollout trees: the turns of one prompt's episodes, branching where a strategy forked the env.

A :class:`RolloutTree` holds every trajectory sampled for one prompt. The **root** is the
prompt; every other :class:`Node` is one **turn**: the observation tokens the environment
returned after the previous turn (``obs_ids``, masked out of the loss; empty for a first turn)
followed by the **action tokens** the policy sampled (``action_ids``, with the sampler's
``sampler_logprobs``). A node stores only its own segment, so a prefix shared by many branches is stored
once; :meth:`Node.context_ids` and :meth:`RolloutTree.paths` concatenate segments on demand.

A **leaf** is a turn that ended its episode (final answer, length or tool-call limit, tool
failure). Mark it with ``add_turn(..., terminal=True, reward=r)`` or later with
``node.finish(reward)``; a leaf never gets children. A childless turn that is not marked is an
episode still running (or abandoned): it is not a leaf, and credit assignment refuses a tree
that still has one (:meth:`RolloutTree.prune` drops abandoned branches).

Building a tree is synchronous and cheap (no awaits inside), so the coroutines of one event
loop can grow the same tree concurrently: each :meth:`RolloutTree.add_turn` is atomic with
respect to the others.

Example, by hand, without an engine::

    tree = RolloutTree(prompt_ids=[1, 2, 3])
    a = tree.add_turn(tree.root, action_ids=[7, 8], sampler_logprobs=[-0.1, -0.5])
    a1 = tree.add_turn(a, obs_ids=[4], action_ids=[9], sampler_logprobs=[-0.3], terminal=True, reward=1.0)
    a2 = tree.add_turn(a, obs_ids=[4], action_ids=[5], sampler_logprobs=[-0.2])
    a2.finish(reward=0.0)
    paths = tree.paths(advantage="leaf")   # after credit assignment filled the advantages
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Node", "RolloutTree", "TrainingPath"]

#: Written into every saved tree; :meth:`RolloutTree.from_dict` reads it and :data:`_FORMAT_1`, and refuses others.
FORMAT = "agents.RolloutTree/2"
# Trees saved before the sampler's log-probs kept one name from the engine to the loss held them as "logprobs".
_FORMAT_1 = "agents.RolloutTree/1"

# Sampled log-probs come from a log-softmax and are <= 0; engines that round may report a tiny
# positive value. Larger positive values mean probabilities were passed instead of log-probs.
_LOGPROB_ROUNDING = 1e-3


@dataclass(eq=False, repr=False)
class Node:
    """One turn of a rollout tree (or the root, which is the prompt).

    Attributes:
        id: unique within its tree, assigned in creation order (root = 0); stable across save/load.
        parent: the previous turn, or ``None`` for the root.
        obs_ids: observation tokens that preceded this turn's action (the prompt, for the root).
        action_ids: tokens the policy sampled in this turn (empty only for the root).
        sampler_logprobs: the sampler's log-probability of each action token.
        token_entropies: optional entropy of the full next-token distribution per action token.
        env: opaque handle to the environment state this turn started from (the fork that
            produced ``obs_ids``); any object, typically an ``agentenv.Env``. Never saved.
        terminal: whether this turn ended its episode (a leaf).
        reward: the episode's reward, on leaves.
        value: V(n), filled by credit assignment.
        advantage: A(n), filled by credit assignment.
        info: free JSON-serialisable metadata (tool names, finish reason, ...).
        version: the version of the weights that sampled this turn's action (its tokens'
            version: a rollout worker's count of weight syncs, 0 for the weights it started
            with); ``None`` when the engine does not say (the root, an engine in the driver). When
            the weights changed while the action was sampled (``cluster.in_flight_updates``), the
            oldest token's, and ``token_versions`` gives each token's.
        token_versions: the version of each action token where they differ within the turn;
            ``None`` when every token has ``version``.
        children: the next turns, one per branch, in creation order.
    """

    id: int
    parent: Node | None
    obs_ids: list[int]
    action_ids: list[int]
    sampler_logprobs: list[float]
    token_entropies: list[float] | None = None
    env: Any = None
    terminal: bool = False
    reward: float | None = None
    value: float | None = None
    advantage: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    version: int | None = None
    token_versions: list[int] | None = None
    children: list[Node] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        """Whether this node is the prompt."""
        return self.parent is None

    @property
    def depth(self) -> int:
        """Number of turns from the prompt to this node: 0 for the root, 1 for a first turn."""
        depth, node = 0, self
        while node.parent is not None:
            depth, node = depth + 1, node.parent
        return depth

    @property
    def siblings(self) -> list[Node]:
        """The other children of this node's parent (other samples of the same turn)."""
        if self.parent is None:
            return []
        return [child for child in self.parent.children if child is not self]

    @property
    def entropy(self) -> float:
        """H(n) = -(1/|a_n|) Σ log π(a_t): mean negative sampler log-prob of the action tokens.

        docs/algorithms/index.md eq. 1 ("Node entropy").
        """
        if not self.action_ids:
            raise ValueError("the root is the prompt and has no sampled action, so no entropy")
        return -math.fsum(self.sampler_logprobs) / len(self.sampler_logprobs)  # docs/algorithms/index.md eq. 1

    def lineage(self) -> list[Node]:
        """The nodes from the root down to this one, both included."""
        nodes = [self]
        while nodes[-1].parent is not None:
            nodes.append(nodes[-1].parent)
        return nodes[::-1]

    def context_ids(self) -> list[int]:
        """All tokens up to the end of this turn: prompt, then each turn's observation and action.

        To resample this turn instead (a sibling), the context is
        ``node.parent.context_ids() + node.obs_ids``.
        """
        ids: list[int] = []
        for node in self.lineage():
            ids += node.obs_ids
            ids += node.action_ids
        return ids

    def finish(self, reward: float) -> None:
        """Mark this turn as the end of its episode with the episode's reward."""
        if self.parent is None:
            raise ValueError("the root is the prompt; only a turn can end an episode")
        if self.children:
            raise ValueError(f"node {self.id} already has children, so it cannot end its episode")
        self.terminal = True
        self.reward = _finite("reward", reward)

    def __repr__(self) -> str:
        parent = None if self.parent is None else self.parent.id
        return (
            f"Node(id={self.id}, parent={parent}, depth={self.depth}, obs={len(self.obs_ids)}, "
            f"action={len(self.action_ids)}, children={len(self.children)}, "
            f"terminal={self.terminal}, reward={self.reward}, value={self.value}, "
            f"advantage={self.advantage})"
        )


@dataclass(eq=False)
class TrainingPath:
    """One root-to-leaf trajectory as a training sequence; every list is aligned with ``ids``.

    Attributes:
        ids: prompt, then each turn's observation and action tokens.
        mask: 1 on action tokens, 0 on prompt and observation tokens.
        advantages: the advantage of the token's turn on action tokens, 0 elsewhere.
        sampler_logprobs: the sampler's log-prob on action tokens, NaN elsewhere (π_old's own
            under ``TrainerConfig.old_logprobs="sampler"``, else recomputed by the trainer).
        turn_ids: id of the node each token belongs to (the prompt belongs to the root, id 0).
        weights: on action tokens, 1 / (number of leaves whose path contains the token's turn),
            0 elsewhere. A turn shared by k leaves appears in k paths; multiplying the
            advantages by these weights trains it once in total instead of k times
            (docs/algorithms/credit.md eq. 35).
        reward: the leaf's reward.
        leaf: the leaf node.
    """

    ids: list[int]
    mask: list[int]
    advantages: list[float]
    sampler_logprobs: list[float]
    turn_ids: list[int]
    weights: list[float]
    reward: float
    leaf: Node


class RolloutTree:
    """All turns sampled for one prompt, as a tree whose root is the prompt.

    Args:
        prompt_ids: the prompt's token ids (chat template applied).
        env: optional environment state after ``reset`` (the root's ``env``).
    """

    def __init__(self, prompt_ids: Sequence[int], env: Any = None) -> None:
        self.root = Node(
            id=0, parent=None, obs_ids=_token_ids("prompt_ids", prompt_ids), action_ids=[], sampler_logprobs=[], env=env
        )
        self._nodes: dict[int, Node] = {0: self.root}
        self._next_id = 1

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (the root's segment)."""
        return self.root.obs_ids

    def __len__(self) -> int:
        """Number of turns (the root is not a turn)."""
        return len(self._nodes) - 1

    def node(self, node_id: int) -> Node:
        """The node with this id."""
        try:
            return self._nodes[node_id]
        except KeyError:
            raise KeyError(f"no node with id {node_id} in this tree (pruned, or from another tree)") from None

    def add_turn(
        self,
        parent: Node,
        *,
        action_ids: Sequence[int],
        sampler_logprobs: Sequence[float],
        obs_ids: Sequence[int] = (),
        env: Any = None,
        token_entropies: Sequence[float] | None = None,
        terminal: bool = False,
        reward: float | None = None,
        info: dict[str, Any] | None = None,
        version: int | None = None,
        token_versions: Sequence[int] | None = None,
    ) -> Node:
        """Append a turn under ``parent`` and return it.

        Args:
            parent: the previous turn, or ``tree.root`` for a first turn. Siblings (several
                children of one parent) are branches.
            action_ids: the sampled action tokens (at least one).
            sampler_logprobs: the sampler's log-prob of each action token.
            obs_ids: the observation tokens the environment returned after ``parent``'s action
                (empty for a first turn: the prompt is the root).
            env: the environment state this turn starts from (kept by reference, never saved).
            token_entropies: optional full-distribution entropy per action token.
            terminal: whether this turn ended the episode (then ``reward`` is required).
            reward: the episode's reward, for a terminal turn.
            info: free JSON-serialisable metadata.
            version: the version of the weights that sampled the action (see :attr:`Node.version`).
            token_versions: each action token's version, where they differ (see
                :attr:`Node.token_versions`); ``version`` is then the oldest of them.
        """
        if self._nodes.get(parent.id) is not parent:
            raise ValueError(f"parent node {parent.id} is not in this tree (pruned, or from another tree)")
        node = _new_node(
            self._next_id, parent, obs_ids, action_ids, sampler_logprobs, token_entropies, env, terminal, reward, info
        )
        _set_versions(node, version, token_versions)
        self._link(node)
        return node

    def _link(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and node.id not in self._nodes
        if parent.terminal:
            raise ValueError(f"node {parent.id} ended its episode (terminal); it cannot have a next turn")
        parent.children.append(node)
        self._nodes[node.id] = node
        self._next_id = max(self._next_id, node.id + 1)

    def nodes(self) -> list[Node]:
        """Every turn (not the root), depth-first, children in creation order."""
        order: list[Node] = []
        stack = list(reversed(self.root.children))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(node.children))
        return order

    def leaves(self) -> list[Node]:
        """The turns that ended an episode (``terminal``), depth-first."""
        return [node for node in self.nodes() if node.terminal]

    def prune(self, keep: Iterable[Node]) -> None:
        """Keep only the given leaves and the turns on their paths; drop every other turn.

        Used by strategies that keep a subset of leaves (Tree-GRPO keeps K per tree) and to drop
        abandoned branches before credit assignment.
        """
        kept: set[int] = {0}
        for leaf in keep:
            if self._nodes.get(leaf.id) is not leaf or not leaf.terminal:
                raise ValueError(f"node {leaf.id} is not a leaf of this tree; prune keeps leaves only")
            kept.update(node.id for node in leaf.lineage())
        for node in [self.root, *self.nodes()]:
            node.children = [child for child in node.children if child.id in kept]
        self._nodes = {node_id: node for node_id, node in self._nodes.items() if node_id in kept}

    def paths(self, advantage: Literal["turn", "leaf"] = "turn") -> list[TrainingPath]:
        """One training sequence per leaf (depth-first order); shared turns appear in each.

        Args:
            advantage: where each action token's advantage comes from. ``"turn"``: the token's
                own turn (``node.advantage``), for turn-wise credit such as ``turnwise_credit``.
                ``"leaf"``: the leaf's advantage broadcast over the whole path, for
                trajectory-level credit such as ``grpo_credit`` and ``tree_grpo_credit``.
        """
        if advantage not in ("turn", "leaf"):
            raise ValueError(f"advantage must be 'turn' or 'leaf', got {advantage!r}")
        leaves_below = self._leaves_below()
        paths = []
        for leaf in self.leaves():
            if leaf.reward is None:
                raise ValueError(f"leaf {leaf.id} has no reward; set it with node.finish(reward)")
            ids, mask, advantages = list(self.prompt_ids), [0] * len(self.prompt_ids), [0.0] * len(self.prompt_ids)
            sampler_logprobs, weights = [math.nan] * len(ids), [0.0] * len(ids)
            turn_ids = [0] * len(ids)
            for node in leaf.lineage()[1:]:
                source = node if advantage == "turn" else leaf
                if source.advantage is None:
                    raise ValueError(
                        f"node {source.id} has no advantage: run credit assignment first"
                        + (
                            " (trajectory-level credit such as GRPO fills only the leaves: use paths(advantage='leaf'))"
                            if advantage == "turn"
                            else ""
                        )
                    )
                value = source.advantage
                n_obs, n_act = len(node.obs_ids), len(node.action_ids)
                ids += node.obs_ids + node.action_ids
                mask += [0] * n_obs + [1] * n_act
                advantages += [0.0] * n_obs + [float(value)] * n_act
                sampler_logprobs += [math.nan] * n_obs + node.sampler_logprobs
                weights += [0.0] * n_obs + [1.0 / leaves_below[node.id]] * n_act  # docs/algorithms/credit.md eq. 35
                turn_ids += [node.id] * (n_obs + n_act)
            paths.append(
                TrainingPath(ids, mask, advantages, sampler_logprobs, turn_ids, weights, float(leaf.reward), leaf)
            )
        return paths

    def _leaves_below(self) -> dict[int, int]:
        """Number of leaves in each node's subtree (a leaf counts itself)."""
        counts = {node.id: int(node.terminal) for node in self._nodes.values()}
        for node in reversed(self.nodes()):  # children come after their parent in depth-first order
            assert node.parent is not None  # nodes() lists turns only, never the root
            counts[node.parent.id] += counts[node.id]
        return counts

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole tree, every node but its ``env``."""
        nodes = [self.root, *self.nodes()]
        return {
            "format": FORMAT,
            "nodes": [
                {
                    "id": node.id,
                    "parent": None if node.parent is None else node.parent.id,
                    "obs_ids": node.obs_ids,
                    "action_ids": node.action_ids,
                    "sampler_logprobs": node.sampler_logprobs,
                    "token_entropies": node.token_entropies,
                    "terminal": node.terminal,
                    "reward": node.reward,
                    "value": node.value,
                    "advantage": node.advantage,
                    "info": node.info,
                    "version": node.version,
                    "token_versions": node.token_versions,
                }
                for node in sorted(nodes, key=lambda node: node.id)
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        """Rebuild a tree from :meth:`to_dict` output (of this version or an earlier one); node ids are kept,
        ``env`` is ``None``."""
        if not isinstance(data, dict) or data.get("format") not in (FORMAT, _FORMAT_1):
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a saved rollout tree: expected format {FORMAT!r}, found {found!r}")
        try:
            records = data["nodes"]
            if data["format"] == _FORMAT_1:
                rename = {"logprobs": "sampler_logprobs"}
                records = [{rename.get(key, key): value for key, value in record.items()} for record in records]
            return cls._from_records(sorted(records, key=lambda record: record["id"]))
        except KeyError as error:
            raise ValueError(f"a saved rollout tree lacks the field {error}") from None

    @classmethod
    def _from_records(cls, records: list[dict[str, Any]]) -> RolloutTree:
        if not records or records[0]["parent"] is not None or records[0]["id"] != 0:
            raise ValueError("a saved rollout tree must start with the root (id 0, no parent)")
        root = records[0]
        tree = cls(root["obs_ids"])
        tree.root.value, tree.root.advantage, tree.root.info = root["value"], root["advantage"], dict(root["info"])
        for record in records[1:]:
            parent = tree._nodes.get(record["parent"])
            if parent is None:
                raise ValueError(f"node {record['id']} names parent {record['parent']}, which is not an earlier node")
            if record["id"] in tree._nodes:
                raise ValueError(f"node id {record['id']} appears twice")
            node = _new_node(
                record["id"],
                parent,
                record["obs_ids"],
                record["action_ids"],
                record["sampler_logprobs"],
                record["token_entropies"],
                None,
                record["terminal"],
                record["reward"],
                record["info"],
            )
            node.value, node.advantage = record["value"], record["advantage"]
            # trees saved before versions were recorded have none
            _set_versions(node, record.get("version"), record.get("token_versions"))
            tree._link(node)
        return tree

    def save(self, path: str | Path) -> None:
        """Write the tree as JSON (everything but the nodes' ``env``)."""
        try:
            text = json.dumps(self.to_dict())
        except TypeError as error:
            raise ValueError(
                f"a node's info holds a value JSON cannot store ({error}); "
                "keep info to str, numbers, bool, None, lists and dicts"
            ) from None
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> RolloutTree:
        """Read a tree written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def render(self, decode: Callable[[list[int]], str] | None = None, width: int = 40) -> str:
        """A text drawing of the tree for debugging.

        One line per node: id, depth, observation and action token counts, H(n), and reward,
        value and advantage where set; leaves are marked ``leaf``. With ``decode`` (a
        tokenizer's decode), the start of each action's text follows, cut to ``width`` characters.
        """
        lines = [
            f"root: prompt {len(self.prompt_ids)} tok, {len(self)} turns, {len(self.leaves())} leaves"
            + _numbers(self.root)
        ]
        stack = [
            (child, "", index == len(self.root.children) - 1)
            for index, child in reversed(list(enumerate(self.root.children)))
        ]
        while stack:
            node, indent, last = stack.pop()
            line = (
                f"{indent}{'└─ ' if last else '├─ '}#{node.id} d{node.depth} "
                f"obs {len(node.obs_ids)} act {len(node.action_ids)} H={node.entropy:.3f}{_numbers(node)}"
            )
            if node.terminal:
                line += " leaf"
            if decode is not None:
                line += f" {decode(node.action_ids)[:width]!r}"
            lines.append(line)
            child_indent = indent + ("   " if last else "│  ")
            stack.extend(
                (child, child_indent, index == len(node.children) - 1)
                for index, child in reversed(list(enumerate(node.children)))
            )
        return "\n".join(lines)


def _new_node(
    node_id: int,
    parent: Node,
    obs_ids: Sequence[int],
    action_ids: Sequence[int],
    sampler_logprobs: Sequence[float],
    token_entropies: Sequence[float] | None,
    env: Any,
    terminal: bool,
    reward: float | None,
    info: dict[str, Any] | None,
) -> Node:
    """A validated turn (not yet linked into its tree)."""
    action = _token_ids("action_ids", action_ids)
    if not action:
        raise ValueError("a turn needs at least one sampled action token (action_ids is empty)")
    node = Node(
        id=node_id,
        parent=parent,
        obs_ids=_token_ids("obs_ids", obs_ids),
        action_ids=action,
        sampler_logprobs=_logprobs(sampler_logprobs, len(action)),
        token_entropies=None if token_entropies is None else _floats("token_entropies", token_entropies, len(action)),
        env=env,
        info=dict(info or {}),
    )
    if terminal:
        if reward is None:
            raise ValueError("a terminal turn needs its episode's reward (pass reward=...)")
        node.finish(reward)
    elif reward is not None:
        raise ValueError("reward given for a turn that is not terminal; pass terminal=True with it")
    return node


def _version(value: Any, name: str = "version") -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


def _set_versions(node: Node, version: Any, token_versions: Sequence[int] | None) -> None:
    node.version = _version(version)
    if token_versions is None:
        return
    versions = [_version(v, f"token_versions[{i}]") for i, v in enumerate(token_versions)]
    if len(versions) != len(node.action_ids) or None in versions:
        raise ValueError(
            f"token_versions must give one version (an int) per action token: {len(node.action_ids)} tokens, "
            f"got {token_versions!r}"
        )
    oldest = min(versions)  # type: ignore[type-var]  # no None left
    if node.version is not None and node.version != oldest:
        raise ValueError(f"version {node.version} is not the oldest of token_versions ({oldest}); give the oldest")
    node.version, node.token_versions = oldest, versions  # type: ignore[assignment]


def _token_ids(name: str, values: Sequence[int]) -> list[int]:
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    # Plain ints (what engines return) are checked in C: the per-value loop costs about 1 µs a token,
    # which at a rollout worker's thousands of tokens a turn was most of its CPU per turn.
    if set(map(type, values)) <= {int} and (not values or min(values) >= 0):
        return values
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}[{index}] = {value!r} is not a token id (a non-negative int)")
    return [int(value) for value in values]


def _floats(name: str, values: Sequence[float], length: int) -> list[float]:
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != length:
        raise ValueError(f"{name} has {len(values)} values but the action has {length} tokens; give one per token")
    if set(map(type, values)) <= {float} and all(map(math.isfinite, values)):  # the fast path, as for token ids
        return values
    return [_finite(f"{name}[{index}]", value) for index, value in enumerate(values)]


def _logprobs(values: Sequence[float], length: int) -> list[float]:
    logprobs = _floats("sampler_logprobs", values, length)
    if not logprobs or max(logprobs) <= 0.0:
        return logprobs
    for index, value in enumerate(logprobs):
        if value > _LOGPROB_ROUNDING:
            raise ValueError(
                f"sampler_logprobs[{index}] = {value} is positive: give log-probabilities (<= 0), not probabilities"
            )
    return [min(value, 0.0) for value in logprobs]


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _numbers(node: Node) -> str:
    parts = [
        f" {label}={value:.3f}"
        for label, value in (("r", node.reward), ("V", node.value), ("A", node.advantage))
        if value is not None
    ]
    return "".join(parts)
