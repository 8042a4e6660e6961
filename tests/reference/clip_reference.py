#!/usr/bin/env python3
"""Independent PyTorch + OpenCV reference for clip avatars (wav2lip-spec.md §4), written the way
Rudrabha/Wav2Lip's inference.py treats a video `--face` with `--box` (and so without detection or
smoothing): every frame read with cv2.VideoCapture (BGR), the model frame i drawn on clip frame
i mod n (inference.py's loop, `--loop repeat` here), the box sliced and cv2.resize'd to 96x96,
the mel chunks of the original loop at the clip's frame rate (80/fps), the PyTorch model in
float32 with the fixture checkpoint, pred * 255 -> uint8.

Writes:
  tests/media/clip_rgb_25fps.mp4    12 frames, 25 fps, 160x160, lossless RGB H.264 (libx264rgb
                                    -crf 0): a pan over astronaut.png, shorter than the speech
  tests/media/clip_rgb_30fps.mp4    40 frames, 30 fps, likewise, longer than the speech
  tests/fixtures/clip/<clip>/NNNNN.png   the predicted face of every model frame (true colours)
  tests/fixtures/clip/smoothing.json     inputs and outputs of a transcription of inference.py's
                                    get_smoothened_boxes (T = 5) on random boxes
  tests/fixtures/clip/reference.json     clips, box, frame counts, versions, and how far
                                    OpenCV's decoded frames of the ordinary YUV clip carphone.mp4
                                    are from ffmpeg's rgb24 frames (what lipsync decodes)

Re-run with:  python3 tests/reference/clip_reference.py   (needs torch, opencv-python-headless,
librosa, soundfile, numpy, pillow, and ffmpeg on the PATH)
"""

import json
import os
import subprocess
import sys
import tempfile

import cv2
import librosa
import numpy as np
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MEDIA = os.path.join(ROOT, "tests", "media")
OUT = os.path.join(ROOT, "tests", "fixtures", "clip")
sys.path.insert(0, HERE)
from audio_reference import wav2lip_mel  # noqa: E402
from render_reference import original_mel_chunks  # noqa: E402
from wav2lip_reference import Wav2Lip  # noqa: E402

CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "checkpoints", "legacy_plain.pth")
AUDIO = os.path.join(MEDIA, "arctic_a0007_1s.wav")
SIZE = 160
BOX = (40, 30, 128, 130)  # x1, y1, x2, y2 (exclusive) in every clip frame
CLIPS = {"clip_rgb_25fps": (25, 12), "clip_rgb_30fps": (30, 40)}


def make_clip(name, fps, frames):
    """A pan over astronaut.png (2 px right and 1 px down per frame), lossless RGB."""
    photo = np.asarray(Image.open(os.path.join(MEDIA, "astronaut.png")).convert("RGB"))
    path = os.path.join(MEDIA, f"{name}.mp4")
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(frames):
            x, y = 120 + 2 * k, 50 + k
            Image.fromarray(photo[y:y + SIZE, x:x + SIZE]).save(os.path.join(tmp, f"{k:05d}.png"))
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-framerate", str(fps), "-i",
                        os.path.join(tmp, "%05d.png"), "-c:v", "libx264rgb", "-crf", "0",
                        "-preset", "veryslow", "-pix_fmt", "rgb24", path], check=True)
    return path


def read_cv2(path):
    cap = cv2.VideoCapture(path)
    frames = []
    while True:
        ok, f = cap.read()
        if not ok:
            break
        frames.append(f)
    return frames


def read_ffmpeg(path):
    """Frames as lipsync decodes them: ffmpeg, rgb24, passthrough; returned as BGR."""
    out = subprocess.run(["ffmpeg", "-v", "error", "-i", path, "-map", "0:v:0", "-fps_mode",
                          "passthrough", "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"],
                         check=True, capture_output=True).stdout
    probe = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                            "stream=width,height", "-of", "csv=p=0", path],
                           check=True, capture_output=True, text=True).stdout
    w, h = map(int, probe.strip().split(","))
    arr = np.frombuffer(out, np.uint8).reshape(-1, h, w, 3)
    return [f[:, :, ::-1] for f in arr]


def get_smoothened_boxes(boxes, T):
    """inference.py's function, transcribed."""
    for i in range(len(boxes)):
        if i + T > len(boxes):
            window = boxes[len(boxes) - T:]
        else:
            window = boxes[i: i + T]
        boxes[i] = np.mean(window, axis=0)
    return boxes


def smoothing_cases():
    rng = np.random.default_rng(7)
    cases = []
    for n in (5, 6, 7, 13, 40):
        x1 = rng.integers(100, 140, n)
        y1 = rng.integers(50, 90, n)
        boxes = np.stack([x1, y1, x1 + rng.integers(80, 120, n), y1 + rng.integers(90, 130, n)], 1)
        smoothed = get_smoothened_boxes(boxes.copy(), T=5)
        cases.append({"boxes": boxes.tolist(), "smoothed": smoothed.tolist()})
    return cases


def main():
    os.makedirs(OUT, exist_ok=True)
    model = Wav2Lip()
    model.load_state_dict(torch.load(CHECKPOINT, weights_only=False)["state_dict"])
    model.eval()
    audio, _ = librosa.load(AUDIO, sr=16000)
    mel = wav2lip_mel(audio)
    meta = {"audio": "tests/media/arctic_a0007_1s.wav", "box": list(BOX), "loop": "repeat",
            "checkpoint": "tests/fixtures/checkpoints/legacy_plain.pth", "clips": {},
            "opencv": cv2.__version__, "torch": torch.__version__}
    for name, (fps, n) in CLIPS.items():
        path = make_clip(name, fps, n)
        frames = read_cv2(path)
        ours = read_ffmpeg(path)
        assert len(frames) == n == len(ours), (len(frames), len(ours))
        assert all(np.array_equal(a, b) for a, b in zip(frames, ours)), "lossless decoders differ"
        chunks = original_mel_chunks(mel, float(fps))
        x1, y1, x2, y2 = BOX
        inputs = []
        for i in range(len(chunks)):
            face = cv2.resize(frames[i % n][y1:y2, x1:x2], (96, 96))
            masked = face.copy()
            masked[96 // 2:] = 0
            inputs.append(np.concatenate((masked, face), axis=2) / 255.0)
        img = torch.FloatTensor(np.stack(inputs).transpose(0, 3, 1, 2))
        mels = torch.FloatTensor(np.stack(chunks)[:, None])
        with torch.no_grad():
            pred = model(mels, img).cpu().numpy().transpose(0, 2, 3, 1) * 255.0
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        for i, p in enumerate(pred.astype(np.uint8)):
            cv2.imwrite(os.path.join(d, f"{i:05d}.png"), p)
        meta["clips"][name] = {"file": f"tests/media/{name}.mp4", "fps": fps, "clip_frames": n,
                               "model_frames": len(chunks)}
    # An ordinary YUV 4:2:0 clip: how far OpenCV's BGR frames are from ffmpeg's rgb24 ones.
    carphone = os.path.join(MEDIA, "carphone.mp4")
    a, b = read_cv2(carphone), read_ffmpeg(carphone)
    diff = [np.abs(x.astype(int) - y.astype(int)) for x, y in zip(a, b)]
    meta["yuv_decoders"] = {"clip": "tests/media/carphone.mp4", "frames_opencv": len(a),
                            "frames_ffmpeg": len(b),
                            "max_abs_diff": int(max(x.max() for x in diff)),
                            "mean_abs_diff": float(np.mean([x.mean() for x in diff])),
                            "share_of_values_differing": float(np.mean([(x > 0).mean() for x in diff]))}
    with open(os.path.join(OUT, "smoothing.json"), "w") as f:
        json.dump(smoothing_cases(), f)
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
