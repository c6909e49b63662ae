"""sparserl inside other trainers: TRL's `GRPOTrainer` (`trl.py`, the optional extra `[trl]`)."""
