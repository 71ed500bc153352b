#!/usr/bin/env bash
# rlstream's two set-up commands, each installing what it needs first:
#
#   infra/dev.sh run [ARGS...]   the main job (`rlstream run`) on a local Kafka broker
#   infra/dev.sh run --recipe tool-arithmetic [ARGS...]
#                                a recipe of recipes/: e.g. SFT then RL of a Qwen3-family
#                                model on tool-using arithmetic
#   infra/dev.sh test [PYTEST ARGS...]
#                                lint, type checks, unit and integration tests against a
#                                real local Kafka broker that it starts and always stops;
#                                without arguments also tests/verifiers_suite, in a second
#                                virtual environment (.venv-verifiers)
#
# Needs Python 3.11+, Java 17+ and (once, to fetch the Kafka jars) Maven.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${RLSTREAM_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

die() { echo "rlstream: $*" >&2; exit 2; }

# What the machine must have, checked before anything is installed.
preflight() {
  command -v "$python" >/dev/null || die "$python not found: Python 3.11 or later is needed (or set PYTHON=/path/to/python3.11)"
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$("$python" -V 2>&1) is too old: Python 3.11 or later is needed (set PYTHON=/path/to/python3.11)"
  "$python" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$("$python" -V 2>&1) lacks the venv module (apt-get install python3-venv, or set PYTHON)"
  command -v java >/dev/null || die "Java 17 or later is needed to run Kafka (apt-get install openjdk-17-jre-headless)"
  local major
  major="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)"
  if [ -n "$major" ] && [ "$major" -lt 17 ]; then
    die "Java $major is too old: Java 17 or later is needed to run Kafka"
  fi
  if ! ls infra/kafka/lib/kafka_2.13-*.jar >/dev/null 2>&1; then
    command -v mvn >/dev/null || die "Maven is needed once to fetch the Kafka jars (apt-get install maven)"
  fi
}

# setup [EXTRA]: the virtual environment $venv with rlstream and the extra (test, test-verifiers)
setup() {
  preflight
  # a venv left half-made (an interrupted creation, a Python without ensurepip) is made again
  if [ -d "$venv" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "== $venv is incomplete: making it again"
    rm -rf "$venv"
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv"
    "$python" -m venv "$venv" || { rm -rf "$venv"; die "could not create $venv with $python"; }
  fi
  local spec="." stamp="$venv/.rlstream-installed"
  if [ -n "${1:-}" ]; then
    spec=".[$1]"
    stamp="$venv/.rlstream-installed-$1"
  fi
  # installed again when the packaging or the C codec changed (it is compiled at install)
  local changed=""
  for f in pyproject.toml setup.py pipeline/records/*.c; do
    if [ "$f" -nt "$stamp" ]; then changed=1; fi
  done
  if [ ! -f "$stamp" ] || [ -n "$changed" ]; then
    echo "== installing rlstream${1:+ and its $1 tools}"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e "$spec"
    touch "$stamp"
  fi
  if ! ls infra/kafka/lib/kafka_2.13-*.jar >/dev/null 2>&1; then
    echo "== fetching the Apache Kafka jars (Maven)"
    mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  run)
    setup
    if [ "${1:-}" = "--recipe" ]; then
      recipe="${2:-}"
      [ -n "$recipe" ] && [ -f "recipes/$recipe.sh" ] \
        || die "--recipe needs one of: $(cd recipes && ls ./*.sh | sed 's|^./||; s|\.sh$||' | tr '\n' ' ')"
      shift 2
      RLSTREAM="$venv/bin/rlstream" exec bash "recipes/$recipe.sh" "$@"
    fi
    exec "$venv/bin/rlstream" run "$@"
    ;;
  test)
    setup test
    state="$root/.rlstream"
    mkdir -p "$state"
    # Made in the background, at low priority, while the suite runs (both take minutes
    # and neither is needed before its end): llama.cpp's inference server, which the
    # tests of producers sampling with an inference server run against (pytest runs them
    # last and waits for the build; tests/conftest.py), and the verifiers environments'
    # own virtual environment (their suite runs after this one).
    background=()
    kill_tree() {
      local child
      for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
      kill "$1" 2>/dev/null || true
    }
    llama_done="$state/llama-server.done"
    rm -f "$llama_done"
    echo "== $(date +%T) building llama.cpp's server in the background (log: $state/llama-server.log)"
    (
      renice -n 19 "$BASHPID" >/dev/null 2>&1 || true
      code=0
      path="$(PYTHON="$venv/bin/python" bash infra/llama-server.sh 2>"$state/llama-server.log")" \
        || code=$?
      printf '%s\n%s\n' "$code" "$path" >"$llama_done.part"
      mv "$llama_done.part" "$llama_done"
    ) &
    background+=("$!")
    export RLSTREAM_LLAMA_SERVER_BUILD="$llama_done"
    verifiers_venv="${RLSTREAM_VERIFIERS_VENV:-$root/.venv-verifiers}"
    if [ "$#" -eq 0 ]; then
      echo "== $(date +%T) making $verifiers_venv in the background (log: $state/verifiers-venv.log)"
      (
        renice -n 19 "$BASHPID" >/dev/null 2>&1 || true
        venv="$verifiers_venv"
        # the C extensions the suite is loading are used as they are, never rewritten
        RLSTREAM_NO_C_EXTENSIONS=1 setup test-verifiers
      ) >"$state/verifiers-venv.log" 2>&1 &
      verifiers_setup=$!
      background+=("$verifiers_setup")
    fi
    echo "== $(date +%T) ruff"
    "$venv/bin/ruff" check pipeline connectors tests
    "$venv/bin/ruff" format --check pipeline connectors tests
    echo "== $(date +%T) mypy"
    "$venv/bin/mypy"
    broker_dir="$state/test-broker"
    port="${RLSTREAM_TEST_PORT:-19092}"
    rm -rf "$broker_dir"
    on_exit() {
      local pid
      for pid in "${background[@]}"; do kill_tree "$pid"; done
      "$venv/bin/rlstream" broker stop --data-dir "$broker_dir" --port "$port" || true
    }
    trap on_exit EXIT
    echo "== $(date +%T) starting the local Kafka broker"
    "$venv/bin/rlstream" broker start --data-dir "$broker_dir" --port "$port"
    export RLSTREAM_BOOTSTRAP="127.0.0.1:$port"
    echo "== $(date +%T) pytest"
    set +e
    "$venv/bin/python" -m pytest --durations=25 "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
      echo "rlstream: pytest collected no tests" >&2
    fi
    # verifiers environments, in an environment of their own: verifiers' classic API needs
    # mcp<2, the suite above mcp>=2.3 (skipped when pytest was given arguments)
    vrc=0
    if [ "$#" -eq 0 ]; then
      echo "== $(date +%T) pytest (verifiers environments, in $verifiers_venv)"
      if ! wait "$verifiers_setup"; then
        tail -30 "$state/verifiers-venv.log" >&2
        die "could not make $verifiers_venv (log: $state/verifiers-venv.log)"
      fi
      set +e
      RLSTREAM_CLIENT_PYTHON="$venv/bin/python" \
        "$verifiers_venv/bin/python" -m pytest tests/verifiers_suite
      vrc=$?
      set -e
      if [ "$vrc" -eq 5 ]; then
        echo "rlstream: pytest collected no verifiers tests" >&2
      fi
    fi
    wait  # a build the selected tests did not need finishes (it is kept for the next run)
    echo "== $(date +%T) done"
    if [ "$rc" -ne 0 ]; then exit "$rc"; fi
    exit "$vrc"
    ;;
  *)
    echo "usage: infra/dev.sh run [rlstream run args] | test [pytest args]" >&2
    exit 2
    ;;
esac
