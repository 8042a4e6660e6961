#!/usr/bin/env python3
"""facexlib reference for lipsync's RetinaFace (src/model/retinaface.rs), run by tests/enhancer.rs.

For each published layout it makes a deterministic random checkpoint and runs facexlib 0.3.0's
`RetinaFace` module directly (no weight download) on each --image, into --out:

  detection_Resnet50_Final.pth   RetinaFace('resnet50') (torchvision ResNet-50 body, FPN 256):
                                 a zip torch.save of the state dict, as facexlib loads it
  mobilenet0.25_Final.pth        RetinaFace('mobile0.25') (MobileNet-0.25 body, FPN 64): a legacy
                                 torch.save with DataParallel's `module.` prefix on every key, as
                                 Pytorch_Retinaface publishes it
  <net>_<i>_{loc,conf,landms}.f32  the network's raw outputs on image i (float32, one row per
                                 prior: 4, 2 softmaxed, 10 values), the input BGR minus
                                 (104, 117, 123) as detect_faces gives it
  <net>_<i>.json                 the 50 best priors by score (no threshold), decoded with
                                 facexlib's PriorBox/decode/decode_landm and scaled to pixels,
                                 then facexlib's py_cpu_nms at 0.4: [[x1, y1, x2, y2, score,
                                 10 landmark values], ...]
  <net>_crop.json                with --crop: facexlib's own detect_faces (conf_threshold 0.5,
                                 nms_threshold 0.4) on that region of the first image, in the
                                 region's pixels: what an avatar's landmark search runs

Random weights: PyTorch's default initialisation, every batch norm's weight and bias and every
head's bias drawn (fixed seeds), then the batch norms' running statistics measured on the
--images themselves (train-mode passes, cumulative average), so that the activations keep a
realistic scale through the 50 layers and the softmax is not decided by logits in the
thousands.

  python retinaface_reference.py --upstream DIR --out DIR --image A.png [--image B.png ...] \
      [--crop x0,y0,x1,y1] [--time N]

`--time N` also reports, on stderr, the median of N forward passes on the first image and on
the crop (after one untimed pass), for docs/BENCHMARKS.md.
"""
import argparse
import json
import pathlib
import sys
import types
import warnings

import cv2
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from upstream_module import load  # noqa: E402

LAYOUTS = [
    # (facexlib network name, file, legacy container with the `module.` prefix)
    ("resnet50", "detection_Resnet50_Final.pth", False),
    ("mobile0.25", "mobilenet0.25_Final.pth", True),
]


def load_upstream(root: pathlib.Path):
    """facexlib's detection modules, loaded by path (its package __init__ downloads weights)."""
    for name in ["facexlib", "facexlib.detection"]:
        m = types.ModuleType(name)
        m.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = m
    d = root / "facexlib" / "detection"
    load("facexlib.detection.matlab_cp2tform", d / "matlab_cp2tform.py")
    load("facexlib.detection.align_trans", d / "align_trans.py")
    load("facexlib.detection.retinaface_net", d / "retinaface_net.py")
    load("facexlib.detection.retinaface_utils", d / "retinaface_utils.py")
    return load("facexlib.detection.retinaface", d / "retinaface.py")


def randomise(net, seed, inputs):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(0.5 + torch.rand(c, generator=g))
                m.bias.copy_(0.1 * torch.randn(c, generator=g))
                m.reset_running_stats()
                m.momentum = None
            elif isinstance(m, torch.nn.Conv2d) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        net.train()
        for x in inputs:
            net(x)
    net.eval()


def input_of(path, net):
    """The image as detect_faces gives it to the network: BGR float32 minus the means."""
    bgr = cv2.imread(path, cv2.IMREAD_COLOR).astype(np.float32)
    return torch.from_numpy(bgr.transpose(2, 0, 1).copy()).unsqueeze(0) - net.mean_tensor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, type=pathlib.Path)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--image", action="append", required=True)
    ap.add_argument("--crop")
    ap.add_argument("--time", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rf = load_upstream(a.upstream)
    utils = sys.modules["facexlib.detection.retinaface_utils"]
    for seed, (network, file, legacy) in enumerate(LAYOUTS):
        torch.manual_seed(100 + seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = rf.RetinaFace(network_name=network, half=False, phase="test", device=torch.device("cpu"))
        inputs = [input_of(p, net) for p in a.image]
        randomise(net, 200 + seed, inputs)
        state = net.state_dict()
        if legacy:
            state = {f"module.{k}": v for k, v in state.items()}
        torch.save(state, a.out / file, _use_new_zipfile_serialization=not legacy)
        stem = file.split("_")[0]
        for i, x in enumerate(inputs):
            h, w = x.shape[2:]
            with torch.no_grad():
                loc, conf, landms = net(x)
            for name, t in (("loc", loc), ("conf", conf), ("landms", landms)):
                t[0].numpy().astype(np.float32).tofile(a.out / f"{stem}_{i}_{name}.f32")
            priors = utils.PriorBox(net.cfg, image_size=(h, w)).forward()
            var = net.cfg["variance"]
            boxes = utils.decode(loc[0], priors, var) * torch.tensor([w, h, w, h], dtype=torch.float32)
            lms = utils.decode_landm(landms[0], priors, var) * torch.tensor([w, h] * 5, dtype=torch.float32)
            scores = conf[0, :, 1].numpy()
            order = scores.argsort()[::-1][:50]
            boxes, lms, scores = boxes.numpy()[order], lms.numpy()[order], scores[order]
            dets = np.hstack((boxes, scores[:, None])).astype(np.float32, copy=False)
            keep = utils.py_cpu_nms(dets, 0.4)
            faces = np.concatenate((dets[keep], lms[keep]), axis=1)
            (a.out / f"{stem}_{i}.json").write_text(json.dumps(faces.tolist()))
            print(f"{file}: image {i} ({w}x{h}): {loc.shape[1]} priors, {len(keep)} faces after NMS",
                  file=sys.stderr)
        if a.crop:
            x0, y0, x1, y1 = (int(v) for v in a.crop.split(","))
            region = cv2.imread(a.image[0], cv2.IMREAD_COLOR)[y0:y1, x0:x1]
            with torch.no_grad():
                faces = net.detect_faces(region, conf_threshold=0.5, nms_threshold=0.4)
            (a.out / f"{stem}_crop.json").write_text(json.dumps(faces.tolist()))
        if a.time:
            import time

            shapes = [inputs[0]]
            if a.crop:
                shapes.append(inputs[0][:, :, y0:y1, x0:x1].contiguous())
            for x in shapes:
                with torch.no_grad():
                    net(x)
                    times = []
                    for _ in range(a.time):
                        start = time.perf_counter()
                        net(x)
                        times.append(time.perf_counter() - start)
                print(f"{file}: {x.shape[3]}x{x.shape[2]}: {sorted(times)[len(times) // 2]:.4f} s per "
                      f"forward (PyTorch {torch.__version__}, {torch.get_num_threads()} threads, "
                      f"median of {a.time})", file=sys.stderr)


if __name__ == "__main__":
    main()
