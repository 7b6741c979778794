"""agents.run.cluster.weight_sync without Ray: how the weights are cut into buckets, their digest, and who
takes buckets rather than state dicts."""

import torch

from agents.engines import HFEngine, ScriptedEngine
from agents.models import tiny_llama
from agents.run.cluster.rollout_workers import RolloutPool
from agents.run.cluster.weight_sync import BucketReceiver, buckets, weights_digest


def test_buckets_hold_about_bucket_bytes_in_order_a_larger_tensor_alone_and_tied_ones_once():
    weight = torch.zeros(4, 4)  # 64 bytes
    state = {"a": torch.zeros(4), "b": torch.zeros(4), "big": torch.zeros(40), "tied": weight, "c": torch.zeros(2)}
    state["tied_again"] = weight  # a tied output layer: the same storage and shape
    cut = list(buckets(state, bucket_bytes=32))
    assert [list(bucket) for bucket in cut] == [["a", "b"], ["big"], ["tied"], ["c"]]
    assert all(t.is_contiguous() and t.device.type == "cpu" for bucket in cut for t in bucket.values())
    model = tiny_llama(0)  # tied embeddings, as SmolLM2's
    names = [name for bucket in buckets(model.state_dict(), 1 << 20) for name in bucket]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_the_digest_follows_names_dtypes_shapes_and_bytes_and_can_be_restricted():
    state = {"x": torch.arange(6.0).view(2, 3), "y": torch.ones(2)}
    same = {"y": torch.ones(2), "x": torch.arange(6.0).view(2, 3)}  # order does not matter
    assert weights_digest(state) == weights_digest(same)
    for changed in (
        {"x": state["x"].view(3, 2)},
        {"x": state["x"].double()},
        {"x": state["x"] + 1e-6},
        {"z": state["x"]},
    ):
        other = {**{k: v for k, v in state.items() if k != "x"}, **changed}
        assert weights_digest(other) != weights_digest(state)
    assert weights_digest(state, names={"y"}) == weights_digest({"y": torch.ones(2)})


def test_the_rollout_pool_takes_buckets_and_engines_take_state_dicts():
    # TrainerGroup.sync_weights hands a BucketReceiver the object-store buckets; any other engine gets them
    # one by one through update_weights.
    assert issubclass(RolloutPool, BucketReceiver)
    assert not issubclass(HFEngine, BucketReceiver) and not issubclass(ScriptedEngine, BucketReceiver)
