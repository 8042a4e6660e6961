#!/usr/bin/env python3
"""Deterministic random Real-ESRGAN checkpoints in the four published layouts, for measuring
the enhancers where the real files cannot be downloaded (the GPU run's `enhancers` stage,
bench/gpu_run.sh). Needs only PyTorch: the state dicts are built from the architectures' key
lists, not from the upstream classes (tests/reference/esrgan_reference.py builds them from
those, for the parity tests).

  realesr-general-x4v3.pth   SRVGGNetCompact, 64 features, 32 body convolutions, x4: {'params'}
  realesr-animevideov3.pth   the same with 16 body convolutions: {'params'}
  RealESRGAN_x4plus.pth      RRDBNet, 64 features, growth 32, 23 blocks, x4: {'params_ema'}
  RealESRGAN_x2plus.pth      the same, x2 (12 input channels: pixel-unshuffled): {'params_ema'}

Weights are normal with a standard deviation of 0.5 / sqrt(fan-in) (finite, bounded
activations; the speed does not depend on the values), biases 0.01, PReLU slopes 0.25.

  python3 bench/esrgan_checkpoints.py --out DIR [--only STEM ...]
"""
import argparse
import pathlib

import torch


def conv(state, gen, prefix, cin, cout):
    std = 0.5 / (cin * 9) ** 0.5
    state[f"{prefix}.weight"] = torch.randn(cout, cin, 3, 3, generator=gen) * std
    state[f"{prefix}.bias"] = torch.full((cout,), 0.01)


def compact(gen, num_conv, feat=64, upscale=4):
    state = {}
    for i in range(num_conv + 1):
        conv(state, gen, f"body.{2 * i}", 3 if i == 0 else feat, feat)
        state[f"body.{2 * i + 1}.weight"] = torch.full((feat,), 0.25)
    conv(state, gen, f"body.{2 * num_conv + 2}", feat, 3 * upscale * upscale)
    return state


def rrdb(gen, scale, blocks=23, feat=64, grow=32):
    state = {}
    conv(state, gen, "conv_first", 3 * (4 // scale) ** 2, feat)
    for b in range(blocks):
        for r in range(1, 4):
            for c in range(1, 6):
                cin = feat + (c - 1) * grow
                conv(state, gen, f"body.{b}.rdb{r}.conv{c}", cin, feat if c == 5 else grow)
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"]:
        conv(state, gen, name, feat, feat)
    conv(state, gen, "conv_last", feat, 3)
    return state


PUBLISHED = {
    "realesr-general-x4v3": (lambda g: compact(g, 32), "params"),
    "realesr-animevideov3": (lambda g: compact(g, 16), "params"),
    "RealESRGAN_x4plus": (lambda g: rrdb(g, 4), "params_ema"),
    "RealESRGAN_x2plus": (lambda g: rrdb(g, 2), "params_ema"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--only", nargs="*", default=None, choices=list(PUBLISHED))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for seed, (stem, (build, key)) in enumerate(PUBLISHED.items()):
        if a.only and stem not in a.only:
            continue
        gen = torch.Generator().manual_seed(1000 + seed)
        path = a.out / f"{stem}.pth"
        torch.save({key: build(gen)}, path)
        print(path)


if __name__ == "__main__":
    main()
