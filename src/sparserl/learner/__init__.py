"""Tensor maths of the update, no I/O: corrections (filters, weights, mismatch metrics) and the
modes built from them (`presets`), the GRPO loss, the acceptance rate α and its tail (`alpha`),
and DistillSparse's training step (`distill`)."""
