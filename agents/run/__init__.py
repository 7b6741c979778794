"""The training run: from a configuration to a run folder of checkpoints, metrics and held-out scores.

- :mod:`agents.run.config`: ``TrainConfig``, its presets and overrides, and ``build`` (the run's parts);
- :mod:`agents.run.train`: the loop, :func:`~agents.run.train.train`;
- :mod:`agents.run.steps`: the step producers (synchronous, pipelined, asynchronous);
- :mod:`agents.run.task_order`: which tasks each step trains on, resumable;
- :mod:`agents.run.backends`: where rollouts come from (one engine here, or Ray's workers);
- :mod:`agents.run.folder`: the run folder (configuration, checkpoints, resuming);
- :mod:`agents.run.memory_plan`: what a run will need in memory, checked before it starts;
- :mod:`agents.run.cluster`: the scale-out processes (Ray, FSDP2 trainer ranks, weight sync).
"""
