"""Other frameworks' trainers with this project's losses and environments: :mod:`agents.integrations.trl` (TRL's ``GRPOTrainer``, extra ``[trl]``).
:mod:`agents.integrations.verl`: verl's PPO trainer (extra ``[verl]``), which loads it through its ``verl.plugins`` entry point.
"""
