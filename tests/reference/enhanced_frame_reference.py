#!/usr/bin/env python3
"""PyTorch + OpenCV reference of a whole enhanced frame, run by tests/enhancer.rs at test time.

It does, step by step, what `lipsync render --device echo --box B --enhance NAME` does to each
frame of a photo, so the test can compare every composited frame (`render --frames-dir`):

  1. the face box sliced from the photo (cv2.imread, BGR) and cv2.resize'd to 96x96
     (INTER_LINEAR): the model's reference face;
  2. the echo device's "prediction": that face / 255 in float32, its lower 48 rows moved down
     by `frame index mod 5` pixels (the rows uncovered at the top of the lower half repeat its
     first row; src/engine/echo.rs);
  3. the enhancer: the upstream network (tests/reference/esrgan_reference.py, loaded from
     --upstream) on the prediction in RGB, float32, clamped to [0, 1], x 255 rounded to 8 bits;
  4. that face cv2.resize'd to the box (INTER_LINEAR) and blended into the photo through the
     feathered lower-face mask (src/media/face/mod.rs: smoothstep ramps over the box's height
     and width, weights in 1/256), `(face * a + photo * (256 - a) + 128) >> 8`.

Writes into --out: <stem>.pth (the checkpoint, deterministic random weights in the published
layout) and frames/NNNNN.png, one per frame.

  python enhanced_frame_reference.py --upstream DIR --out DIR --photo FILE \
      --box x1,y1,x2,y2 --frames N [--model realesr-animevideov3]
"""
import argparse
import pathlib
import sys

import cv2
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from esrgan_reference import load_upstream, published, save_checkpoint  # noqa: E402

FACE = 96


def echo_prediction(face_bgr: np.ndarray, index: int) -> np.ndarray:
    """(96, 96, 3) float32 BGR in [0, 1]: the reference face with the mouth moved."""
    pred = face_bgr.astype(np.float32) / 255.0
    out = pred.copy()
    top, shift = FACE // 2, index % 5
    for row in range(top, FACE):
        out[row] = pred[max(row - shift, top)]
    return out


def smoothstep(e0, e1, x):
    t = np.clip((x - e0) / (e1 - e0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def feather_mask(w: int, h: int) -> np.ndarray:
    """(h, w) weights 0..256 of the face over the photo."""
    v = (np.arange(h, dtype=np.float32) + 0.5) / np.float32(h)
    u = (np.arange(w, dtype=np.float32) + 0.5) / np.float32(w)
    vertical = smoothstep(0.42, 0.62, v) * (1.0 - smoothstep(0.80, 0.96, v))
    horizontal = smoothstep(0.04, 0.24, u) * smoothstep(0.04, 0.24, 1.0 - u)
    a = np.outer(vertical, horizontal).astype(np.float32) * np.float32(256.0)
    return np.floor(a + np.float32(0.5)).astype(np.uint32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, type=pathlib.Path)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--photo", required=True)
    ap.add_argument("--box", required=True)
    ap.add_argument("--frames", required=True, type=int)
    ap.add_argument("--model", default="realesr-animevideov3")
    a = ap.parse_args()
    x1, y1, x2, y2 = (int(v) for v in a.box.split(","))
    w, h = x2 - x1, y2 - y1

    a.out.mkdir(parents=True, exist_ok=True)
    net = save_checkpoint(published(*load_upstream(a.upstream)), a.model, a.out)

    photo = cv2.imread(a.photo, cv2.IMREAD_COLOR)
    face = cv2.resize(photo[y1:y2, x1:x2], (FACE, FACE), interpolation=cv2.INTER_LINEAR)
    preds = np.stack([echo_prediction(face, k) for k in range(a.frames)])
    rgb = torch.from_numpy(preds[..., ::-1].transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        enhanced = net(rgb).clamp(0, 1).numpy()
    mask = feather_mask(w, h)[..., None]
    frames = a.out / "frames"
    frames.mkdir(exist_ok=True)
    for k in range(a.frames):
        face_rgb = np.floor(enhanced[k].transpose(1, 2, 0) * 255.0 + 0.5).astype(np.uint8)
        face_bgr = np.ascontiguousarray(face_rgb[..., ::-1])
        resized = cv2.resize(face_bgr, (w, h), interpolation=cv2.INTER_LINEAR).astype(np.uint32)
        frame = photo.copy()
        region = frame[y1:y2, x1:x2].astype(np.uint32)
        frame[y1:y2, x1:x2] = ((resized * mask + region * (256 - mask) + 128) >> 8).astype(np.uint8)
        cv2.imwrite(str(frames / f"{k:05}.png"), frame)
    print(f"{a.model}: {a.frames} frames of {photo.shape[1]}x{photo.shape[0]}, box {w}x{h}, "
          f"face {enhanced.shape[2]}x{enhanced.shape[3]}", file=sys.stderr)


if __name__ == "__main__":
    main()
