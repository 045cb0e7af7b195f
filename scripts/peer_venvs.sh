#!/usr/bin/env bash
# The peers the benchmarks measure beside the services, each in a virtualenv of its own outside
# the repository: the transfer libraries `make bench-transfer` runs (NIXL bundles its own UCX,
# which must not meet ucxx's in the project's venv), $PD_PEERS_DIR/nixl and $PD_PEERS_DIR/mooncake;
# vLLM's Rust router `make bench-scale` runs, $PD_PEERS_DIR/vllm-router; llama.cpp's server
# `make bench` runs beside the stack, $PD_PEERS_DIR/llama-server (built from the source the
# llama-cpp-python sdist vendors: ~11 minutes on 2 cores, once).
#   scripts/peer_venvs.sh [transfer] [router] [llama-server]     (default: transfer and router)
# Idempotent; a peer that does not install is left out (its arm is reported failed or absent).
set -u
PEERS=${PD_PEERS_DIR:-$HOME/.cache/pdserve/peers}
PY=${PYTHON:-python3.11}
WANT=${*:-transfer router}
mkdir -p "$PEERS"

if [[ " $WANT " == *" router "* ]] && ! "$PEERS/vllm-router/bin/vllm-router" --help >/dev/null 2>&1; then
  echo "peers: installing vLLM's router (vllm-router, Rust) into $PEERS/vllm-router"
  ( $PY -m venv "$PEERS/vllm-router" && "$PEERS/vllm-router/bin/pip" -q install vllm-router==0.1.17 ) \
    || echo "peers: vllm-router did not install"
fi
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
LLAMA_SERVER="$PEERS/llama-server/$LLAMA_CPP_VERSION/llama-server"
if [[ " $WANT " == *" llama-server "* ]] && ! "$LLAMA_SERVER" --version >/dev/null 2>&1; then
  echo "peers: building llama-server from llama-cpp-python==$LLAMA_CPP_VERSION's sources (~11 minutes on 2 cores)"
  work=$(mktemp -d)
  # AVX2 kernels on every x86 machine, as make bench-engine's llama.cpp (its AVX-512/AMX build crashed on
  # multi-token batches on such a machine); no curl: it serves a local file
  ( cd "$work" && $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" \
      && tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp \
      && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
           -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null \
      && cmake --build build --target llama-server -j"$(nproc)" >/dev/null \
      && mkdir -p "$(dirname "$LLAMA_SERVER")" && cp build/bin/llama-server "$LLAMA_SERVER" ) \
    || echo "peers: llama-server did not build"
  rm -rf "$work"
fi
[[ " $WANT " == *" transfer "* ]] || exit 0

if [ ! -x "$PEERS/nixl/bin/python" ] || ! "$PEERS/nixl/bin/python" -c "import nixl_cu12" 2>/dev/null; then
  echo "peers: installing NIXL (nixl-cu12, ~70 MB) into $PEERS/nixl"
  # --no-deps: the wheel asks for torch, which its UCX backend on host memory does not use
  ( $PY -m venv "$PEERS/nixl" && "$PEERS/nixl/bin/pip" -q install --no-deps nixl-cu12==1.5.1 \
      && "$PEERS/nixl/bin/pip" -q install numpy ) || echo "peers: NIXL did not install"
fi

if [ ! -x "$PEERS/mooncake/bin/python" ] || ! "$PEERS/mooncake/bin/python" -c "import mooncake.engine" 2>/dev/null; then
  echo "peers: installing Mooncake's transfer engine (mooncake-transfer-engine-non-cuda, ~46 MB) into $PEERS/mooncake"
  ( $PY -m venv "$PEERS/mooncake" \
      && "$PEERS/mooncake/bin/pip" -q install mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy ) \
    || echo "peers: Mooncake did not install"
  # the wheel links libibverbs without shipping it; without root or the package, unpack
  # Debian's next to the wheel's own libraries
  libs=$(ls -d "$PEERS"/mooncake/lib/python3*/site-packages/mooncake_transfer_engine_non_cuda.libs 2>/dev/null)
  if [ -n "$libs" ] && ! "$PEERS/mooncake/bin/python" -c "import mooncake.engine" 2>/dev/null; then
    ( cd "$PEERS/mooncake" && mkdir -p debs && cd debs \
        && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null \
        && for d in *.deb; do dpkg -x "$d" ../sysroot; done ) || echo "peers: libibverbs not found"
    find "$PEERS/mooncake/sysroot" \( -name 'libibverbs.so.1' -o -name 'libnl-3.so.200' \
        -o -name 'libnl-route-3.so.200' \) -exec ln -sf {} "$libs/" \; 2>/dev/null
  fi
fi
exit 0
