"""Reference for the face alignment (src/media/face/align.rs): the 4-DOF similarity from five
landmarks to the FFHQ 512 template, fitted by least squares with numpy, and the warps with
OpenCV, as facexlib's FaceRestoreHelper does them (warpAffine, INTER_LINEAR, BORDER_CONSTANT
with its border colour), then the warp back into the photo with the inverted map
(cv2.invertAffineTransform).

    python align_reference.py --photo P --out DIR --landmarks x1,y1,...,x5,y5 [--landmarks ...]

Writes DIR/result.json ({"cases": [{"landmarks", "matrix", "inverse"}]}) and per case i
DIR/aligned_i.png (512x512), DIR/back_i.png (the photo's size: the aligned face warped back
onto a grey canvas), DIR/restored_i.png (a stand-in for a restored face: the aligned face's
negative) and DIR/blended_i.png: the photo with that face warped back (border (135,133,132))
and blended through the lower-face mask of src/media/face/restore.rs, computed here in numpy
(float32): round(photo + m * (back - photo)). Needs numpy and opencv-python-headless
(scripts/torch-venv.sh has both).
"""
import argparse
import json
import pathlib

import cv2
import numpy as np

# facexlib's face_template for 512x512 faces.
FFHQ_512 = np.array(
    [
        [192.98138, 239.94708],
        [318.90277, 240.1936],
        [256.63416, 314.01935],
        [201.26117, 371.41043],
        [313.08905, 371.15118],
    ]
)
BORDER_RGB = (135, 133, 132)
# The lower-face mask in template pixels (src/media/face/restore.rs).
MASK_CENTRE = (256.0, 370.0)
MASK_RADII = (130.0, 96.0)
MASK_FEATHER = 0.25


def lower_face_mask(to_template, w, h):
    """The mask at every frame pixel: the template mask sampled through the frame-to-template map."""
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    tx = (to_template[0, 0] * xs + to_template[0, 1] * ys + to_template[0, 2]).astype(np.float32)
    ty = (to_template[1, 0] * xs + to_template[1, 1] * ys + to_template[1, 2]).astype(np.float32)
    dx = (tx - np.float32(MASK_CENTRE[0])) / np.float32(MASK_RADII[0])
    dy = (ty - np.float32(MASK_CENTRE[1])) / np.float32(MASK_RADII[1])
    r = np.sqrt(dx * dx + dy * dy)
    return np.clip((np.float32(1) - r) / np.float32(MASK_FEATHER), 0, 1).astype(np.float32)


def similarity(src, dst):
    """Least squares of x' = a x - b y + tx, y' = b x + a y + ty over the point pairs."""
    rows, rhs = [], []
    for (x, y), (u, v) in zip(src, dst):
        rows.append([x, -y, 1.0, 0.0])
        rhs.append(u)
        rows.append([y, x, 0.0, 1.0])
        rhs.append(v)
    (a, b, tx, ty), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return np.array([[a, -b, tx], [b, a, ty]])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--photo", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--landmarks", action="append", required=True)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bgr = cv2.imread(args.photo, cv2.IMREAD_COLOR)
    h, w = bgr.shape[:2]
    border_bgr = BORDER_RGB[::-1]
    cases = []
    for i, text in enumerate(args.landmarks):
        points = np.array([float(v) for v in text.split(",")]).reshape(5, 2)
        m = similarity(points, FFHQ_512)
        aligned = cv2.warpAffine(
            bgr, m, (512, 512), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=border_bgr
        )
        inverse = cv2.invertAffineTransform(m)
        back = cv2.warpAffine(
            aligned,
            inverse,
            (w, h),
            flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT,
            borderValue=(128, 128, 128),
        )
        cv2.imwrite(str(out / f"aligned_{i}.png"), aligned)
        cv2.imwrite(str(out / f"back_{i}.png"), back)
        restored = 255 - aligned
        restored_back = cv2.warpAffine(
            restored, inverse, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=border_bgr
        ).astype(np.float32)
        mask = lower_face_mask(m, w, h)[..., None]
        photo = bgr.astype(np.float32)
        blended = np.floor(photo + mask * (restored_back - photo) + np.float32(0.5))
        cv2.imwrite(str(out / f"restored_{i}.png"), restored)
        cv2.imwrite(str(out / f"blended_{i}.png"), np.clip(blended, 0, 255).astype(np.uint8))
        cases.append({"landmarks": points.ravel().tolist(), "matrix": m.tolist(), "inverse": inverse.tolist()})
    (out / "result.json").write_text(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
