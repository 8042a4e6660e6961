#!/usr/bin/env python3
"""Wav2Lip in PyTorch at the batch sizes `lipsync bench` measures: the yardstick a Python
service would run, made as fast and as fair as PyTorch allows, in the same run on the same
machine.

    python3 bench/pytorch_reference.py --checkpoint w.safetensors --device cuda \
        --dtypes f32,f16,bf16 --layouts nchw,channels_last --batches 1,16,64,256,512 \
        --compile --max-autotune --json pytorch.json

What it measures, in this order (each row printed as soon as it is measured, so a run stopped
by a time limit keeps what it measured):
1. eager frames/s for every dtype, memory layout (NCHW, and channels-last: cuDNN's fast layout
   for f16/bf16 on recent GPUs) and batch, under torch.inference_mode() with
   cudnn.benchmark=True; TF32 is off (matmul and cuDNN), so the f32 rows are real f32;
2. the face PSNR (faces in 0-1) and largest difference of every dtype and layout against
   PyTorch's own f32 NCHW on the same inputs: the bench's accuracy inputs (--inputs, written
   by `lipsync bench --accuracy-inputs`), else deterministic ones from a fixed seed;
3. with --compile: torch.compile per batch size (dynamic=False, default mode,
   torch._dynamo.reset() between sizes, so each size gets its own static graph), for
   --compile-dtypes x --compile-layouts;
4. with --max-autotune: torch.compile(mode="max-autotune") for f16 channels-last at the
   largest batch only (its compile takes minutes).
--budget SECONDS skips the compile runs not started within that time (said in the output).

Weights: --checkpoint (legacy or zip torch.save, or safetensors such as `lipsync init-weights`
writes; every Wav2Lip tensor must be there, unfolded), else random (speed does not depend on
the values). The model is tests/reference/wav2lip_reference.py's definition. Frames/s are
model only: inputs already on the device, synchronised after each batch.
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
from wav2lip_reference import Wav2Lip  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
SEED = 20201


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        if v["dtype"] not in names:
            raise SystemExit(f"{path}: tensor {k} has unsupported dtype {v['dtype']}")
        out[k] = torch.frombuffer(bytearray(data[a:b]), dtype=names[v["dtype"]]).reshape(v["shape"])
    return out


def load_state_dict(path):
    with open(path, "rb") as f:
        head = f.read(16)
    if head[8:9] == b"{":  # safetensors
        return read_safetensors(path)
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(ck, torch.nn.Module):
        ck = ck.state_dict()
    sd = ck.get("state_dict", ck)
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_weights(model, path):
    """Loads every Wav2Lip tensor from `path` (BatchNorm's num_batches_tracked may be absent);
    refuses folded or foreign checkpoints instead of running with default values."""
    sd = {k: v.float() for k, v in load_state_dict(path).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        hint = " (BatchNorm folded? use an unfolded checkpoint)" if any("conv_block.1" in k for k in missing) else ""
        raise SystemExit(
            f"{path}: {len(missing)} Wav2Lip tensors missing{hint}, {len(unexpected)} unexpected; "
            f"first missing: {missing[:3]}, first unexpected: {unexpected[:3]}"
        )


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


def unusable(dtype, dev):
    """Why convolutions in `dtype` cannot run on `dev`, or None when they can."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype, device=dev)
        w = torch.ones(2, 2, 3, 3, dtype=dtype, device=dev)
        with torch.inference_mode():
            torch.nn.functional.conv2d(x, w, padding=1)
            torch.nn.functional.conv_transpose2d(x, w, stride=2)
        return None
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]


def psnr(a, b):
    mse = (a.float() - b.float()).pow(2).mean().item()
    return math.inf if mse == 0 else -10 * math.log10(mse)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="f32")
    ap.add_argument("--layouts", default="nchw,channels_last", help="nchw and/or channels_last")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads) [torch's default]")
    ap.add_argument("--inputs", help="accuracy inputs (`lipsync bench --accuracy-inputs`)")
    ap.add_argument("--accuracy-frames", type=int, help="frames of the seeded accuracy inputs [32 on cuda, 4 on cpu]")
    ap.add_argument("--compile", action="store_true", help="also torch.compile per batch size")
    ap.add_argument("--compile-dtypes", help="dtypes compiled [all measured]")
    ap.add_argument("--compile-layouts", help="layouts compiled [all measured]")
    ap.add_argument("--max-autotune", action="store_true",
                    help='also mode="max-autotune", f16 channels-last, largest batch (minutes)')
    ap.add_argument("--budget", type=float, default=0.0, help="seconds after which compile runs are skipped (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="the kernels by time (torch.profiler) of the default compile at the largest batch, "
                         "or of the last eager model there when no compile ran")
    ap.add_argument("--json")
    args = ap.parse_args()
    started = time.perf_counter()

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.backends.cudnn.benchmark = True
    # f32 rows are real f32: no TF32 in matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batches = [int(b) for b in args.batches.split(",")]
    layouts = args.layouts.split(",")
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            raise SystemExit(f"unknown dtype {name} (f32, f16, bf16)")
    for name in layouts:
        if name not in LAYOUTS:
            raise SystemExit(f"unknown layout {name} (nchw, channels_last)")

    base = Wav2Lip()
    if args.checkpoint:
        load_weights(base, args.checkpoint)
    base.eval()
    state = base.state_dict()

    dtypes, skipped = [], []
    for name in args.dtypes.split(","):
        why = unusable(DTYPES[name], dev)
        if why:
            skipped.append({"dtype": name, "reason": why})
        else:
            dtypes.append(name)

    def make(name, layout):
        m = Wav2Lip()
        m.load_state_dict(state)
        return m.to(dev, DTYPES[name]).to(memory_format=LAYOUTS[layout]).eval()

    def place(t, name, layout):
        return t.to(dev, DTYPES[name]).contiguous(memory_format=LAYOUTS[layout])

    gen = torch.Generator(device="cpu").manual_seed(SEED)

    def profile_inputs(n, name, layout):
        # Their own generator: the profile must not move the seeded inputs of other runs.
        g = torch.Generator().manual_seed(SEED + 1)
        mel = torch.randn(n, 1, 80, 16, generator=g)
        face = torch.rand(n, 6, 96, 96, generator=g)
        return place(mel, name, layout), place(face, name, layout)

    def random_inputs(n):
        return torch.randn(n, 1, 80, 16, generator=gen), torch.rand(n, 6, 96, 96, generator=gen)

    results = {
        "torch": torch.__version__,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "threads": torch.get_num_threads(),
        "tf32": False,
        "checkpoint": args.checkpoint,
        "skipped_dtypes": skipped,
        "rows": [],
        "accuracy": [],
        "skipped_runs": [],
    }

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    where = f"{dev} ({results['gpu']}, cuDNN {results['cudnn']})" if cuda else f"{dev} ({results['threads']} threads)"
    print(f"## PyTorch {torch.__version__} on {where}: frames/s, TF32 off, cudnn.benchmark, inference_mode\n")
    for s in skipped:
        print(f"{s['dtype']} skipped: its convolutions do not run on {dev} ({s['reason']})\n")
    print("| dtype | layout | mode | batch | frames/s |")
    print("|---|---|---|---|---|")

    def run(net, name, layout, mode, b, show_first=False):
        mel, face = random_inputs(b)
        mel, face = place(mel, name, layout), place(face, name, layout)

        def step():
            with torch.inference_mode():
                net(mel, face)

        t = time.perf_counter()
        with torch.inference_mode():
            net(mel, face)  # compiles, for compiled modes
        sync()
        first = time.perf_counter() - t
        runs, secs = measure(step, args.seconds, sync)
        fps = runs * b / secs
        row = {"dtype": name, "layout": layout, "mode": mode, "batch": b, "fps": fps,
               "first_call_seconds": first}
        results["rows"].append(row)
        extra = f" {first:.1f} s |" if show_first else ""
        print(f"| {name} | {layout} | {mode} | {b} | {fps:.1f} |{extra}", flush=True)
        save()

    # 1. Eager.
    for name in dtypes:
        for layout in layouts:
            net = make(name, layout)
            for b in batches:
                run(net, name, layout, "eager", b)
            del net

    # 2. Accuracy against PyTorch's own f32 NCHW on the same inputs.
    if args.inputs:
        t = read_safetensors(args.inputs)
        mel, face = t["mel"].float(), t["face"].float()
        source = f"{args.inputs} ({mel.shape[0]} frames)"
    else:
        n = args.accuracy_frames or (32 if cuda else 4)
        mel, face = random_inputs(n)
        source = f"{n} frames from seed {SEED} (mel N(0,1), faces uniform in 0-1)"
    with torch.inference_mode():
        reference = make("f32", "nchw")(place(mel, "f32", "nchw"), place(face, "f32", "nchw")).float().cpu()
        print(f"\n## PyTorch accuracy: faces against its own f32 NCHW (TF32 off), inputs {source}\n")
        print("| dtype | layout | PSNR | max difference |")
        print("|---|---|---|---|")
        if dtypes == ["f32"] and layouts == ["nchw"]:
            print("| (only the reference itself was measured) | | | |")
        for name in dtypes:
            for layout in layouts:
                if (name, layout) == ("f32", "nchw"):
                    continue
                out = make(name, layout)(place(mel, name, layout), place(face, name, layout)).float().cpu()
                p = psnr(out, reference)
                mx = (out - reference).abs().max().item()
                results["accuracy"].append({"dtype": name, "layout": layout, "inputs": source,
                                            "psnr_db": None if math.isinf(p) else p, "max_diff": mx})
                print(f"| {name} | {layout} | {p:.1f} dB | {mx:.2e} |", flush=True)
    save()

    # 3. and 4. torch.compile: one static graph per batch size.
    compiled = []
    if args.compile:
        cd = (args.compile_dtypes or ",".join(dtypes)).split(",")
        cl = (args.compile_layouts or ",".join(layouts)).split(",")
        # Largest batches first: when the budget stops the compile runs, the batch that
        # matters most (the service's) has been measured.
        compiled += [(n, l, "compile", "default", b) for n in dtypes if n in cd for l in layouts if l in cl
                     for b in sorted(batches, reverse=True)]
    if args.max_autotune:
        if "f16" in dtypes:
            # Right after the default compile at the largest batch (the row it is compared with).
            compiled.insert(min(1, len(compiled)), ("f16", "channels_last", "max-autotune", "max-autotune", max(batches)))
        else:
            results["skipped_runs"].append({"mode": "max-autotune", "reason": "f16 not measured here"})
            print("\nmax-autotune skipped: it runs f16 channels-last, and f16 is not measured here")
    if compiled:
        print("\n## PyTorch torch.compile (dynamic=False, one graph per batch size; frames/s)\n")
        print("| dtype | layout | mode | batch | frames/s | first call (compiles) |")
        print("|---|---|---|---|---|---|")
    for name, layout, label, mode, b in compiled:
        spent = time.perf_counter() - started
        if args.budget and spent > args.budget:
            results["skipped_runs"].append({"dtype": name, "layout": layout, "mode": label, "batch": b,
                                            "reason": f"--budget {args.budget:.0f} s spent"})
            print(f"| {name} | {layout} | {label} | {b} | skipped: --budget {args.budget:.0f} s spent | |", flush=True)
            continue
        torch._dynamo.reset()
        net = torch.compile(make(name, layout), dynamic=False, mode=None if mode == "default" else mode)
        run(net, name, layout, label, b, show_first=True)
        if args.profile and label == "compile" and b == max(batches):
            profile_kernels(net, "compile", name, layout, b, *profile_inputs(b, name, layout), cuda)
            args.profile = False
        del net
    if args.profile:
        # No compile at the largest batch ran (not asked for, or past --budget): the eager
        # model, so the table is never missing silently.
        name, layout, b = dtypes[-1], layouts[-1], max(batches)
        profile_kernels(make(name, layout), "eager", name, layout, b, *profile_inputs(b, name, layout), cuda)
    save()


def profile_kernels(net, mode, name, layout, b, mel, face, cuda=True):
    """The model's kernels at batch `b` on the inputs `mel`, `face` (placed for the model):
    total time per kernel over 3 passes (torch.profiler; CUDA kernels on a GPU, CPU operators
    otherwise), the top 30, as Markdown: where PyTorch (`mode`: compile or eager) spends its
    time, to set beside `lipsync bench --sections compare`'s per-layer table."""
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.inference_mode():
        net(mel, face)
        sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(3):
                net(mel, face)
            sync()
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    what = "CUDA kernels" if cuda else "CPU operators"
    print(f"\n## PyTorch {mode}: its {what} ({name}, {layout}, batch {b}; 3 passes; µs per frame per pass)\n")
    print("| kernel | calls per pass | µs per frame | share |")
    print("|---|---|---|---|")
    for t, count, key in rows[:30]:
        k = key.replace("|", "/")[:90]
        print(f"| {k} | {count / 3:.0f} | {t / 3 / b:.3f} | {100 * t / max(total, 1e-9):.1f} % |")
    print(f"| all | | {total / 3 / b:.3f} | 100 % |", flush=True)


if __name__ == "__main__":
    main()
