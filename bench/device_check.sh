#!/usr/bin/env bash
# The device check of issue 25: meshnet on a GPU, as the lent machine is (Python 3.12, torch with
# CUDA, transformers 5.17, no network), or on this machine's CPU with --device cpu.
#
#   bench/device_check.sh --build-wheelhouse   # here, with the package registry: the wheels the
#                                              # GPU image lacks, for Python 3.12 / manylinux x86_64,
#                                              # into bench/wheelhouse (git-ignored; carried there)
#   bench/device_check.sh [--device cuda]      # there: installs them and meshnet (--no-deps), then
#                                              # (a) the families' split-parity tests on the device,
#                                              # (b)-(d) bench/device_check.py: a 3-process mesh equal
#                                              # to generate, decode tokens/s beside generate (1 and 8
#                                              # sessions, bfloat16), an nf4 shard's doctor
#   bench/device_check.sh --device cpu         # the same on the CPU (under 6 minutes here)
#
# Only seeded random models built from configs are used. Exits non-zero when a part fails.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --build-wheelhouse) BUILD=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
WHEELS=bench/wheelhouse
# what meshnet needs beyond the GPU image's packages (KINDS.md lists them), without the optional
# parts the check never runs (PostgreSQL, the console, structured outputs); bitsandbytes last, as
# the largest (43 MB): with the rest and the working tree it still fits the 64 MiB a run carries
NEEDED="gguf zstandard starlette uvicorn pydantic pydantic-core annotated-types typing-inspection websockets
cryptography cffi pycparser asgi-lifespan pytest-asyncio bitsandbytes>=0.49"

if [ "$BUILD" = 1 ]; then
  PLATFORMS=""
  for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64 \
           manylinux_2_31_x86_64 manylinux_2_34_x86_64; do PLATFORMS="$PLATFORMS --platform $p"; done
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d "$WHEELS" $NEEDED
  du -sh "$WHEELS"
  exit 0
fi

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import meshnet.cli.main" 2>/dev/null; then
  if [ ! -d "$WHEELS" ]; then
    echo "device_check.sh: meshnet is not installed for $PY and there is no $WHEELS (run --build-wheelhouse)" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
export MESHNET_CACHE="${MESHNET_CACHE:-$(mktemp -d)}"
start=$(date +%s)
echo "(a) split parity of every family on $DEVICE"
MESHNET_TEST_DEVICE="$("$PY" -c "from meshnet.models.devices import resolve_device; print(resolve_device('$DEVICE'))")" \
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_families.py tests/unit/test_devices.py 2>&1 \
  | grep -v "falling back\|Loading weights\|Writing model" | tail -5
timeout 300 "$PY" bench/device_check.py --device "$DEVICE"
echo "device check: $(( $(date +%s) - start )) s"
