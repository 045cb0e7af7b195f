#!/usr/bin/env bash
# The transfer libraries `make bench-transfer` measures beside the services' path, each in a
# virtualenv of its own outside the repository (NIXL bundles its own UCX, which must not meet
# ucxx's in the project's venv): $PD_PEERS_DIR/nixl and $PD_PEERS_DIR/mooncake.
# Idempotent; a library that does not install is left out (its arm is reported failed).
set -u
PEERS=${PD_PEERS_DIR:-$HOME/.cache/pdserve/peers}
PY=${PYTHON:-python3.11}
mkdir -p "$PEERS"

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
