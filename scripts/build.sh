#!/usr/bin/env bash
# Configures and builds ultrafast into build/. The CUDA backend is compiled (sm_90a, sm_100a)
# when /usr/local/cuda exists, so that a broken kernel fails here; set UF_ENABLE_CUDA=OFF to skip.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA="${UF_ENABLE_CUDA:-AUTO}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUF_ENABLE_CUDA="$CUDA" >/dev/null
cmake --build build -j "$(nproc)"
