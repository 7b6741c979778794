"""The training side: rollout trees in, weights out.

Data flows down the modules, each importing only those above it:

- :mod:`agents.training.credit`: values and per-turn advantages on finished trees (no torch);
- :mod:`agents.training.batch`: training paths padded into tensors (:class:`~agents.training.batch.PathBatch`);
- :mod:`agents.training.scoring`: log-probs and entropies of tokens from logits (the one place that shifts by one);
- :mod:`agents.training.packing`, :mod:`agents.training.tree_attention`: a micro-batch's paths as one
  row, each shared prefix once, and the attention that keeps each path to itself;
- :mod:`agents.training.losses`: the policy losses and the registry of named ones (:data:`~agents.training.losses.LOSSES`);
- :mod:`agents.training.trainer_config`: every hyper-parameter of the trainer;
- :mod:`agents.training.checkpoint`, :mod:`agents.training.metrics`: saving, resuming, logging
  (:mod:`agents.training.reporting`: the reporters besides the JSONL file, TensorBoard and W&B);
- :mod:`agents.training.sharding`: the policy sharded over trainer ranks (FSDP2), and what the ranks share;
- :mod:`agents.training.forward`: the forward pass, token ids to log-probs and entropies, on a step's
  micro-batches planned and packed once;
- :mod:`agents.training.lora`: LoRA adapters injected for training, merged into the weights an engine loads;
- :mod:`agents.training.optimizer`: AdamW, its learning-rate schedule and the clipped step;
- :mod:`agents.training.trainer_loss`: the configured loss checked against its signature and given its inputs;
- :mod:`agents.training.step_metrics`: what a step's passes and updates add up to, and its record;
- :mod:`agents.training.trainer`: :class:`~agents.training.trainer.Trainer`, one policy update per rollout batch.

Import the modules themselves; this package imports nothing, so ``agents.training.credit`` loads without torch.
"""
