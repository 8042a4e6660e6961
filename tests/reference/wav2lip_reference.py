#!/usr/bin/env python3
"""PyTorch reference for lipsync's Rust Wav2Lip: checkpoint fixtures and forward-pass goldens.

Writes, into tests/fixtures/ (or --out):

  checkpoints/legacy_module_prefix.pth  legacy (pre-1.6) torch.save of {state_dict with every key
                                        prefixed "module.", optimizer, global_step, global_epoch},
                                        like the 2020 wav2lip.pth
  checkpoints/legacy_plain.pth          the same dict without the prefix, like wav2lip_gan.pth
  checkpoints/legacy_bare.pth           legacy torch.save of the bare state dict
  checkpoints/zip_dict.pt               zip torch.save of the checkpoint dict
  checkpoints/zip_bare.pt               zip torch.save of the bare state dict
  checkpoints/zip_module.pt             zip torch.save(model): a whole pickled module
  checkpoints/torchscript.pt            torch.jit.save(torch.jit.script(model))
  checkpoints/expected.json             per state-dict key: shape and SHA-256 of its
                                        contiguous float32 bytes (302 keys)
  dtypes/*.{pth,pt,safetensors}         small tensors stored as f32, f16, bf16 and f64,
                                        contiguous and not, in each container;
  dtypes/expected.json                  their values
  ../../fuzz/seeds/checkpoint/*         a tiny conv+BN module in every container (fuzzing seeds)
  parity.safetensors                    inputs and outputs of the full forward (4 frames, the
                                        expected output computed in float64), and inputs and
                                        outputs of the two asymmetric-stride convolutions

The model is written here from wav2lip-spec.md §1 (not copied from the original repository).
Its weights are deterministic, and every conv weight and BatchNorm affine parameter is a
*strided view* into one of a few small random storages. torch.save keeps views as views
(storage + offset + strides), so a full-size, 36.3 M-parameter checkpoint takes well under a
megabyte, and the Rust loader's handling of offsets and non-contiguous strides is exercised on
every tensor. BatchNorm running statistics are calibrated on a synthetic batch (train-mode
statistics, momentum 1) so activations stay in range and the sigmoid does not saturate.

Re-run with:  python3 tests/reference/wav2lip_reference.py   (needs torch and numpy)

Re-running reproduces every tensor and golden value exactly, but not every byte of the
containers: legacy torch.save names storages by memory address, and TorchScript archives carry a
random serialization id. CI uses the committed files and does not need PyTorch.
"""

import argparse
import hashlib
import json
import os
import struct
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn

SEED = 20201
FRAMES = 4


# ----------------------------------------------------------------------------------------------
# The model (wav2lip-spec.md §1)


class Conv2d(nn.Module):
    """conv (bias) + BatchNorm2d, optional residual add after BN, then ReLU."""

    def __init__(self, cin, cout, kernel_size, stride, padding, residual=False):
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.Conv2d(cin, cout, kernel_size, stride, padding), nn.BatchNorm2d(cout)
        )
        self.act = nn.ReLU()
        self.residual = residual

    def forward(self, x):
        out = self.conv_block(x)
        if self.residual:
            out = out + x
        return self.act(out)


class Conv2dTranspose(nn.Module):
    def __init__(self, cin, cout, kernel_size, stride, padding, output_padding=0):
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.ConvTranspose2d(cin, cout, kernel_size, stride, padding, output_padding),
            nn.BatchNorm2d(cout),
        )
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv_block(x))


def res(c):
    return Conv2d(c, c, 3, 1, 1, residual=True)


class Wav2Lip(nn.Module):
    def __init__(self):
        super().__init__()
        self.face_encoder_blocks = nn.ModuleList([
            nn.Sequential(Conv2d(6, 16, 7, 1, 3)),
            nn.Sequential(Conv2d(16, 32, 3, 2, 1), res(32), res(32)),
            nn.Sequential(Conv2d(32, 64, 3, 2, 1), res(64), res(64), res(64)),
            nn.Sequential(Conv2d(64, 128, 3, 2, 1), res(128), res(128)),
            nn.Sequential(Conv2d(128, 256, 3, 2, 1), res(256), res(256)),
            nn.Sequential(Conv2d(256, 512, 3, 2, 1), res(512)),
            nn.Sequential(Conv2d(512, 512, 3, 1, 0), Conv2d(512, 512, 1, 1, 0)),
        ])
        self.audio_encoder = nn.Sequential(
            Conv2d(1, 32, 3, 1, 1), res(32), res(32),
            Conv2d(32, 64, 3, (3, 1), 1), res(64), res(64),
            Conv2d(64, 128, 3, 3, 1), res(128), res(128),
            Conv2d(128, 256, 3, (3, 2), 1), res(256),
            Conv2d(256, 512, 3, 1, 0),
            Conv2d(512, 512, 1, 1, 0),
        )
        self.face_decoder_blocks = nn.ModuleList([
            nn.Sequential(Conv2d(512, 512, 1, 1, 0)),
            nn.Sequential(Conv2dTranspose(1024, 512, 3, 1, 0), res(512)),
            nn.Sequential(Conv2dTranspose(1024, 512, 3, 2, 1, 1), res(512), res(512)),
            nn.Sequential(Conv2dTranspose(768, 384, 3, 2, 1, 1), res(384), res(384)),
            nn.Sequential(Conv2dTranspose(512, 256, 3, 2, 1, 1), res(256), res(256)),
            nn.Sequential(Conv2dTranspose(320, 128, 3, 2, 1, 1), res(128), res(128)),
            nn.Sequential(Conv2dTranspose(160, 64, 3, 2, 1, 1), res(64), res(64)),
        ])
        self.output_block = nn.Sequential(
            Conv2d(80, 32, 3, 1, 1), nn.Conv2d(32, 3, 1, 1, 0), nn.Sigmoid()
        )

    def forward(self, audio_sequences, face_sequences):
        audio_embedding = self.audio_encoder(audio_sequences)
        feats = []
        x = face_sequences
        for f in self.face_encoder_blocks:
            x = f(x)
            feats.append(x)
        x = audio_embedding
        for f in self.face_decoder_blocks:
            x = f(x)
            x = torch.cat((x, feats[-1]), dim=1)
            feats.pop()
        return self.output_block(x)


# ----------------------------------------------------------------------------------------------
# Deterministic, compact weights


def strided_view(storage, shape, rng):
    """A view of `storage` with the given shape and small pseudo-random strides (the innermost
    one > 1 now and then, so views are non-contiguous in every dimension)."""
    n = storage.numel()
    strides = []
    for size in reversed(shape):
        strides.append(int(rng.integers(1, 6)) if not strides else int(rng.integers(2, 14)))
    strides = list(reversed(strides))
    reach = sum((s - 1) * st for s, st in zip(shape, strides))
    while reach >= n:  # shrink until the view fits
        strides = [max(1, st // 2) for st in strides]
        reach = sum((s - 1) * st for s, st in zip(shape, strides))
    offset = int(rng.integers(0, n - reach))
    return torch.as_strided(storage, shape, strides, offset)


def build_model():
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    model = Wav2Lip()
    conv_storage = torch.empty(1 << 16).uniform_(-1.0, 1.0)
    bias_storage = torch.empty(4099).uniform_(-0.1, 0.1)
    gamma_storage = torch.empty(4111).uniform_(0.8, 1.2)
    beta_storage = torch.empty(4127).uniform_(-0.1, 0.1)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            m.weight = nn.Parameter(strided_view(conv_storage, tuple(m.weight.shape), rng))
            m.bias = nn.Parameter(strided_view(bias_storage, tuple(m.bias.shape), rng))
        elif isinstance(m, nn.BatchNorm2d):
            m.weight = nn.Parameter(strided_view(gamma_storage, tuple(m.weight.shape), rng))
            m.bias = nn.Parameter(strided_view(beta_storage, tuple(m.bias.shape), rng))
    # The output conv gets its own contiguous weights, rescaled below.
    out = model.output_block[1]
    out.weight = nn.Parameter(torch.empty(3, 32, 1, 1).uniform_(-0.2, 0.2))
    out.bias = nn.Parameter(torch.zeros(3))
    model.requires_grad_(False)
    calibrate(model)
    return model


def synthetic_inputs(n, generator):
    mel = torch.rand(n, 1, 80, 16, generator=generator) * 6.0 - 4.0
    face = torch.rand(n, 6, 96, 96, generator=generator)
    face[:, :3, 48:, :] = 0.0  # the masked copy's lower half, as at inference
    return mel, face


def calibrate(model):
    """BN running stats := statistics of a synthetic batch; output conv rescaled so pre-sigmoid
    values have mean 0 and standard deviation 0.75."""
    g = torch.Generator().manual_seed(SEED + 1)
    mel, face = synthetic_inputs(16, g)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 1.0
    model.train()
    with torch.no_grad():
        model(mel, face)
    model.eval()
    captured = {}
    hook = model.output_block[1].register_forward_hook(lambda m, i, o: captured.update(o=o))
    with torch.no_grad():
        model(mel, face)
    hook.remove()
    o = captured["o"]
    mean = o.mean(dim=(0, 2, 3))
    std = o.std(dim=(0, 2, 3))
    conv = model.output_block[1]
    target = 0.75  # pre-sigmoid standard deviation: outputs spread over (0, 1), not stuck at 0/1
    conv.weight = nn.Parameter(conv.weight * (target / std).view(3, 1, 1, 1))
    conv.bias = nn.Parameter((conv.bias - mean) * (target / std))
    model.requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# Writers


def write_safetensors(path, tensors, metadata=None):
    """Minimal safetensors writer (format: 8-byte LE header length, JSON header, raw data)."""
    names = {
        torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.float64: "F64", torch.int64: "I64",
    }
    if metadata is None and not tensors:
        raise ValueError("nothing to write")
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 \
            else t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def fake_optimizer_state(state_dict, storage, positive_storage):
    """An Adam state dict of the shape the training scripts saved, with moment tensors that are
    views into a small storage (the real ones are 290 MB)."""
    rng = np.random.default_rng(SEED + 2)
    params = [k for k, v in state_dict.items() if not k.endswith(("running_mean", "running_var",
                                                                 "num_batches_tracked"))]
    state = {}
    for i, k in enumerate(params):
        shape = tuple(state_dict[k].shape)
        state[i] = {"step": 258000, "exp_avg": strided_view(storage, shape, rng),
                    "exp_avg_sq": strided_view(positive_storage, shape, rng)}
    return {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.5, 0.999), "eps": 1e-8,
                                              "weight_decay": 0, "amsgrad": False,
                                              "params": list(range(len(params)))}]}


def sha256_f32(t):
    return hashlib.sha256(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def write_checkpoints(model, out):
    os.makedirs(out, exist_ok=True)
    sd = model.state_dict()
    assert len(sd) == 352, len(sd)
    optimizer = fake_optimizer_state(sd, torch.empty(1 << 12).uniform_(-1e-3, 1e-3),
                                     torch.empty(1 << 12).uniform_(0, 1e-6))
    prefixed = OrderedDict(("module." + k, v) for k, v in sd.items())
    legacy = dict(_use_new_zipfile_serialization=False)
    torch.save({"state_dict": prefixed, "optimizer": optimizer, "global_step": 396000,
                "global_epoch": 203}, f"{out}/legacy_module_prefix.pth", **legacy)
    torch.save({"global_epoch": 88, "global_step": 258000, "state_dict": sd,
                "optimizer": optimizer}, f"{out}/legacy_plain.pth", **legacy)
    torch.save(sd, f"{out}/legacy_bare.pth", **legacy)
    torch.save({"state_dict": sd, "optimizer": optimizer, "global_step": 258000,
                "global_epoch": 88}, f"{out}/zip_dict.pt")
    torch.save(sd, f"{out}/zip_bare.pt")
    torch.save(model, f"{out}/zip_module.pt")
    torch.jit.save(torch.jit.script(model), f"{out}/torchscript.pt")

    # Each file must load back, in PyTorch, to the same state dict.
    for name in ["legacy_module_prefix.pth", "legacy_plain.pth", "zip_dict.pt"]:
        got = torch.load(f"{out}/{name}", weights_only=False)["state_dict"]
        check_same(sd, {k.removeprefix("module."): v for k, v in got.items()}, name)
    for name in ["legacy_bare.pth", "zip_bare.pt"]:
        check_same(sd, torch.load(f"{out}/{name}", weights_only=False), name)
    check_same(sd, torch.load(f"{out}/zip_module.pt", weights_only=False).state_dict(),
               "zip_module.pt")
    check_same(sd, torch.jit.load(f"{out}/torchscript.pt").state_dict(), "torchscript.pt")

    expected = {k: {"shape": list(v.shape), "sha256": sha256_f32(v)}
                for k, v in sd.items() if not k.endswith("num_batches_tracked")}
    assert len(expected) == 302
    non_contiguous = sum(1 for v in sd.values() if not v.is_contiguous())
    with open(f"{out}/expected.json", "w") as f:
        json.dump({"tensors": expected, "non_contiguous": non_contiguous}, f, indent=1,
                  sort_keys=True)
    return non_contiguous


def check_same(a, b, name):
    assert list(a.keys()) == list(b.keys()), name
    for k in a:
        assert torch.equal(a[k], b[k]), (name, k)


def write_dtype_fixtures(out):
    """Small tensors in every float storage type, contiguous and strided, in every container."""
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(SEED + 3)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64) * 3
    tensors = OrderedDict()
    for dt, name in [(torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"),
                     (torch.float64, "f64")]:
        t = base.to(dt)
        tensors[f"{name}.contiguous"] = t
        tensors[f"{name}.transposed"] = t.t()  # column-major
        tensors[f"{name}.offset_slice"] = t[2:, 1::2]  # offset and gaps
    tensors["i64.steps"] = torch.tensor(1234, dtype=torch.int64)
    torch.save(tensors, f"{out}/dtypes_legacy.pth", _use_new_zipfile_serialization=False)
    torch.save(tensors, f"{out}/dtypes_zip.pt")
    write_safetensors(f"{out}/dtypes.safetensors", tensors)
    expected = {k: {"shape": list(v.shape), "values": v.to(torch.float64).flatten().tolist()}
                for k, v in tensors.items()}
    with open(f"{out}/expected.json", "w") as f:
        json.dump(expected, f, indent=1)


class TinyBlock(nn.Module):
    """A miniature of the Wav2Lip blocks, for small fuzzing seeds."""

    def __init__(self):
        super().__init__()
        self.conv_block = nn.Sequential(nn.Conv2d(2, 3, 3, 1, 1), nn.BatchNorm2d(3))
        self.up = nn.Sequential(nn.ConvTranspose2d(3, 2, 3, 2, 1, 1), nn.BatchNorm2d(2))

    def forward(self, x):
        return self.up(torch.relu(self.conv_block(x)))


def write_fuzz_seeds(out):
    """A tiny module in every container: starting points for fuzz/ (a few KB each)."""
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(SEED + 5)
    m = TinyBlock().eval()
    m.conv_block[0].weight = nn.Parameter(m.conv_block[0].weight.detach().transpose(2, 3))
    sd = m.state_dict()
    legacy = dict(_use_new_zipfile_serialization=False)
    torch.save({"state_dict": OrderedDict(("module." + k, v) for k, v in sd.items()),
                "global_step": 1}, f"{out}/legacy_dict.pth", **legacy)
    torch.save(sd, f"{out}/zip_bare.pt")
    torch.save(m, f"{out}/zip_module.pt")
    torch.jit.save(torch.jit.script(m), f"{out}/torchscript.pt")
    write_safetensors(f"{out}/tiny.safetensors", sd, {"format": "pt"})


def write_parity(model, path):
    g = torch.Generator().manual_seed(SEED + 4)
    mel, face = synthetic_inputs(FRAMES, g)
    with torch.no_grad():
        out32 = model(mel, face)
        m64 = Wav2Lip()
        m64.load_state_dict(model.state_dict())
        m64 = m64.double().eval()
        out64 = m64(mel.double(), face.double())
    err32 = (out32.double() - out64).abs().max().item()
    saturated = ((out64 < 0.01) | (out64 > 0.99)).double().mean().item()
    assert saturated < 0.01, f"sigmoid saturated for {saturated:.1%} of outputs"
    assert out64.std() > 0.05, "output nearly constant"

    # The asymmetric-stride convolutions (audio_encoder.3: (3,1); .9: (3,2)), conv only.
    captured = {}

    def grab(name):
        def hook(m, i, o):
            captured[name + ".in"] = i[0]
            captured[name + ".out"] = o
        return hook

    handles = [model.audio_encoder[i].conv_block[0].register_forward_hook(grab(f"audio_encoder.{i}"))
               for i in (3, 9)]
    with torch.no_grad():
        model(mel, face)
    for h in handles:
        h.remove()

    tensors = OrderedDict(mel=mel, face=face, out=out64.float())
    tensors.update(captured)
    write_safetensors(path, tensors, {"torch": torch.__version__,
                                      "pytorch_f32_vs_f64_max_abs": f"{err32:.3e}"})
    return err32, out64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures"))
    ap.add_argument("--fuzz-seeds",
                    default=os.path.join(here, "..", "..", "fuzz", "seeds", "checkpoint"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build_model().eval()
    nc = write_checkpoints(model, os.path.join(args.out, "checkpoints"))
    write_dtype_fixtures(os.path.join(args.out, "dtypes"))
    write_fuzz_seeds(args.fuzz_seeds)
    err32, out = write_parity(model, os.path.join(args.out, "parity.safetensors"))
    print(f"torch {torch.__version__}: {nc} of 352 state-dict tensors non-contiguous; "
          f"output range [{out.min():.3f}, {out.max():.3f}], std {out.std():.3f}; "
          f"PyTorch f32 vs f64 max abs difference {err32:.2e}")


if __name__ == "__main__":
    main()
