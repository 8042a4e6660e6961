#!/usr/bin/env bash
# Makes (once) a venv under target/torch-venv with PyTorch, numpy and OpenCV, for the tests that run
# the PyTorch yardstick (tests/bench.rs), the enhancers' references (tests/enhancer.rs) and the
# rehearsal of the GPU run's torch stage (bench/gpu_run.sh --rehearse). Prints the venv's python
# on stdout; progress goes to stderr.
# Beside it, in target/torch-venv/upstream, the upstream Real-ESRGAN, GFPGAN and RetinaFace
# files that tests/reference/esrgan_reference.py, gfpgan_reference.py and
# retinaface_reference.py load: the realesrgan 0.3.0, gfpgan 1.3.8 and facexlib 0.3.0 wheels
# and the basicsr 1.4.2 sdist from PyPI, checked against their SHA-256 (not installed: their
# package imports pull in more than the architectures, which the references replace with
# stand-ins). torchvision is installed (facexlib's RetinaFace builds its ResNet-50 with it).
# PyTorch's CPU-only index is tried first (a 200 MB wheel); where it cannot be reached, PyPI's
# wheel (CUDA libraries included, about 5 GB installed) is used: both compute on the CPU here.
#
#   LIPSYNC_TORCH_PYTHON=$(scripts/torch-venv.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$PWD/target/torch-venv
if ! "$venv/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  echo "torch-venv: installing PyTorch and numpy into $venv" >&2
  python3 -m venv "$venv"
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu --timeout 20 torch numpy >&2 2>/dev/null \
    || "${pip[@]}" torch numpy >&2
  "$venv/bin/python" -c 'import torch, numpy' >&2
fi
# OpenCV (headless) for the whole-frame reference (tests/reference/enhanced_frame_reference.py):
# cv2.resize and cv2.imread as the original pipeline uses them; and for the face alignment's
# (tests/reference/align_reference.py), which tests/image.rs compares bit for bit: pinned, as
# warpAffine's arithmetic changed in 4.11 (src/media/face/align.rs follows the new one).
opencv=5.0.0.93
if ! "$venv/bin/python" -c "import cv2, sys; sys.exit(cv2.__version__ != '${opencv%.*}')" 2>/dev/null; then
  echo "torch-venv: installing opencv-python-headless $opencv into $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "opencv-python-headless==$opencv" >&2
fi
# torchvision for facexlib's RetinaFace reference (its ResNet-50 and NMS), held to the torch
# already installed so pip never swaps it.
if ! "$venv/bin/python" -c 'import torchvision' 2>/dev/null; then
  echo "torch-venv: installing torchvision into $venv" >&2
  pin=$(mktemp)
  "$venv/bin/python" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' >"$pin"
  pip=("$venv/bin/pip" install -q --disable-pip-version-check -c "$pin")
  "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu --timeout 20 torchvision >&2 2>/dev/null \
    || "${pip[@]}" torchvision >&2
  rm -f "$pin"
  "$venv/bin/python" -c 'import torchvision' >&2
fi
upstream=$venv/upstream
if [ ! -f "$upstream/basicsr/archs/rrdbnet_arch.py" ] || [ ! -f "$upstream/realesrgan/archs/srvgg_arch.py" ] \
  || [ ! -f "$upstream/gfpgan/archs/gfpganv1_clean_arch.py" ] \
  || [ ! -f "$upstream/facexlib/detection/retinaface.py" ]; then
  echo "torch-venv: fetching the upstream Real-ESRGAN, GFPGAN and RetinaFace files into $upstream" >&2
  "$venv/bin/python" - "$upstream" >&2 <<'PY'
import hashlib, io, json, pathlib, sys, tarfile, urllib.request, zipfile
out = pathlib.Path(sys.argv[1])
# (project, version, file, SHA-256); the file's address comes from PyPI's JSON API.
files = [
    ("realesrgan", "0.3.0", "realesrgan-0.3.0-py3-none-any.whl",
     "59336c16c30dd5130eff350dd27424acb9b7281d18a6810130e265606c9a6088"),
    ("basicsr", "1.4.2", "basicsr-1.4.2.tar.gz",
     "b89b595a87ef964cda9913b4d99380ddb6554c965577c0c10cb7b78e31301e87"),
    ("gfpgan", "1.3.8", "gfpgan-1.3.8-py3-none-any.whl",
     "3d8386df6320aa9dfb0dd4cd09d9f8ed12ae0bbd9b2df257c3d21aefac5d8b85"),
    ("facexlib", "0.3.0", "facexlib-0.3.0-py3-none-any.whl",
     "245d58861537b820c616e8b3ef618ccfad2a24724a2d74be2b0542643c01a878"),
]
wanted = {"realesrgan/archs/srvgg_arch.py", "basicsr/archs/rrdbnet_arch.py", "basicsr/archs/arch_util.py",
          "gfpgan/archs/gfpganv1_clean_arch.py", "gfpgan/archs/stylegan2_clean_arch.py",
          "facexlib/detection/retinaface.py", "facexlib/detection/retinaface_net.py",
          "facexlib/detection/retinaface_utils.py", "facexlib/detection/align_trans.py",
          "facexlib/detection/matlab_cp2tform.py"}
for project, version, name, sha in files:
    meta = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/{project}/json", timeout=60))
    url = next(u["url"] for u in meta["releases"][version] if u["filename"] == name)
    data = urllib.request.urlopen(url, timeout=60).read()
    if hashlib.sha256(data).hexdigest() != sha:
        sys.exit(f"{url}: SHA-256 mismatch")
    if name.endswith(".whl"):
        z = zipfile.ZipFile(io.BytesIO(data))
        members = {n: z.read(n) for n in z.namelist()}
    else:
        t = tarfile.open(fileobj=io.BytesIO(data))
        members = {m.name.split("/", 1)[1]: t.extractfile(m).read() for m in t.getmembers() if m.isfile() and "/" in m.name}
    for name in wanted & members.keys():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(members[name])
missing = [n for n in wanted if not (out / n).is_file()]
if missing:
    sys.exit(f"upstream files missing: {missing}")
PY
fi
echo "$venv/bin/python"
