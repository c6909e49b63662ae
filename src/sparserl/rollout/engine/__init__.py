"""The engine room: where a token is drawn (`token_draws.py`), where rows join and leave a rollout
(`decode_loop.py`), the engine that samples a batch (`engine.py`), and a model of what its decoding costs
(`cost_model.py`)."""
