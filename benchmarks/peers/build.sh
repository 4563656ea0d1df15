#!/usr/bin/env bash
# Build the peers' virtualenvs from their pinned files: benchmarks/peers/<peer>/requirements.txt -> .peers/<peer>/,
# and requirements-<variant>.txt -> .peers/<peer>_<variant>/ (git ignores .peers/). `make peers` calls this.
#
#   benchmarks/peers/build.sh                 every peer
#   benchmarks/peers/build.sh pyvene pyreft   those only (names as under .peers/)
#
# Environment: PYTHON (the interpreter the virtualenvs are made from; default python3), PEERS_HOME (default .peers),
# TORCH_PIP_ARGS (extra pip arguments for the torch install only, as in the Makefile). torch goes in first, pinned
# as in the requirements file (an unpinned torch resolves to the CUDA build: GBs of wheels); then the file itself.
# A virtualenv whose requirements file has not changed since its last build is left as it is (.peers/<name>/.built
# holds the file's checksum). A build's log is .peers/<name>/build.log; each build prints its name and seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
PEERS_HOME="${PEERS_HOME:-.peers}"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"

# name -> requirements file, for every pinned file under benchmarks/peers/
declare -A FILES
for file in benchmarks/peers/*/requirements*.txt; do
    peer="$(basename "$(dirname "$file")")"
    variant="$(basename "$file" .txt)"
    variant="${variant#requirements}"
    FILES["$peer${variant/#-/_}"]="$file"
done

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    mapfile -t names < <(printf '%s\n' "${!FILES[@]}" | sort)
fi

for name in "${names[@]}"; do
    file="${FILES[$name]:-}"
    if [ -z "$file" ]; then
        echo "unknown peer '$name'; known: $(printf '%s ' "${!FILES[@]}")" >&2
        exit 2
    fi
    venv="$PEERS_HOME/$name"
    checksum="$(sha256sum "$file" | cut -d' ' -f1)"
    if [ -f "$venv/.built" ] && [ "$(cat "$venv/.built")" = "$checksum" ]; then
        echo "$name: up to date ($venv)"
        continue
    fi
    start=$SECONDS
    echo "$name: building $venv from $file (log: $venv/build.log)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    torch_pin="$(grep -E '^torch==' "$file" || true)"
    {
        "$venv/bin/python" -m pip install --upgrade pip
        if [ -n "$torch_pin" ]; then
            # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of arguments
            "$venv/bin/python" -m pip install "$torch_pin" $TORCH_PIP_ARGS
        fi
        "$venv/bin/python" -m pip install -r "$file"
    } >"$venv/build.log" 2>&1 || { tail -n 30 "$venv/build.log" >&2; echo "$name: build failed" >&2; exit 1; }
    echo "$checksum" >"$venv/.built"
    echo "$name: built in $((SECONDS - start)) s ($venv/bin/python)"
done
