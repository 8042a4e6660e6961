#!/usr/bin/env python3
"""PyTorch + OpenCV reference of whole GFPGAN-restored frames, run by tests/enhancer.rs.

It does, step by step, what `lipsync render --device echo --box B --landmarks L --enhance
gfpgan` does to each frame of a photo, so the test can compare every composited frame
(`render --frames-dir`):

  1. the face box sliced from the photo (cv2.imread, BGR), cv2.resize'd to 96x96
     (INTER_LINEAR), and the echo device's prediction from it (enhanced_frame_reference.py);
  2. the prediction to 8 bits as the engine does it (x 255 in float32, truncated) and pasted:
     cv2.resize'd to the box and blended through the feathered box mask;
  3. the pasted frame aligned to the FFHQ 512 template: the least-squares similarity from the
     five landmarks (align_reference.py) and cv2.warpAffine (INTER_LINEAR, BORDER_CONSTANT with
     facexlib's border colour);
  4. the upstream GFPGANv1Clean (gfpgan_reference.py) on it, with the weights of --checkpoint:
     `net((x/255 - 0.5)/0.5, return_rgb=False, randomize_noise=False)`, clamped to [-1, 1],
     mapped to [0, 1], x 255 rounded to 8 bits;
  5. the restored face warped back with the inverted map (cv2.invertAffineTransform,
     cv2.warpAffine, the same border) and blended through the lower-face mask
     (align_reference.py): floor(frame + m * (back - frame) + 0.5).

Writes --out/frames/NNNNN.png, one per frame.

  python gfpgan_frame_reference.py --upstream DIR --checkpoint GFPGANv1.4.pth --out DIR \
      --photo FILE --box x1,y1,x2,y2 --landmarks x1,y1,...,x5,y5 --frames N
"""
import argparse
import pathlib
import sys

import cv2
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from align_reference import BORDER_RGB, FFHQ_512, lower_face_mask, similarity  # noqa: E402
from enhanced_frame_reference import FACE, echo_prediction, feather_mask  # noqa: E402
from gfpgan_reference import load_upstream, new_net  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, type=pathlib.Path)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--photo", required=True)
    ap.add_argument("--box", required=True)
    ap.add_argument("--landmarks", required=True)
    ap.add_argument("--frames", required=True, type=int)
    a = ap.parse_args()
    x1, y1, x2, y2 = (int(v) for v in a.box.split(","))
    w, h = x2 - x1, y2 - y1
    points = np.array([float(v) for v in a.landmarks.split(",")]).reshape(5, 2)

    net = new_net(load_upstream(a.upstream))
    state = torch.load(a.checkpoint, map_location="cpu", weights_only=True)["params_ema"]
    net.load_state_dict(state)

    photo = cv2.imread(a.photo, cv2.IMREAD_COLOR)
    ph, pw = photo.shape[:2]
    face = cv2.resize(photo[y1:y2, x1:x2], (FACE, FACE), interpolation=cv2.INTER_LINEAR)
    box_mask = feather_mask(w, h)[..., None]
    to_template = similarity(points, FFHQ_512)
    to_frame = cv2.invertAffineTransform(to_template)
    border = BORDER_RGB[::-1]
    mask = lower_face_mask(to_template, pw, ph)[..., None]
    frames = a.out / "frames"
    frames.mkdir(parents=True, exist_ok=True)
    for k in range(a.frames):
        pred = echo_prediction(face, k)
        face8 = np.clip(pred * np.float32(255.0), 0, 255).astype(np.uint8)
        resized = cv2.resize(face8, (w, h), interpolation=cv2.INTER_LINEAR).astype(np.uint32)
        frame = photo.copy()
        region = frame[y1:y2, x1:x2].astype(np.uint32)
        frame[y1:y2, x1:x2] = ((resized * box_mask + region * (256 - box_mask) + 128) >> 8).astype(np.uint8)

        aligned = cv2.warpAffine(
            frame, to_template, (512, 512), flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT, borderValue=border,
        )
        rgb = aligned[..., ::-1].astype(np.float32) / np.float32(255.0)
        x = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))[None]
        with torch.no_grad():
            y = net((x - 0.5) / 0.5, return_rgb=False, randomize_noise=False)[0]
        y = ((y.clamp(-1, 1) + 1) / 2)[0].numpy().transpose(1, 2, 0)
        restored = np.ascontiguousarray(np.floor(y * 255.0 + 0.5).astype(np.uint8)[..., ::-1])

        back = cv2.warpAffine(
            restored, to_frame, (pw, ph), flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT, borderValue=border,
        ).astype(np.float32)
        base = frame.astype(np.float32)
        out = np.floor(base + mask * (back - base) + np.float32(0.5))
        cv2.imwrite(str(frames / f"{k:05}.png"), np.clip(out, 0, 255).astype(np.uint8))
    print(f"GFPGAN: {a.frames} frames of {pw}x{ph}, box {w}x{h}", file=sys.stderr)


if __name__ == "__main__":
    main()
