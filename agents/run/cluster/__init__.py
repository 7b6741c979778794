"""Scale-out on existing engines: Ray places the processes, FSDP2 shards the trainer, engines generate.

One training step crosses these processes (see docs/scaling.md):

- the **driver** (the ``agents train`` process) draws the tasks, assigns prompts to rollout
  workers, gathers their finished trees, assigns credit and hands the batch to the trainer;
- **rollout workers** (:mod:`agents.run.cluster.rollout_workers`): Ray actors, each owning an engine
  and the environments of the prompts it runs, so a prompt's whole tree and every ``fork()``
  stays in one process; only token ids, log-probs, entropies, rewards and tree structure come
  back;
- **trainer ranks** (:mod:`agents.run.cluster.trainer_ranks`): one ``torch.distributed`` group with
  the model sharded by FSDP2;
- **weight sync** (:mod:`agents.run.cluster.weight_sync`): the trainer's weights to every engine after
  each update.

``cluster.trainer_ranks = 1`` and ``cluster.rollout_workers = 0`` (the default) is the single
process of :func:`agents.run.train.train`: no Ray, no process group.
"""

from agents.run.cluster.config import ClusterConfig

__all__ = ["ClusterConfig"]
