"""Every file name of a run directory and of a comparison directory, in one place.

    <run>/config.yaml, metrics.jsonl, samples.jsonl, tensorboard/, final_eval.json (written by `compare`)
    <run>/checkpoints/step_000010/{policy/, optimizer.pt, config.yaml, sampler_adapter/, ...}
    <compare>/compare.json, report.md, *.png, <mode>/seed<S>/ (one run each)
"""

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # every rollout's and every held-out answer's text, to read how a number was earned
TENSORBOARD_DIR = "tensorboard"
FINAL_EVAL_FILE = "final_eval.json"
CHECKPOINT_DIR = "checkpoints"
POLICY_DIR = "policy"  # inside a checkpoint: the model and tokenizer, loadable by Hugging Face
OPTIMIZER_FILE = "optimizer.pt"  # inside a checkpoint, and inside its sampler adapter's directory
RNG_FILE = "rng.pt"  # inside a checkpoint: torch (and CUDA) generator states
HOST_RNG_FILE = "rng.json"  # inside a checkpoint: Python's and numpy's
TRAINER_STATE_FILE = "trainer_state.json"  # inside a checkpoint: step and counters
ADAPTER_DIR = "sampler_adapter"  # inside a checkpoint: DistillSparse's adapter and its optimizer
ADAPTER_WEIGHTS_FILE = "adapter.safetensors"  # inside ADAPTER_DIR
COMPARE_FILE = "compare.json"
REPORT_FILE = "report.md"
