"""The training side: rollout trees in, weights out.

Data flows down the modules, each importing only those above it:

- :mod:`agents.training.credit`: values and per-turn advantages on finished trees (no torch);
- :mod:`agents.training.batch`: training paths padded into tensors (:class:`~agents.training.batch.PathBatch`);
- :mod:`agents.training.scoring`: log-probs and entropies of tokens from logits (the one place that shifts by one);
- :mod:`agents.training.losses`: the policy losses and the registry of named ones (:data:`~agents.training.losses.LOSSES`);
- :mod:`agents.training.trainer_config`: every hyper-parameter of the trainer;
- :mod:`agents.training.checkpoint`, :mod:`agents.training.metrics`: saving, resuming, logging
  (:mod:`agents.training.reporting`: the reporters besides the JSONL file, TensorBoard and W&B);
- :mod:`agents.training.trainer`: :class:`~agents.training.trainer.Trainer`, one policy update per rollout batch.

Import the modules themselves; this package imports nothing, so ``agents.training.credit`` loads without torch.
"""
