#!/usr/bin/env bash
# The GPU run, in one go (docs/gpu.md): from the checkout's root on a GPU machine, with the kit
# in .gpu/ (make gpu-kit):   tools/gpu/check.sh OUT
#   1. the GPU's name, the kit's setup                          -> OUT/gpu.log (everything)
#   2. the CUDA kernel tests, the id map's GPU kernels against their twins (stops here if they
#      fail), the rest                                            -> OUT/kernel.xml, OUT/cuda.xml
#      serving on CUDA: tables, a model following deltas, export, the HTTP server -> OUT/serving.xml
#      and its lookups against TorchRec's quantized EBC -> OUT/gpu_serving.json, OUT/gpu_serving.png
#   3. benchmarks/bench_gpu.py against fbgemm's CUDA TBE     -> OUT/gpu.json, OUT/gpu.png, gpu_profile.txt
#   4. the job under torchrun with NCCL: train, checkpoint, resume on the GPU and on 2 CPU
#      processes, predictions compared                          -> OUT/job.json
#   5. bench_gpu.py --dmp under torchrun                         -> OUT/gpu_dmp.json
#   6. TorchRec's pipelines against a plain loop                 -> OUT/pipelines.xml
#   7. (key touch, by name) tools/gpu/touch_ab.py: the header touch's count, sorted runs against
#      one atomic per occurrence (a one-off, issue 34)          -> OUT/gpu_touch.json
#   8. (key host, asked for by name) bench_gpu.py --host-cache: a table in host memory under a
#      GPU cache against fbgemm's TBE with the table in GPU memory -> OUT/gpu_host.json, gpu_host_profile.txt
#   9. (key larger, by name) bench_gpu.py --larger-than-gpu: a table larger than the GPU memory
#      left to it trains (on the H200 machine, whose host memory is the smaller, it holds part of
#      the GPU back first)                                       -> OUT/gpu_larger.json
# Each stage has a time budget, all together KVZCH_CHECK_BUDGET_S (default 500 s, so that a
# rerun fits a 15-minute lease); a stage that would start past it is skipped and said so.
# KVZCH_CHECK_STAGES picks stages by key (default all: kernel cuda serving bench job dmp
# pipelines; touch, host and larger only by name), e.g. "kernel serving" for a session that only has serving to check.
# KVZCH_CHECK_REHEARSE=1 runs it all on the CPU (small tables, gloo for NCCL) to check this
# script before GPU minutes are spent on it; that checks the plumbing, not CUDA.
set -uo pipefail
out=${1:?usage: tools/gpu/check.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/gpu.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning,ignore::DeprecationWarning
budget=${KVZCH_CHECK_BUDGET_S:-500}
work=$(mktemp -d)
failed=()

if [ "${KVZCH_CHECK_REHEARSE:-0}" = 1 ]; then
  dev=cpu; py=${PYTHON:-python3}
  export KVZCH_CUDA_TEST_DEVICE=cpu PYTHONPATH="$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}"
  bench=(--device cpu --rows 20000 40000 --batches 2048 512 --steps 5 --warmup 1)
  dmp=(--device cpu --batch 4096 --steps 5)
  serve=(--rows 100000 --steps 30 --reps 100)
  touch=(--device cpu --rows 5000 --batch 3000 --reps 1)
else
  dev=cuda; py=python3
  export KVZCH_REQUIRE_CUDA=1
  bench=(); dmp=(); serve=(); touch=()
fi

stages=" ${KVZCH_CHECK_STAGES:-kernel cuda serving bench job dmp pipelines} "

# stage KEY NAME SECONDS CMD...: runs CMD under what is left of its budget and of the total,
# if KEY is one of the stages asked for.
stage() {
  local key=$1 name=$2 want=$3; shift 3
  [[ "$stages" == *" $key "* ]] || return 0
  local left=$((budget - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${SECONDS}s of ${budget}s spent"; failed+=("$name (skipped)"); return 1
  fi
  [ "$want" -lt "$left" ] || want=$left
  echo "== $name (at ${SECONDS}s, up to ${want}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$want" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
  return "$rc"
}

finish() {
  echo "== done in ${SECONDS}s; failed: ${failed[*]:-none}"
  rm -rf "$work"
  exit $((${#failed[@]} > 0))
}

echo "== GPU check $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo '+changes')"
if [ "$dev" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || { failed+=(nvidia-smi); finish; }
  KVZCH_KIT=$PWD/.gpu . tools/gpu/setup.sh || { failed+=(setup); finish; }
fi

pytest=("$py" -m pytest -q -p no:cacheprovider -o addopts=-ra)
stage kernel "kernel tests" 150 "${pytest[@]}" tests/test_cuda.py tests/test_id_map.py -k "kernel or gpu" \
  --junitxml="$out/kernel.xml" || finish
stage cuda "CUDA tests" 200 "${pytest[@]}" tests/test_cuda.py -k "not kernel and not serving" --junitxml="$out/cuda.xml"
stage serving "serving tests" 150 "${pytest[@]}" tests/test_cuda.py -k serving --junitxml="$out/serving.xml"
stage serving "serving benchmark" 90 "$py" benchmarks/bench_serving.py --device "$dev" --lookups-only "${serve[@]}" \
  --json "$out/gpu_serving.json"
stage bench "benchmark" 170 "$py" benchmarks/bench_gpu.py "${bench[@]}" --json "$out/gpu.json" --plot "$out/gpu.png" \
  --profile "$out/gpu_profile.txt"

job() {  # train 40 steps with checkpoints, resume from step 40 on this device and on 2 CPU ranks
  local common=(--config quickstart --global-batch-size 2048 --checkpoint-every 20 --log-every 10)
  "$py" -m torch.distributed.run --standalone --nproc_per_node 1 -m torchrec_kvzch.job.train "${common[@]}" --device "$dev" \
    --steps 40 --run-dir "$work/job" --summary "$work/trained.json" || return 1
  cp -r "$work/job" "$work/job_cpu"
  "$py" -m torch.distributed.run --standalone --nproc_per_node 1 -m torchrec_kvzch.job.train "${common[@]}" --device "$dev" \
    --steps 50 --run-dir "$work/job" --summary "$work/resumed.json" || return 1
  "$py" -m torchrec_kvzch.job.train "${common[@]}" --device cpu --nproc 2 --steps 50 \
    --run-dir "$work/job_cpu" --summary "$work/resumed_cpu.json" || return 1
  "$py" tools/gpu/compare_job.py "$work" "$out/job.json"
}
export -f job; export dev py work out
stage job "job" 150 bash -c job
stage dmp "DMP benchmark" 90 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/bench_gpu.py --dmp "${dmp[@]}" \
  --json "$out/gpu_dmp.json"
stage pipelines "pipelines" 150 "${pytest[@]}" tests/test_pipelines.py -k "cuda or semi_sync_pipeline or prefetch_pipeline" \
  --junitxml="$out/pipelines.xml"
stage touch "touch A/B" 90 "$py" tools/gpu/touch_ab.py "${touch[@]}" --json "$out/gpu_touch.json"
# (the long runs last, after every test)
[ "$dev" = cuda ] && stage host "host-cache benchmark" 170 "$py" benchmarks/bench_gpu.py --host-cache --steps 40 \
  --warmup 10 --json "$out/gpu_host.json" --profile "$out/gpu_host_profile.txt"
[ "$dev" = cuda ] && stage larger "larger-than-GPU table" 300 "$py" benchmarks/bench_gpu.py --larger-than-gpu \
  --steps 10 --warmup 2 --json "$out/gpu_larger.json"
finish
