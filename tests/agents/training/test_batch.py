"""collate and PathBatch, on hand-written paths (tests/agents/rollout/test_tree.py collates a rollout tree's)."""

import dataclasses
import math

import pytest
import torch

from agents.rollout.tree import TrainingPath
from agents.training.batch import PathBatch, collate

NAN = math.nan


def path(ids, mask, sampler_logprobs, reward, *, advantages=None, turn_ids=None, weights=None) -> TrainingPath:
    n = len(ids)
    return TrainingPath(
        ids=ids,
        mask=mask,
        advantages=advantages or [0.0] * n,
        sampler_logprobs=sampler_logprobs,
        turn_ids=turn_ids or [0] * n,
        weights=weights or [0.0] * n,
        reward=reward,
        leaf=None,
    )


LONG = path(
    [5, 6, 7, 8, 9],
    [0, 1, 1, 0, 1],
    [NAN, -0.5, -1.25, NAN, -2.0],
    1.0,
    advantages=[0.0, 0.5, 0.5, 0.0, -1.5],
    turn_ids=[0, 1, 1, 2, 2],
    weights=[0.0, 0.5, 0.5, 0.0, 1.0],
)
SHORT = path([3, 4], [0, 1], [NAN, -0.75], -0.5, advantages=[0.0, 2.0], turn_ids=[0, 3], weights=[0.0, 1.0])


def test_collate_right_pads_every_field_to_the_longest_path_with_its_own_fill():
    batch = collate([SHORT, LONG], pad_id=0)
    assert batch.ids.tolist() == [[3, 4, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.mask.tolist() == [[0, 1, 0, 0, 0], [0, 1, 1, 0, 1]]
    assert batch.advantages.tolist() == [[0, 2.0, 0, 0, 0], [0, 0.5, 0.5, 0, -1.5]]
    assert batch.sampler_logprobs.tolist() == [[0, -0.75, 0, 0, 0], [0, -0.5, -1.25, 0, -2.0]]
    assert batch.turn_ids.tolist() == [[0, 3, -1, -1, -1], [0, 1, 1, 2, 2]]
    assert batch.weights.tolist() == [[0, 1.0, 0, 0, 0], [0, 0.5, 0.5, 0, 1.0]]
    assert batch.rewards.tolist() == [-0.5, 1.0]


def test_collate_gives_integer_ids_and_masks_and_float32_values():
    batch = collate([SHORT, LONG], pad_id=0)
    dtypes = {field.name: getattr(batch, field.name).dtype for field in dataclasses.fields(PathBatch)}
    assert dtypes == {
        "ids": torch.int64,
        "attention_mask": torch.int64,
        "mask": torch.float32,
        "advantages": torch.float32,
        "sampler_logprobs": torch.float32,
        "turn_ids": torch.int64,
        "weights": torch.float32,
        "rewards": torch.float32,
    }


def test_collate_zeroes_the_sampler_logprobs_off_the_mask_whatever_they_hold():
    # an engine may report log-probs for prompt tokens too: only action tokens keep theirs
    scored = path([1, 2, 3, 4], [0, 1, 0, 1], [-9.0, -0.5, -math.inf, -1.0], 0.0)
    batch = collate([scored], pad_id=7)
    assert batch.sampler_logprobs.tolist() == [[0.0, -0.5, 0.0, -1.0]]
    assert batch.ids.tolist() == [[1, 2, 3, 4]]  # one path: nothing to pad, and pad_id appears nowhere


def test_path_batch_to_moves_every_field_and_keeps_shapes_and_dtypes():
    batch = collate([SHORT, LONG], pad_id=0)
    moved = batch.to("meta")
    for field in dataclasses.fields(PathBatch):
        before, after = getattr(batch, field.name), getattr(moved, field.name)
        assert after.device.type == "meta", field.name
        assert (after.shape, after.dtype) == (before.shape, before.dtype), field.name
    assert batch.ids.device.type == "cpu"  # a new batch, the old one left where it was


# -1 and an empty batch: tests/agents/rollout/test_tree.py
@pytest.mark.parametrize("pad_id", [True, 1.0, "0", None])
def test_collate_refuses_a_pad_id_that_is_no_int_token_id(pad_id):
    with pytest.raises(ValueError, match=rf"^pad_id must be a non-negative token id, got {pad_id!r}$"):
        collate([SHORT], pad_id=pad_id)
