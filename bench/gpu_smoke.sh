#!/usr/bin/env bash
# GPU smoke test: one bf16 sparse-rl training step and a dense-vs-sparse rollout timing on CUDA (about a minute on
# one GPU: the decode steps replay CUDA graphs).
#
#   bash bench/gpu_smoke.sh [MODEL_DIR]       # MODEL_DIR: e.g. from `sparserl model gemma-3-270m --out DIR`;
#                                             # default: the built-in model
# Needs a CUDA machine with the project installed (torch with CUDA, not the CPU pin). Prints the
# step's timings and the rollout table; exits non-zero on any failure. Nothing else in the project
# depends on a GPU. `DEVICE=cpu LENGTHS=256` runs the same steps on the CPU, small, to check the
# script itself (tests/test_devices.py does).
set -euo pipefail
MODEL="${1:-}"
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-/tmp/sparserl-gpu-smoke}"
DEVICE="${DEVICE:-cuda}"
LENGTHS="${LENGTHS:-1024 4096}"
"$PY" - "$DEVICE" <<'PY'
import sys, torch
device = sys.argv[1]
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device: this smoke test needs a GPU (DEVICE=cpu for a dry run)"
    print("device:", torch.cuda.get_device_name(device), "| torch", torch.__version__)
else:
    print("device:", device, "(dry run) | torch", torch.__version__)
PY
MODEL_ARGS=()
if [[ -n "$MODEL" ]]; then
  MODEL_ARGS=(--model "$MODEL" --task reasoning_gym --gym-dataset chain_sum --max-new-tokens 256 --kv-budget 128
              --kv-interval 32 --kl-coef 0)
fi
"$PY" -m sparserl.cli train "${MODEL_ARGS[@]}" --device "$DEVICE" --dtype bfloat16 --mode sparse-rl --steps 1 \
    --eval-every 0 --log-with none --out "$OUT/train" --overwrite
"$PY" - "$OUT/train/metrics.jsonl" <<'PY'
import json, sys
record = [json.loads(line) for line in open(sys.argv[1])][-1]
keys = ("step_s", "rollout_s", "recompute_s", "update_s", "tokens_per_s", "kv_peak_bytes", "alpha_tail", "xi_q01")
print("train step:", {k: round(record[k], 4) for k in keys if k in record})
PY
PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$MODEL" "$DEVICE" $LENGTHS <<'PY'
import sys, time, torch
from common import compression_interval
from sparserl.model.loading import load_policy
from sparserl.rollout.batch import SamplingConfig, kv_saved
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
model_dir, device, lengths = sys.argv[1] or None, sys.argv[2], [int(n) for n in sys.argv[3:]]
model, tokenizer = load_policy(model_dir, torch.bfloat16, device)
synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
prompts = [[(7 * i + r) % 90 + 3 for i in range(64)] for r in range(32)]
seeds = [request_seed(0, r) for r in range(len(prompts))]  # per-row seeds: the static step runs as CUDA graphs
print("| L | config | rollout s | tokens/s | KV saved (peak vs dense) |")
print("|---|---|---|---|---|")
for length in lengths:
    dense_peak = None
    for name, comp in (("dense", None), (f"rkv B={length // 4}", KVCompression("rkv", budget=length // 4, interval=compression_interval(length)))):
        engine = RolloutEngine(model, comp, record_evictions=False)
        sampling = SamplingConfig(length - 64, 1.0, None, tokenizer.pad_token_id or 0)
        synchronize(); started = time.perf_counter()
        batch = engine.generate(prompts, sampling, seeds=seeds)
        synchronize(); seconds = time.perf_counter() - started
        tokens = int(batch.response_lengths.sum())
        dense_peak = dense_peak or batch.kv.kv_peak_bytes
        saved = kv_saved(batch.kv.kv_peak_bytes, dense_peak)
        print(f"| {length} | {name} | {seconds:.1f} | {tokens / seconds:.0f} | {saved:.0%} |")
PY
