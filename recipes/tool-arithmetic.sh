#!/usr/bin/env bash
# The tool-arithmetic recipe (recipes/tool-arithmetic.yaml), every stage in one run
# directory: demonstrations, a random Qwen3-family checkpoint with its tokenizer trained on
# them, SFT (in warm_start/), then asynchronous RL through Kafka with held-out evaluations
# of the SFT start and of the final policy. A stage already done in that directory is
# reused. Sizes can be changed through the environment (DEMOS, DRILLS, PRESET, EPOCHS,
# SEED, OUT);
# extra arguments go to `rlstream run` (e.g. --steps 50).
set -euo pipefail
rlstream="${RLSTREAM:-rlstream}"
flags=(--config recipes/tool-arithmetic.yaml --run-dir "${OUT:-runs/tool-arithmetic}")
flags+=(--seed "${SEED:-0}")
[ -n "${DEMOS:-}" ] && flags+=(--warm-start.demos "$DEMOS")
[ -n "${DRILLS:-}" ] && flags+=(--warm-start.pretrain "echo=$DRILLS")
[ -n "${PRESET:-}" ] && flags+=(--warm-start.preset "$PRESET")
[ -n "${EPOCHS:-}" ] && flags+=(--warm-start.sft "epochs=$EPOCHS")
exec "$rlstream" run "${flags[@]}" "$@"
