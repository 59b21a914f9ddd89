#!/usr/bin/env bash
# Make sure hetero has a compute-capable WebGPU adapter (Vulkan, Metal or D3D12).
#
# Asks `$PYTHON -m hetero info --check`; when that fails (or Python cannot even load
# hetero and wgpu), installs Mesa's software Vulkan driver (lavapipe) with apt-get,
# then checks again. Installing needs root; otherwise the command to run is printed.
#
#   PYTHON=.venv/bin/python scripts/ensure-gpu.sh
set -uo pipefail

PYTHON=${PYTHON:-python3}
INSTALL="apt-get update -qq && apt-get install -y -qq mesa-vulkan-drivers"

check() {
    "$PYTHON" -m hetero info --check
}

if check; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-gpu: no usable GPU adapter; install Mesa's software Vulkan driver as root:" >&2
    echo "    $INSTALL" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-gpu: no usable GPU adapter and no apt-get here; install a Vulkan driver" \
         "(Mesa lavapipe, or your GPU vendor's) with your system's package manager" >&2
    exit 1
fi

echo "ensure-gpu: no usable GPU adapter; installing Mesa's software Vulkan driver: $INSTALL" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq mesa-vulkan-drivers; }; then
    echo "ensure-gpu: installing mesa-vulkan-drivers failed" >&2
    exit 1
fi
if check; then
    exit 0
fi
echo "ensure-gpu: still no usable GPU adapter after installing mesa-vulkan-drivers; run '$PYTHON -m hetero info'" >&2
exit 1
