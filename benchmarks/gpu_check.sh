#!/usr/bin/env bash
# GPU check of the real backend (issue 4, item 9), one script, a few minutes on one H200:
#   1. the CUDA tests (tests/real/test_cuda.py: grouped GEMM vs loop, side-stream paging,
#      FP8 codec, one rank training on one GPU with a profiler trace, and with 2 or more
#      GPUs NCCL ranks with overlap against the single-process reference);
#   2. benchmarks/gpu_bench.py: grouped expert GEMM vs torch.bmm, page copy GB/s vs the
#      pinned-copy ceiling, copies hidden behind expert compute, router + permutation share,
#      each line with its goal and PASS / MISS;
#   3. testbed calibrate --device cuda --quick (into a scratch folder) and the built-in h200
#      profile against what it measured (benchmarks/profile_check.py), with the device
#      calibration's CUDA tests (tests/real/calibrate/test_device_bench.py).
# The GPU machine has torch and numpy but none of the project's other packages and no
# network: carry their wheels in .wheels/ (pip download -d .wheels tomli-w simpy networkx
# scipy plotly joblib tqdm, then name .wheels in the run's carry) and this script installs
# them offline first; without tomli-w the calibration cannot write its profile and says SKIP.
# Without CUDA it says so, runs the benchmark's CPU-side parts (labelled "CPU, not a goal
# check") and exits 0. What cannot run here (the multi-rank test and collectives on one
# GPU) prints a line starting SKIP with the reason: nothing passes without running. Needs torch and numpy only (no simpy, no network); pytest is used
# when installed. The exit status is 1 only when a test failed or the benchmark crashed:
# a MISS is a measurement, not a failure.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
ts() { date +%H:%M:%S; }

echo "[$(ts)] gpu_check in $PWD: $($PY -c 'import torch; print("torch", torch.__version__)')"
status=0
gpus=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "[$(ts)] CUDA tests"
    if [ "$gpus" -lt 2 ]; then
        echo "[$(ts)] SKIP test_nccl_ranks_match_the_reference_with_overlap: needs 2 or more GPUs, this machine has $gpus"
    fi
    if $PY -c 'import pytest' 2>/dev/null; then
        $PY -m pytest -m cuda -q -rs -p no:cacheprovider tests/real/test_cuda.py || status=1  # -rs: skip reasons
    else
        $PY tests/real/test_cuda.py || status=1
    fi
else
    echo "[$(ts)] CUDA is absent: no CUDA tests; the benchmark runs its CPU-side parts (CPU, not a goal check)"
fi
echo "[$(ts)] benchmark (ceilings: benchmarks/h200-ceilings.json)"
$PY benchmarks/gpu_bench.py || status=1
if [ "$gpus" -ge 1 ]; then
    if [ -d .wheels ]; then
        $PY -m pip install -q --no-index --find-links .wheels tomli-w simpy networkx scipy plotly joblib tqdm \
            || echo "[$(ts)] could not install every carried wheel (.wheels/)"
    fi
    if $PY -c 'import pytest' 2>/dev/null; then
        $PY -m pytest -m cuda -q -rs -p no:cacheprovider tests/real/calibrate/test_device_bench.py || status=1
    fi
    if $PY -c 'import tomli_w' 2>/dev/null; then
        out=$(mktemp -d)
        echo "[$(ts)] testbed calibrate --device cuda --quick -> $out/gpu-check.toml"
        if $PY -m testbed.cli calibrate --device cuda --quick --name gpu-check --output-dir "$out"; then
            $PY benchmarks/profile_check.py h200 "$out/gpu-check.toml" || status=1
            [ -n "${OUT:-}" ] && cp "$out/gpu-check.toml" "$OUT/" 2>/dev/null  # the device tool brings $OUT back
        else
            status=1
        fi
        rm -rf "$out"
    else
        echo "[$(ts)] SKIP testbed calibrate --device cuda: tomli-w is not installed (carry it in .wheels/)"
    fi
else
    echo "[$(ts)] SKIP testbed calibrate --device cuda: no GPU"
fi
if [ "$gpus" -ge 2 ]; then
    echo "[$(ts)] multi-rank: NCCL collectives on $gpus GPUs (nccl-tests style; no goal: figures to hold against the simulator)"
    $PY -m testbed.cli collective all_reduce --backend real --gpus "$gpus" --sizes 1M:256M || status=1
    $PY -m testbed.cli collective all_to_all --backend real --gpus "$gpus" --sizes 1M:256M || status=1
else
    echo "[$(ts)] SKIP multi-rank NCCL collectives: need 2 or more GPUs, this machine has $gpus"
fi
echo "[$(ts)] gpu_check done (status $status)"
exit $status
