"""Every file name of the directories sparserl writes, in one place.

    <run>/.lock, config.yaml, metrics.jsonl, samples.jsonl, tensorboard/, final_eval.json (written by `compare`)
    <run>/checkpoints/step_000010/{manifest.json, policy/, optimizer.pt, config.yaml, sampler_adapter/, ...}
    <compare>/compare.json, report.md, *.png, <mode>/seed<S>/ (one run each)
    <calibration>/schedule.yaml, calibration.json, calibration.md, tails.png            (`sparserl calibrate`)
    <model>/card.json, probe_answers.jsonl beside the weights                 (`sparserl warmup`, `sparserl sft`)
"""

LOCK_FILE = ".lock"  # held while a run trains, so that a second process cannot write the same run

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
MANIFEST_FILE = "manifest.json"  # inside a checkpoint: every file's digest, written last (an intact checkpoint has it)
# What a training run writes at its top level (and their atomic-write temporaries): all that --overwrite deletes.
RUN_ENTRIES = frozenset({LOCK_FILE, CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR, FINAL_EVAL_FILE,
                         CHECKPOINT_DIR})
COMPARE_FILE = "compare.json"
REPORT_FILE = "report.md"
SCHEDULE_FILE = "schedule.yaml"  # a calibration's budget schedule, for --kv-schedule
CALIBRATION_FILE = "calibration.json"  # the calibration's tails per budget and bin
CALIBRATION_TABLE_FILE = "calibration.md"
CALIBRATION_PLOT_FILE = "tails.png"
MODEL_CARD_FILE = "card.json"  # how a warm-started model was made: settings, probes, the step kept
PROBE_ANSWERS_FILE = "probe_answers.jsonl"  # the kept probe's greedy answers, to read
