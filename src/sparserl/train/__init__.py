"""One training run: its evaluation, checkpoints, run directory, metrics file and file names."""
