"""agents.training.sharding: which passes each trainer rank runs, and what two real gloo ranks share."""

import json

import pytest

from agents.training.sharding import place_in_group, rank_passes


def test_each_rank_runs_every_nth_item_then_fillers_to_the_same_count():
    items = ["a", "b", "c", "d", "e"]
    assert rank_passes(items, "-", rank=0, world_size=2) == [("a", True), ("c", True), ("e", True)]
    assert rank_passes(items, "-", rank=1, world_size=2) == [("b", True), ("d", True), ("-", False)]
    # More ranks than items: the idle ranks still run one (empty) pass, so that the collectives pair up.
    assert rank_passes(["a"], "-", rank=2, world_size=3) == [("-", False)]
    assert rank_passes([], "-", rank=0, world_size=2) == []
    assert rank_passes(items, "-", rank=0, world_size=1) == [(item, True) for item in items]


def test_a_single_process_is_rank_0_of_1_and_a_missing_group_is_named():
    assert place_in_group(False) == (0, 1)
    with pytest.raises(ValueError, match="call torch.distributed.init_process_group first"):
        place_in_group(True)


# Each rank a fresh interpreter, as TrainerGroup's ranks are; it prints what it saw as JSON.
RANK = """
import json, sys, torch, torch.distributed as dist
from agents.models import tiny_llama
from agents.training.sharding import gathered_state_dict, place_in_group, shard, sum_over_ranks
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
model, reference = tiny_llama(seed=rank), tiny_llama(seed=0)  # rank 1's own weights differ from rank 0's
ids = torch.tensor([[3, 7, 1, 9, 4]])
with torch.no_grad():
    expected = reference(input_ids=ids).logits
    logits = shard([model], torch.device("cpu"), torch.float32)[id(model)](lambda m, x: m(input_ids=x).logits, ids)
state, full = gathered_state_dict(model), reference.state_dict()
print(json.dumps({
    "place": place_in_group(True),
    "sum": sum_over_ranks({"tokens": 10.0 * (rank + 1), f"only_{rank}": 1.0}),
    "logits_diff": (logits - expected).abs().max().item(),
    "state_keys": sorted(state),
    "state_equal": all(torch.equal(value, full[name]) for name, value in state.items()),
    "full_keys": sorted(full),
}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_gloo_ranks_share_rank_0s_weights_sum_in_rank_order_and_gather_the_full_state(gloo_ranks):
    results = [json.loads(out.splitlines()[-1]) for out in gloo_ranks(RANK)]
    assert [r["place"] for r in results] == [[0, 2], [1, 2]]
    for r in results:
        assert r["sum"] == {"tokens": 30.0, "only_0": 1.0, "only_1": 1.0}
        assert r["logits_diff"] == 0.0  # rank 1 computes with rank 0's weights, not its own
    assert results[1]["state_keys"] == []  # the full state comes to rank 0 alone
    assert results[0]["state_equal"] is True and results[0]["state_keys"]
    # Tied embeddings: the output layer's weight is the embedding's, one entry under one of the two names.
    assert set(results[0]["full_keys"]) - set(results[0]["state_keys"]) <= {"lm_head.weight"}
