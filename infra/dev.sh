#!/usr/bin/env bash
# rlstream's two set-up commands, each installing what it needs first:
#
#   infra/dev.sh run [ARGS...]   the main job (`rlstream run`) on a local Kafka broker
#   infra/dev.sh test [PYTEST ARGS...]
#                                lint, type checks, unit and integration tests against a
#                                real local Kafka broker that it starts and always stops
#
# Needs Python 3.11+, Java 17+ and (once, to fetch the Kafka jars) Maven.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${RLSTREAM_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

setup() {
  if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv"
    "$python" -m venv "$venv"
  fi
  stamp="$venv/.rlstream-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "== installing rlstream and its dependencies"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e ".[test]"
    touch "$stamp"
  fi
  command -v java >/dev/null || { echo "rlstream: Java 17+ is needed (apt-get install openjdk-17-jre-headless)" >&2; exit 2; }
  if ! ls infra/kafka/lib/kafka_2.13-*.jar >/dev/null 2>&1; then
    command -v mvn >/dev/null || { echo "rlstream: Maven is needed once to fetch the Kafka jars (apt-get install maven)" >&2; exit 2; }
    echo "== fetching the Apache Kafka jars (Maven)"
    mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  run)
    setup
    exec "$venv/bin/rlstream" run "$@"
    ;;
  test)
    setup
    echo "== ruff"
    "$venv/bin/ruff" check pipeline connectors tests
    "$venv/bin/ruff" format --check pipeline connectors tests
    echo "== mypy"
    "$venv/bin/mypy"
    broker_dir="$root/.rlstream/test-broker"
    port="${RLSTREAM_TEST_PORT:-19092}"
    rm -rf "$broker_dir"
    stop_broker() { "$venv/bin/rlstream" broker stop --data-dir "$broker_dir" --port "$port" || true; }
    trap stop_broker EXIT
    echo "== starting the local Kafka broker"
    "$venv/bin/rlstream" broker start --data-dir "$broker_dir" --port "$port"
    export RLSTREAM_BOOTSTRAP="127.0.0.1:$port"
    echo "== pytest"
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
      echo "rlstream: pytest collected no tests" >&2
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: infra/dev.sh run [rlstream run args] | test [pytest args]" >&2
    exit 2
    ;;
esac
