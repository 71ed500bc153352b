#!/usr/bin/env bash
# The tool-arithmetic recipe, every stage (each one kept and reused when run again):
#   1. 300 demonstrations of calc's scripted solver (call the tool, answer its result),
#      deliberately too few to solve the task;
#   2. a random Qwen3-family checkpoint (small preset) with a tokenizer trained on them;
#   3. SFT on the demonstrations;
#   4. asynchronous RL through Kafka (recipes/tool-arithmetic.yaml), with held-out
#      evaluations of the SFT start and of the final policy.
# Sizes can be changed through the environment (DEMOS, PRESET, EPOCHS, SEED, OUT); extra
# arguments go to the final `rlstream run` (e.g. --steps 50).
set -euo pipefail
rlstream="${RLSTREAM:-rlstream}"
out="${OUT:-runs/tool-arithmetic}"
seed="${SEED:-0}"
mkdir -p "$out"
if [ ! -s "$out/demos.jsonl" ]; then
  "$rlstream" env demos calc --env-option max_operand=999 --episodes "${DEMOS:-300}" \
    --seed "$seed" -o "$out/demos.jsonl"
fi
if [ ! -f "$out/init/config.json" ]; then
  rm -rf "$out/init"
  "$rlstream" model init --family qwen3 --preset "${PRESET:-small}" --seed "$seed" \
    --tokenizer-text "$out/demos.jsonl" -o "$out/init"
fi
if [ ! -f "$out/sft/model/config.json" ]; then
  rm -rf "$out/sft"
  "$rlstream" sft --model "$out/init" --data "$out/demos.jsonl" --out "$out/sft" \
    --epochs "${EPOCHS:-12}" --rows 4 --length 1024 --learning-rate 0.002 --seed "$seed"
fi
exec "$rlstream" run --config recipes/tool-arithmetic.yaml --model "$out/sft/model" \
  --run-dir "$out/rl" --seed "$seed" "$@"
