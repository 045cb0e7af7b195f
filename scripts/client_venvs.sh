#!/usr/bin/env bash
# The clients `make test-clients` runs against the stack, each in a virtualenv of its own,
# .venv-clients/<name>, from tests/clients/requirements/<name>.txt (their pins clash with one
# another's and with the project's). Idempotent: a venv is rebuilt when its requirements change.
# Writes the seconds each install took to .venv-clients/<name>/.install-seconds.
# Usage: scripts/client_venvs.sh [name ...]   (default: every requirements file)
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
REQS=tests/clients/requirements
names=("$@")
[ ${#names[@]} -gt 0 ] || names=($(ls $REQS | sed 's/\.txt$//'))

for name in "${names[@]}"; do
  venv=.venv-clients/$name req=$REQS/$name.txt
  if [ -f "$venv/.installed" ] && cmp -s "$req" "$venv/.installed"; then
    continue
  fi
  echo "clients: installing $name into $venv"
  start=$(date +%s)
  rm -rf "$venv"
  $PY -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r "$req"
  echo $(( $(date +%s) - start )) > "$venv/.install-seconds"
  cp "$req" "$venv/.installed"
done
