#!/bin/bash
# One lent GPU machine's checks for issue "every reference net within 1.3x of PyTorch", in
# two calls (docs/gpu.md, "On a lent GPU machine", says how to start them).
#
#   bash benchmarks/gpu_session.sh prepare      here: the wheels and fixtures the machine lacks
#   bash benchmarks/gpu_session.sh run PARTS    there: PARTS from tests, lenet, bench; logs and
#                                               JSON under $OUT. A call may run 10 minutes:
#                                               `run bench`, then `run tests lenet`
#
# The machine has Python 3.12 with CuPy, PyTorch and NumPy but not pyzmq, lmdb, cryptography
# or cuDNN's frontend, and it cannot reach a registry: `prepare` downloads them as wheels into
# .whl/. It cannot see ../shared either: `prepare` copies the fixtures the GPU tests and the
# LeNet run read into .gpu_shared/ (the tests find them through POSEIDON_SHARED). Both folders
# are ignored by git and travel only when the call carries them; together with the tree they
# stay under the 64 MiB a call may send.
set -o pipefail
cd "$(dirname "$0")/.."
what=${1:-}
shift || true

prepare() {
    local shared=${POSEIDON_SHARED:-../shared}
    rm -rf .whl .gpu_shared && mkdir -p .whl .gpu_shared/fixtures/oracle .gpu_shared/data
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_34_x86_64 -d .whl \
        pyzmq==27.3.0 lmdb==3.0.0 protobuf==7.36.2 cryptography==50.0.2 cffi==2.1.1 \
        pycparser==3.12 nvidia-cudnn-frontend || return 1
    cp -r "$shared"/fixtures/oracle/layers "$shared"/fixtures/oracle/solvers \
        .gpu_shared/fixtures/oracle/ &&
    cp -r "$shared"/fixtures/caffemodels "$shared"/fixtures/prototxt .gpu_shared/fixtures/ &&
    cp -r "$shared"/data/mnist .gpu_shared/data/ || return 1
    du -sh .whl .gpu_shared
    echo "carry: [\".whl\", \".gpu_shared\"]; command: bash benchmarks/gpu_session.sh run"
}

run() {
    local parts=${*:?name the parts: bench, or tests lenet (one call each: a call may run 10 minutes)}
    : "${OUT:?run it on the device machine, where \$OUT is set}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site:$PWD POSEIDON_SHARED=$PWD/.gpu_shared PYTHONUNBUFFERED=1
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c 'import cupy, torch, numpy; print("cupy", cupy.__version__, "cuda",
cupy.cuda.runtime.runtimeGetVersion(), "torch", torch.__version__, "numpy", numpy.__version__)'
    } 2>&1 | tee "$OUT/machine.txt"
    for part in $parts; do
        case $part in
        tests)  # every layer against NumPy, the oracle nets strict, the six solvers, the math
            timeout 240 python3 -m pytest -q -n 12 -p no:cacheprovider \
                tests/test_gpu_parity.py tests/test_gpu_parity_nets.py tests/test_gpu_math.py \
                tests/test_comm_gpu.py tests/test_comm_staging.py 2>&1 | tee "$OUT/tests.log" |
                tail -5 ;;
        lenet)  # LeNet on MNIST to 10,000 iterations: at least 99.0%
            python3 -m poseidon_cli.main data mnist --out models/data/mnist \
                --from .gpu_shared/data/mnist > "$OUT/lenet.log" 2>&1 &&
            timeout 180 python3 -m poseidon_cli.main train --gpu 0 \
                --solver models/lenet/solver.prototxt >> "$OUT/lenet.log" 2>&1
            grep -E "accuracy|Optimization Done" "$OUT/lenet.log" | tail -3 ;;
        bench)  # forward+backward and the training step against PyTorch, six nets
            timeout 420 python3 -m poseidon_cli.main bench time --gpu 0 --repeats 1 \
                --json "$OUT/bench_time.json" 2>&1 | tee "$OUT/bench_time.log" | tail -12 ;;
        *) echo "unknown part $part (tests, lenet, bench)"; return 2 ;;
        esac
    done
}

case $what in
prepare) prepare ;;
run) run "$@" ;;
*) sed -n 2,15p "$0"; exit 2 ;;
esac
