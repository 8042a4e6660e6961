#!/usr/bin/env python3
"""PyTorch reference for lipsync's Real-ESRGAN enhancers, run by tests/enhancer.rs at test time.

Makes deterministic random checkpoints in each published layout and the upstream networks'
output on an image, into --out:

  realesr-general-x4v3.pth   SRVGGNetCompact(num_conv=32), zip torch.save of {'params': state}
  realesr-animevideov3.pth   SRVGGNetCompact(num_conv=16), {'params': state}
  RealESRGAN_x4plus.pth      RRDBNet(scale=4, 23 blocks), {'params_ema': state}
  RealESRGAN_x2plus.pth      RRDBNet(scale=2, 23 blocks), {'params_ema': state, 'params': other}
                             (both keys, as training checkpoints hold them: params_ema is the one;
                             the published x2plus holds params_ema only)
  <stem>.<input>.f32         the network's output on each --input: (3, H·s, W·s) float32,
                             clamped to [0, 1] (Real-ESRGAN's post-processing before rounding)
  expected.json              per file and input: shape of the output, fraction of clamped values

The references are the upstream architecture classes called directly (not the RealESRGANer
wrapper, which pads, tiles and casts to half): srvgg_arch.py from the realesrgan 0.3.0 wheel and
rrdbnet_arch.py + arch_util.py from the basicsr 1.4.2 sdist, loaded by path from --upstream
(scripts/torch-venv.sh fetches them). Their package imports (the registry, deformable convolution
ops, logging) are replaced by small stand-ins; the networks' code runs as published.

  python esrgan_reference.py --upstream DIR --out DIR --input NAME=WxH:FILE.rgb ... \
      [--only STEM[:INPUT,...] ...]

An input is raw 8-bit RGB, rows top to bottom (what the test decodes from its PNG), read as
`/ 255` in f32, NCHW. `--only RealESRGAN_x4plus:face` runs that model on that input only.
"""
import argparse
import json
import pathlib
import sys
import types

import numpy as np
import torch

from upstream_module import load


def load_upstream(root: pathlib.Path):
    """SRVGGNetCompact and RRDBNet from the upstream files, with stand-ins for their imports."""

    class Registry:
        def register(self, *a, **k):
            return lambda cls: cls

    stubs = {
        "basicsr": types.ModuleType("basicsr"),
        "basicsr.utils": types.ModuleType("basicsr.utils"),
        "basicsr.utils.registry": types.ModuleType("basicsr.utils.registry"),
        "basicsr.ops": types.ModuleType("basicsr.ops"),
        "basicsr.ops.dcn": types.ModuleType("basicsr.ops.dcn"),
        "basicsr.archs": types.ModuleType("basicsr.archs"),
    }
    stubs["basicsr.utils.registry"].ARCH_REGISTRY = Registry()
    stubs["basicsr.utils"].get_root_logger = lambda *a, **k: None
    # arch_util imports the deformable convolution ops; RRDBNet never uses them.
    stubs["basicsr.ops.dcn"].ModulatedDeformConvPack = torch.nn.Module
    stubs["basicsr.ops.dcn"].modulated_deform_conv = None
    stubs["basicsr.archs"].__path__ = [str(root / "basicsr" / "archs")]
    # arch_util also imports torchvision and distutils (Python < 3.12) for the deformable
    # convolution's version check only.
    stubs["torchvision"] = types.ModuleType("torchvision")
    stubs["torchvision"].__version__ = "0.0"
    try:
        import distutils.version  # noqa: F401
    except ImportError:
        stubs["distutils"] = types.ModuleType("distutils")
        stubs["distutils.version"] = types.ModuleType("distutils.version")
        stubs["distutils.version"].LooseVersion = str
    sys.modules.update(stubs)

    load("basicsr.archs.arch_util", root / "basicsr" / "archs" / "arch_util.py")
    rrdb = load("basicsr.archs.rrdbnet_arch", root / "basicsr" / "archs" / "rrdbnet_arch.py")
    srvgg = load("realesrgan_srvgg_arch", root / "realesrgan" / "archs" / "srvgg_arch.py")
    return srvgg.SRVGGNetCompact, rrdb.RRDBNet


def randomise(net: torch.nn.Module, seed: int, last: str, last_scale: float, centre: bool):
    """Deterministic random weights: each tensor N(0, 1/fan_in) (PReLU slopes in [0, 0.5]),
    biases small, the last convolution scaled by `last_scale` so the output stays mostly inside
    [0, 1] and the clamp hides little. `centre` (RRDBNet, whose output is not a residual on
    the input): the last convolution is then rescaled so that, on a fixed random image, the
    output has mean 0.5 and standard deviation `last_scale`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / fan_in) ** 0.5)
            elif p.dim() == 1 and name.endswith(".weight"):  # PReLU
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            if name.startswith(last) and not centre:
                p.mul_(last_scale)
        if centre:
            calib = torch.rand((1, 3, 32, 32), generator=g)
            y = net(calib)
            k = last_scale / float(y.std())
            conv = dict(net.named_modules())[last]
            conv.weight.mul_(k)
            conv.bias.mul_(k).add_(0.5 - float(y.mean()) * k)


def published(SRVGGNetCompact, RRDBNet):
    """The four published networks: stem -> (constructor, top-level key, seed, last
    convolution, its scale, centre) for `randomise` and `save_checkpoint`."""
    return {
    "realesr-general-x4v3": (
        lambda: SRVGGNetCompact(num_in_ch=3, num_out_ch=3, num_feat=64, num_conv=32,
                                upscale=4, act_type="prelu"), "params", 1, "body.66", 0.1, False),
    "realesr-animevideov3": (
        lambda: SRVGGNetCompact(num_in_ch=3, num_out_ch=3, num_feat=64, num_conv=16,
                                upscale=4, act_type="prelu"), "params", 2, "body.34", 0.1, False),
    "RealESRGAN_x4plus": (
        lambda: RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32,
                        scale=4), "params_ema", 3, "conv_last", 0.15, True),
    "RealESRGAN_x2plus": (
        lambda: RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32,
                        scale=2), "params_ema+params", 4, "conv_last", 0.15, True),
}


def save_checkpoint(models, stem: str, out: pathlib.Path) -> torch.nn.Module:
    """Writes `out/<stem>.pth` in the published layout with deterministic random weights and
    returns the network (in eval mode) holding them."""
    make, key, seed, last, last_scale, centre = models[stem]
    net = make().eval()
    randomise(net, seed, last, last_scale, centre)
    state = net.state_dict()
    if key == "params_ema+params":
        # Both copies, as training checkpoints hold them: params_ema is the one to use.
        other = make().eval()
        randomise(other, seed + 100, last, last_scale, centre)
        saved = {"params_ema": state, "params": other.state_dict()}
    else:
        saved = {key: state}
    torch.save(saved, out / f"{stem}.pth")
    return net


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, type=pathlib.Path)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--input", action="append", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    SRVGGNetCompact, RRDBNet = load_upstream(a.upstream)

    inputs = {}
    for spec in a.input:
        name, rest = spec.split("=", 1)
        size, path = rest.split(":", 1)
        w, h = (int(v) for v in size.split("x"))
        rgb = np.fromfile(path, dtype=np.uint8).reshape(h, w, 3).astype(np.float32) / 255.0
        inputs[name] = torch.from_numpy(rgb.transpose(2, 0, 1).copy())[None]
    only = None
    if a.only:
        only = {}
        for o in a.only:
            stem, _, names = o.partition(":")
            only[stem] = names.split(",") if names else list(inputs)

    models = published(SRVGGNetCompact, RRDBNet)
    a.out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for stem in models:
        if only is not None and stem not in only:
            continue
        net = save_checkpoint(models, stem, a.out)
        expected[stem] = {}
        for name, x in inputs.items():
            if only is not None and name not in only[stem]:
                continue
            with torch.no_grad():
                y = net(x)
            clamped = float(((y < 0) | (y > 1)).float().mean())
            y = y.clamp(0, 1)[0].numpy().astype(np.float32)
            y.tofile(a.out / f"{stem}.{name}.f32")
            expected[stem][name] = {"shape": list(y.shape), "clamped_fraction": clamped}
            print(f"{stem} on {name}: output {list(y.shape)}, {clamped:.1%} clamped",
                  file=sys.stderr)
    (a.out / "expected.json").write_text(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
