#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine (the `device` tool's `run`), where nothing can be downloaded:
# its python3 has torch (2.11 + CUDA 13 when last seen) and most of ckptd's dependencies, not pyzmq or
# boto3. Before the first call, here: `make device-wheels` (the missing ones, as wheels for that machine's
# Python 3.12, into .whl/, which git ignores). Then each call carries .whl and runs one phase:
#
#   run(command="bash benchmarks/on_device.sh tests", carry=[".whl"])      # tests/test_cuda.py + the GPU copy benchmark
#   run(command="bash benchmarks/on_device.sh loop", carry=[".whl"])       # benchmarks/gpu_loop.py, every mode it reaches
#   run(command="bash benchmarks/on_device.sh loop --modes lag-wait,lag-memory,dcp-thread", carry=[".whl"])
#   run(command="bash benchmarks/on_device.sh paths", carry=[".whl"])     # benchmarks/restore_paths.py
#   run(command="bash benchmarks/on_device.sh profile", carry=[".whl"])   # the tests, then the hot read on 4 KiB and on huge pages
#   run(command="bash benchmarks/on_device.sh issue39", carry=[".whl"])   # the whole GPU table in one call (about 8 minutes)
#   run(command="bash benchmarks/on_device.sh restores", carry=[".whl"])  # the tests, then the restores on 4 KiB and huge pages
#   run(command="bash benchmarks/on_device.sh timeline", carry=[".whl"])  # a hot restore's phases, under variants
#   run(command="bash benchmarks/on_device.sh all --max-minutes 4 --profile-restore", carry=[".whl"])  # both, one start
#
# A phase fits in one call (10 minutes): gpu_loop.py stops starting modes after --max-minutes (8 by default) and
# names the ones it skipped, for a second call with --modes. Results and logs go to $OUT (they come back with
# the call's reply): pytest.log, gpu_copy.log, gpu_loop.log, gpu_loop.json, gpu_loop.png.
# Without $OUT (trying it here): into bench-out/device/.
set -euo pipefail
cd "$(dirname "$0")/.."
phase="${1:-}"
shift || true
out="${OUT:-bench-out/device}"
mkdir -p "$out"
py="${PYTHON:-python3}"
site="${CKPTD_DEVICE_SITE:-/tmp/ckptd-site}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# what this run stands on, at the top of every log: the reply's tail may lose it
"$py" - <<'EOF' | tee "$out/env.txt"
import importlib, platform, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
missing = []
for name in ("zmq", "psutil", "xxhash", "numpy", "prometheus_client", "boto3", "pytest"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit(f"missing on this machine: {', '.join(missing)}: run `make device-wheels` here and carry .whl")
import ckptd  # noqa: F401  (from this checkout)
print("ckptd from", ckptd.__file__)
EOF
# the machine: what the figures stand on (cores, memory, /dev/shm and the work disk's size and kind)
{ nproc; free -g; df -hT /dev/shm "${CKPTD_BENCH_DIR:-${TMPDIR:-/tmp}}" .; nvidia-smi -L || true; } 2>&1 | tee -a "$out/env.txt"
# gpu_loop.py wants 3.5x the state within half of /dev/shm (the daemon's default budget): a container's
# default /dev/shm is often far smaller than its memory; as root, grow it (tmpfs takes only what is used)
shm_gb=$(df -k --output=size /dev/shm | tail -1 | awk '{print int($1 / 1048576)}')
mem_gb=$(free -g | awk '/^Mem:/ {print $2}')
if [ "$(id -u)" = 0 ] && [ "$shm_gb" -lt $((mem_gb / 2)) ]; then
    mount -o remount,size=$((mem_gb * 3 / 4))G /dev/shm && df -h /dev/shm | tee -a "$out/env.txt" || true
fi

# SHM_HUGE=1: mount /dev/shm with huge=within_size (as root), to measure a node whose segments sit on huge pages
if [ "${SHM_HUGE:-0}" = 1 ] && [ "$(id -u)" = 0 ]; then
    mount -o remount,huge=within_size /dev/shm || echo "could not remount /dev/shm with huge pages"
fi
findmnt -no OPTIONS /dev/shm | tee -a "$out/env.txt"

case "$phase" in
tests)
    # test_cuda.py runs only with CUDA; the hot-restore and snapshot tests run their CPU paths beside it
    set +e
    "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hot.py tests/test_hotread.py tests/test_hot_to_device.py -ra 2>&1 | tee "$out/pytest.log"
    rc=${PIPESTATUS[0]}
    "$py" benchmarks/gpu_copy.py --json "$out/gpu_copy.json" 2>&1 | tee "$out/gpu_copy.log"
    exit "$rc"
    ;;
loop)
    "$py" benchmarks/gpu_loop.py --json "$out/gpu_loop.json" --plot "$out/gpu_loop.png" "$@" 2>&1 | tee "$out/gpu_loop.log"
    exit "${PIPESTATUS[0]}"
    ;;
paths)
    # the host-side pieces of a GPU restore, timed one by one (benchmarks/restore_paths.py); _huge: segments on huge pages
    tag=$([ "${SHM_HUGE:-0}" = 1 ] && echo _huge || true)
    "$py" benchmarks/restore_paths.py --json "$out/restore_paths$tag.json" "$@" 2>&1 | tee "$out/restore_paths$tag.log"
    exit "${PIPESTATUS[0]}"
    ;;
profile)
    # before choosing a restore path: the GPU tests, then ckptd's hot read timed piece by piece on segments of
    # 4 KiB pages and again on huge pages (restore_paths.py --only hotread, twice: 8 files come back in all)
    set +e
    timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hot.py tests/test_hotread.py tests/test_hot_to_device.py tests/test_pinned.py -ra 2>&1 | tee "$out/pytest.log"
    rc=${PIPESTATUS[0]}
    timeout 150 "$py" benchmarks/restore_paths.py --only hotread --json "$out/restore_paths.json" "$@" 2>&1 | tee "$out/restore_paths.log"
    if [ "$(id -u)" = 0 ] && mount -o remount,huge=within_size /dev/shm; then
        findmnt -no OPTIONS /dev/shm | tee -a "$out/env.txt"
        timeout 150 "$py" benchmarks/restore_paths.py --only hotread --json "$out/restore_paths_huge.json" "$@" 2>&1 | tee "$out/restore_paths_huge.log"
        mount -o remount,huge=never /dev/shm
    fi
    exit "$rc"
    ;;
issue39)
    # one call for the whole GPU table (issue 39): the GPU tests and the copy benchmark (tests.log), the training loop
    # at batch 1024 with every ckptd mode and DCP's two async savers and the restores (gpu_loop.*), the memory tier
    # every step at batch 8192, where the D2H floor is a fraction of a step (gpu_loop_memtier.*), and the restores
    # again with /dev/shm on huge pages (gpu_loop_huge.*). MAIN_MINUTES: the main loop starts no mode after that.
    set +e
    {
        cat "$out/env.txt"
        timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hot.py tests/test_hotread.py tests/test_hot_to_device.py tests/test_pinned.py tests/test_hotreg.py -ra
        echo "pytest rc=$?"
        timeout 60 "$py" benchmarks/gpu_copy.py --json /dev/null
    } 2>&1 | tee "$out/tests.log"
    rm -f "$out/env.txt"
    modes=floor,default,blocking,lag-wait,lag-memory,restore,dcp-thread,dcp-process
    timeout -s TERM "${MAIN_TIMEOUT:-330}" "$py" benchmarks/gpu_loop.py --modes "$modes" --batch 1024 --steps 30 --warmup-ckpts 2 \
        --max-minutes "${MAIN_MINUTES:-3.5}" --profile-restore --json "$out/gpu_loop.json" --plot /tmp/gpu_loop.png 2>&1 | tee "$out/gpu_loop.log"
    timeout -s TERM "${MEMTIER_TIMEOUT:-120}" "$py" benchmarks/gpu_loop.py --modes floor,memtier --batch 8192 --steps 20 --warmup-ckpts 1 \
        --json "$out/gpu_loop_memtier.json" --plot /tmp/gpu_loop_memtier.png 2>&1 | tee "$out/gpu_loop_memtier.log"
    if [ "$(id -u)" = 0 ] && mount -o remount,huge=within_size /dev/shm; then
        findmnt -no OPTIONS /dev/shm
        timeout -s TERM "${HUGE_TIMEOUT:-120}" "$py" benchmarks/gpu_loop.py --modes restore --batch 1024 --steps 10 --warmup-ckpts 1 \
            --profile-restore --json "$out/gpu_loop_huge.json" --plot /tmp/gpu_loop_huge.png 2>&1 | tee "$out/gpu_loop_huge.log"
        mount -o remount,huge=never /dev/shm
    fi
    exit 0
    ;;
restores)
    # the GPU tests, then gpu_loop.py's restores with segments on 4 KiB pages and again on huge pages (gpu_loop_restore{,_huge}.*)
    set +e
    {
        cat "$out/env.txt"
        timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hot.py tests/test_hotread.py tests/test_hot_to_device.py tests/test_pinned.py tests/test_hotreg.py -ra
        echo "pytest rc=$?"
    } 2>&1 | tee "$out/tests.log"
    rm -f "$out/env.txt"
    for tag in "" _huge; do
        if [ "$tag" = _huge ]; then
            { [ "$(id -u)" = 0 ] && mount -o remount,huge=within_size /dev/shm; } || break
            findmnt -no OPTIONS /dev/shm
        fi
        timeout -s TERM "${RESTORE_TIMEOUT:-150}" "$py" benchmarks/gpu_loop.py --modes restore --batch 1024 --steps 10 --warmup-ckpts 1 \
            --restore-reps 5 --profile-restore --json "$out/gpu_loop_restore$tag.json" --plot /tmp/gpu_loop_restore$tag.png 2>&1 |
            tee "$out/gpu_loop_restore$tag.log"
    done
    [ "$(id -u)" = 0 ] && mount -o remount,huge=never /dev/shm
    exit 0
    ;;
timeline)
    # where a hot restore's time goes, phase by phase, under variants (benchmarks/restore_timeline.py): on huge pages, then 4 KiB
    set +e
    for tag in _huge ""; do
        if [ "$tag" = _huge ]; then
            { [ "$(id -u)" = 0 ] && mount -o remount,huge=within_size /dev/shm; } || continue
        else
            [ "$(id -u)" = 0 ] && mount -o remount,huge=never /dev/shm
        fi
        timeout -s TERM "${TIMELINE_TIMEOUT:-150}" "$py" benchmarks/restore_timeline.py "$@" 2>&1 | tee "$out/restore_timeline$tag.log"
    done
    exit 0
    ;;
all)
    # one machine start for both: the tests (capped, so a hang leaves the loop its time), then the loop
    set +e
    timeout 240 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hot.py tests/test_hotread.py tests/test_hot_to_device.py -ra 2>&1 | tee "$out/pytest.log"
    rc=${PIPESTATUS[0]}
    timeout 90 "$py" benchmarks/gpu_copy.py --json "$out/gpu_copy.json" 2>&1 | tee "$out/gpu_copy.log"
    # LOOP_TIMEOUT: seconds before the loop is sent SIGTERM, after which it still prints and plots what it measured
    timeout -s TERM "${LOOP_TIMEOUT:-0}" "$py" benchmarks/gpu_loop.py --json "$out/gpu_loop.json" --plot "$out/gpu_loop.png" "$@" 2>&1 |
        tee "$out/gpu_loop.log"
    loop_rc=${PIPESTATUS[0]}
    echo "pytest rc=$rc gpu_loop rc=$loop_rc"
    [ "$rc" = 0 ] && exit "$loop_rc"
    exit "$rc"
    ;;
*)
    echo "usage: $0 tests | paths | profile | issue39 | restores | timeline | loop [gpu_loop.py arguments] | all [gpu_loop.py arguments]" >&2
    exit 2
    ;;
esac
