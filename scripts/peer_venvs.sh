#!/usr/bin/env bash
# The peers the benchmarks measure beside the services, each in a virtualenv of its own outside
# the repository: the transfer libraries `make bench-transfer` runs (NIXL bundles its own UCX,
# which must not meet ucxx's in the project's venv), $PD_PEERS_DIR/nixl and $PD_PEERS_DIR/mooncake;
# vLLM's Rust router `make bench-scale` runs, $PD_PEERS_DIR/vllm-router.
#   scripts/peer_venvs.sh [transfer] [router]     (default: both)
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
