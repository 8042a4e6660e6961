#!/usr/bin/env python3
"""PyTorch reference for lipsync's GFPGAN (src/model/enhancer/gfpgan.rs), run by
tests/enhancer.rs at test time.

Makes a deterministic random GFPGANv1.4-layout checkpoint and the upstream network's output on
an image, into --out:

  GFPGANv1.4.pth   GFPGANv1Clean(out_size=512, channel_multiplier=2, input_is_latent, different_w,
                   sft_half): a legacy (non-zip) torch.save of {'params_ema': state}, 285 tensors
                   with the 15 noise buffers, as the published file (about 349 MB)
  output.f32       the network's output on --input, (3, 512, 512) float32: GFPGANer's
                   post-processing before rounding, clamp to [-1, 1] then (x + 1) / 2
  expected.json    the fraction of values the clamp changed

The reference is the upstream class called directly, as GFPGANer calls it
(`net(x, return_rgb=False, randomize_noise=False)` on `(x/255 - 0.5) / 0.5`):
gfpganv1_clean_arch.py and stylegan2_clean_arch.py from the gfpgan 1.3.8 wheel, loaded by path
from --upstream (scripts/torch-venv.sh fetches it). Their imports of basicsr (the registry and
default_init_weights) are replaced by small stand-ins.

Random weights that keep the signal alive through 14 modulated layers: PyTorch's default
initialisation, then every bias and every StyleConv noise weight drawn (the defaults are zero,
which would leave the stored noise unused).

  python gfpgan_reference.py --upstream DIR --out DIR --input FILE.rgb [--time N]
(raw 8-bit RGB, 512x512, rows top to bottom). `--time N` also times N more forward passes on
the CPU (after the first) and reports the median seconds per face on stderr and in
expected.json (`seconds_per_face`), for docs/BENCHMARKS.md.
"""
import argparse
import json
import math
import pathlib
import sys
import time
import types

import numpy as np
import torch

from upstream_module import load


def load_upstream(root: pathlib.Path):
    class Registry:
        def register(self, *a, **k):
            return lambda cls: cls

    def default_init_weights(module_list, scale=1, bias_fill=0, **kwargs):
        if not isinstance(module_list, list):
            module_list = [module_list]
        for module in module_list:
            for m in module.modules():
                if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                    torch.nn.init.kaiming_normal_(m.weight, **kwargs)
                    m.weight.data *= scale
                    if m.bias is not None:
                        m.bias.data.fill_(bias_fill)

    stubs = {
        "basicsr": types.ModuleType("basicsr"),
        "basicsr.utils": types.ModuleType("basicsr.utils"),
        "basicsr.utils.registry": types.ModuleType("basicsr.utils.registry"),
        "basicsr.archs": types.ModuleType("basicsr.archs"),
        "basicsr.archs.arch_util": types.ModuleType("basicsr.archs.arch_util"),
        "gfpgan": types.ModuleType("gfpgan"),
        "gfpgan.archs": types.ModuleType("gfpgan.archs"),
    }
    stubs["basicsr.utils.registry"].ARCH_REGISTRY = Registry()
    stubs["basicsr.archs.arch_util"].default_init_weights = default_init_weights
    stubs["gfpgan.archs"].__path__ = [str(root / "gfpgan" / "archs")]
    sys.modules.update(stubs)

    load("gfpgan.archs.stylegan2_clean_arch", root / "gfpgan" / "archs" / "stylegan2_clean_arch.py")
    return load("gfpgan.archs.gfpganv1_clean_arch", root / "gfpgan" / "archs" / "gfpganv1_clean_arch.py")


def new_net(arch):
    """GFPGANv1Clean as GFPGANer builds it for v1.3 / v1.4."""
    return arch.GFPGANv1Clean(
        out_size=512,
        num_style_feat=512,
        channel_multiplier=2,
        decoder_load_path=None,
        fix_decoder=False,
        num_mlp=8,
        input_is_latent=True,
        different_w=True,
        narrow=1,
        sft_half=True,
    ).eval()


def random_net(arch):
    """The deterministic random network the tests use (see the module's docstring)."""
    torch.manual_seed(38)
    net = new_net(arch)
    g = torch.Generator().manual_seed(1038)
    with torch.no_grad():
        for name, t in net.named_parameters():
            if name.endswith("bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith(".weight") and t.numel() == 1:
                # A StyleConv's noise weight.
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
        for name, b in net.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g))
    return net


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--time", type=int, default=0)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arch = load_upstream(pathlib.Path(args.upstream))
    net = random_net(arch)
    state = net.state_dict()
    assert len(state) == 285, len(state)
    torch.save({"params_ema": state}, out / "GFPGANv1.4.pth", _use_new_zipfile_serialization=False)

    rgb = np.fromfile(args.input, dtype=np.uint8).reshape(512, 512, 3)
    x = torch.from_numpy(rgb.astype(np.float32) / 255.0).permute(2, 0, 1).unsqueeze(0)
    x = (x - 0.5) / 0.5
    with torch.no_grad():
        y = net(x, return_rgb=False, randomize_noise=False)[0]
    clamped = (y.abs() > 1).float().mean().item()
    y = (y.clamp(-1, 1) + 1) / 2
    y[0].numpy().astype(np.float32).tofile(out / "output.f32")
    expected = {"clamped_fraction": clamped, "std": float(y.std())}
    if args.time:
        times = []
        with torch.no_grad():
            for _ in range(args.time):
                start = time.perf_counter()
                net(x, return_rgb=False, randomize_noise=False)
                times.append(time.perf_counter() - start)
        expected["seconds_per_face"] = sorted(times)[len(times) // 2]
        print(
            f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} threads: "
            f"{expected['seconds_per_face']:.3f} s per face (median of {len(times)})",
            file=sys.stderr,
        )
    (out / "expected.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main()
