#!/usr/bin/env python3
"""Deterministic random enhancer checkpoints in the published layouts, for measuring the
enhancers where the real files cannot be downloaded (the GPU run's `enhancers` stage,
bench/gpu_run.sh). Needs only PyTorch: the state dicts are built from the architectures' key
lists, not from the upstream classes (tests/reference/esrgan_reference.py and
gfpgan_reference.py build them from those, for the parity tests).

  realesr-general-x4v3.pth   SRVGGNetCompact, 64 features, 32 body convolutions, x4: {'params'}
  realesr-animevideov3.pth   the same with 16 body convolutions: {'params'}
  RealESRGAN_x4plus.pth      RRDBNet, 64 features, growth 32, 23 blocks, x4: {'params_ema'}
  RealESRGAN_x2plus.pth      the same, x2 (12 input channels: pixel-unshuffled): {'params_ema'}
  GFPGANv1.4.pth             GFPGANv1Clean, 512, channel multiplier 2: {'params_ema'}, 285
                             tensors (the 15 noise buffers and the unused style MLP included),
                             legacy (non-zip) torch.save as published

Weights are normal with a standard deviation of 0.5 / sqrt(fan-in) (finite, bounded
activations; the speed does not depend on the values), biases 0.01, PReLU slopes 0.25;
GFPGAN's modulation biases 1 and its noise weights 0.1, as trained files have them near.

  python3 bench/enhancer_checkpoints.py --out DIR [--only STEM ...]
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


def gfpgan(gen):
    """GFPGANv1Clean (out_size 512, channel_multiplier 2, sft_half): the published keys."""
    state = {}

    def rand(*shape, fan_in):
        return torch.randn(*shape, generator=gen) * (0.5 / fan_in**0.5)

    def conv_k(prefix, cin, cout, k, bias=True):
        state[f"{prefix}.weight"] = rand(cout, cin, k, k, fan_in=cin * k * k)
        if bias:
            state[f"{prefix}.bias"] = torch.full((cout,), 0.01)

    decoder = {4: 512, 8: 512, 16: 512, 32: 512, 64: 512, 128: 256, 256: 128, 512: 64}
    unet = {s: c // 2 for s, c in decoder.items()}
    sides = [8, 16, 32, 64, 128, 256, 512]
    conv_k("conv_body_first", 3, unet[512], 1)
    for j, s in enumerate(reversed(sides)):
        cin, cout = unet[s], unet[s // 2]
        conv_k(f"conv_body_down.{j}.conv1", cin, cin, 3)
        conv_k(f"conv_body_down.{j}.conv2", cin, cout, 3)
        conv_k(f"conv_body_down.{j}.skip", cin, cout, 1, bias=False)
    conv_k("final_conv", unet[4], unet[4], 3)
    for j, s in enumerate(sides):
        cin, cout = unet[s // 2], unet[s]
        conv_k(f"conv_body_up.{j}.conv1", cin, cin, 3)
        conv_k(f"conv_body_up.{j}.conv2", cin, cout, 3)
        conv_k(f"conv_body_up.{j}.skip", cin, cout, 1, bias=False)
    for j, s in enumerate(sides):
        conv_k(f"toRGB.{j}", unet[s], 3, 1)
    state["final_linear.weight"] = rand(16 * 512, unet[4] * 16, fan_in=unet[4] * 16)
    state["final_linear.bias"] = torch.full((16 * 512,), 0.01)
    d = "stylegan_decoder"
    for m in range(1, 16, 2):
        state[f"{d}.style_mlp.{m}.weight"] = rand(512, 512, fan_in=512)
        state[f"{d}.style_mlp.{m}.bias"] = torch.zeros(512)
    state[f"{d}.constant_input.weight"] = torch.randn(1, 512, 4, 4, generator=gen)

    def modulated(prefix, cin, cout, k):
        state[f"{prefix}.modulated_conv.weight"] = rand(1, cout, cin, k, k, fan_in=cin * k * k)
        state[f"{prefix}.modulated_conv.modulation.weight"] = rand(cin, 512, fan_in=512)
        state[f"{prefix}.modulated_conv.modulation.bias"] = torch.ones(cin)

    def style_conv(prefix, cin, cout):
        modulated(prefix, cin, cout, 3)
        state[f"{prefix}.weight"] = torch.full((1,), 0.1)
        state[f"{prefix}.bias"] = torch.full((1, cout, 1, 1), 0.01)

    def to_rgb(prefix, cin):
        modulated(prefix, cin, 3, 1)
        state[f"{prefix}.bias"] = torch.full((1, 3, 1, 1), 0.01)

    style_conv(f"{d}.style_conv1", 512, 512)
    to_rgb(f"{d}.to_rgb1", 512)
    for j, s in enumerate(sides):
        cin, cout = decoder[s // 2], decoder[s]
        style_conv(f"{d}.style_convs.{2 * j}", cin, cout)
        style_conv(f"{d}.style_convs.{2 * j + 1}", cout, cout)
        to_rgb(f"{d}.to_rgbs.{j}", cout)
    for n in range(15):
        side = 2 ** ((n + 5) // 2)
        state[f"{d}.noises.noise{n}"] = torch.randn(1, 1, side, side, generator=gen)
    for j, s in enumerate(sides):
        c = unet[s]
        for which in ["condition_scale", "condition_shift"]:
            conv_k(f"{which}.{j}.0", c, c, 3)
            conv_k(f"{which}.{j}.2", c, c, 3)
    assert len(state) == 285, len(state)
    return state


PUBLISHED = {
    "realesr-general-x4v3": (lambda g: compact(g, 32), "params"),
    "realesr-animevideov3": (lambda g: compact(g, 16), "params"),
    "RealESRGAN_x4plus": (lambda g: rrdb(g, 4), "params_ema"),
    "RealESRGAN_x2plus": (lambda g: rrdb(g, 2), "params_ema"),
    "GFPGANv1.4": (gfpgan, "params_ema"),
}
# Saved as published: GFPGAN's files are legacy (non-zip) torch.save.
LEGACY = {"GFPGANv1.4"}


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
        torch.save(
            {key: build(gen)}, path, _use_new_zipfile_serialization=stem not in LEGACY
        )
        print(path)


if __name__ == "__main__":
    main()
