"""The ``cluster`` section's placement settings and a worker engine of one's own: checked before anything starts."""

import pytest

from agents.run.cluster.config import ClusterConfig
from agents.run.train import _load_entry_point


def test_the_defaults_place_ranks_together_and_workers_where_ray_finds_room():
    cluster = ClusterConfig()
    assert (cluster.rank_resources, cluster.worker_resources) == ({}, {})
    assert (cluster.rank_strategy, cluster.worker_strategy) == ("PACK", "DEFAULT")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rank_resources": {"CPU": 1}}, r"cluster.rank_resources names 'CPU'; give a custom resource"),
        ({"worker_resources": {"rollout": 0}}, r"cluster.worker_resources\['rollout'\] must be a number > 0, got 0"),
        ({"worker_resources": {"rollout": True}}, r"must be a number > 0, got True"),
        ({"rank_resources": ["trainer"]}, r"cluster.rank_resources must be a mapping .* got \['trainer'\]"),
        ({"rank_strategy": "spread"}, r"cluster.rank_strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
        ({"worker_strategy": "PACK"}, r"cluster.worker_strategy must be one of DEFAULT, SPREAD, got 'PACK'"),
        ({"worker_engine": "sglang"}, r"cluster.worker_engine must be 'hf', 'vllm', 'module:attr' .* got 'sglang'"),
        ({"worker_engine": "my engines:make"}, r"got 'my engines:make'"),
        ({"worker_engine": "engines:"}, r"got 'engines:'"),
    ],
)
def test_a_bad_placement_or_engine_setting_is_refused_naming_it(values, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(values)


def test_a_worker_engine_of_ones_own_is_a_module_and_function_name():
    assert (
        ClusterConfig(worker_engine="my_engines.fast:make", rollout_workers=1).worker_engine == "my_engines.fast:make"
    )
    assert _load_entry_point("agents.engines.scripted:ScriptedEngine").__name__ == "ScriptedEngine"
    with pytest.raises(ValueError, match=r"cluster.worker_engine='agents.engines.scripted:nothing' names no function"):
        _load_entry_point("agents.engines.scripted:nothing")
    with pytest.raises(ValueError, match=r"'no_such_module:make' names no function \(No module named"):
        _load_entry_point("no_such_module:make")
