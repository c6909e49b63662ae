"""The policy model: loading (built-in, Hugging Face directory, GGUF), device and dtype (`loading`),
and the forward helpers both sides share: hidden states, log-probs through the head in chunks
(`forward`)."""
