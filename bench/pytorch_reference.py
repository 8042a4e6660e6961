#!/usr/bin/env python3
"""Wav2Lip in PyTorch at the batch sizes `lipsync bench` measures: the reference the Python
services run (eager with cudnn.benchmark, and torch.compile), in the same run on the same machine.

    python3 bench/pytorch_reference.py --device cuda --dtypes f32,f16,bf16 \
        --batches 1,16,64,128,256,512 --compile --json pytorch.json

Weights: --checkpoint (legacy or zip torch.save, or safetensors), else random (speed does not
depend on the values). The model is tests/reference/wav2lip_reference.py's definition.
Reports frames/s (model only; inputs already on the device; synchronised after each batch).
"""

import argparse
import json
import os
import struct
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
from wav2lip_reference import Wav2Lip  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def load_state_dict(path):
    with open(path, "rb") as f:
        head = f.read(16)
    if head[8:9] == b"{":  # safetensors
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
        sd = {}
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            sd[k] = torch.frombuffer(bytearray(data[a:b]), dtype=names[v["dtype"]]).reshape(v["shape"])
        return sd
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(ck, torch.nn.Module):
        ck = ck.state_dict()
    sd = ck.get("state_dict", ck)
    return {k.removeprefix("module."): v for k, v in sd.items()}


def measure(fn, seconds, sync):
    fn()
    fn()
    sync()
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < seconds:
        fn()
        sync()
        runs += 1
    return runs, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="f32")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--compile", action="store_true", help="also measure torch.compile")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = Wav2Lip()
    if args.checkpoint:
        model.load_state_dict(load_state_dict(args.checkpoint), strict=False)
    model.eval()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    modes = ["eager"] + (["compile"] if args.compile else [])
    print(f"## PyTorch {torch.__version__} on {dev} (frames/s)\n")
    print("| mode | dtype | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        m = Wav2Lip()
        m.load_state_dict(model.state_dict())
        m = m.to(dev, dtype).eval()
        for mode in modes:
            net = torch.compile(m) if mode == "compile" else m
            cells = []
            for b in batches:
                mel = torch.randn(b, 1, 80, 16, device=dev, dtype=dtype)
                face = torch.rand(b, 6, 96, 96, device=dev, dtype=dtype)

                def step():
                    with torch.no_grad():
                        net(mel, face)

                runs, t = measure(step, args.seconds, sync)
                fps = runs * b / t
                rows.append({"mode": mode, "dtype": name, "batch": b, "fps": fps})
                cells.append(f"{fps:.1f}")
            print(f"| {mode} | {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
