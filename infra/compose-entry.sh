#!/bin/sh
# The entry of docker-compose.yml's rlstream services: install rlstream from the source
# mounted read-only at the folder above this script (built from a copy, since a build
# writes into its source tree), then run the given command.
#
#   sh /src/infra/compose-entry.sh rlstream produce --env guess
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
tar -C "$src" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=./build \
    --exclude=./.rlstream --exclude=./infra/kafka/lib --exclude='*.egg-info' \
    --exclude=__pycache__ -cf - . | tar -C "$work" -xf -
pip install -q --disable-pip-version-check "$work"
rm -rf "$work"
exec "$@"
