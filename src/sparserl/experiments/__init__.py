"""The commands that measure a model rather than train it: `eval`, `sweep` (and, with the trainer,
`compare`, `calibrate`, `audit`, `warmup`)."""
