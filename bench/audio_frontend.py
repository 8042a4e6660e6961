#!/usr/bin/env python3
"""Benchmark: decode + resample + mel of 60 s of speech, lipsync beside librosa, same machine,
same run.

    python3 bench/audio_frontend.py [--lipsync target/release/lipsync] [--repeat 7]

Makes 60 s of speech with espeak-ng, encodes it as a 44.1 kHz stereo MP3 (a typical upload)
and a 16 kHz mono WAV (no resampling), then times, per file, the median of --repeat runs of
  - lipsync: `lipsync audio FILE --json --repeat N` (in-process timings of decode, resample, mel);
  - librosa: librosa.load(FILE, sr=16000) (soundfile decode + soxr_hq resampling) followed by
    the Wav2Lip mel (tests/reference/audio_reference.py), timed in this process.
Needs: a release build of lipsync, librosa, soundfile, scipy, espeak-ng and ffmpeg.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

TEXT = (
    "Lip sync is only as good as the mel windows that drive it. "
    "The service decodes whatever a text to speech engine or a recorder produced, "
    "converts it to sixteen kilohertz, and computes an eighty band mel spectrogram "
    "that the model reads sixteen columns at a time. "
) * 12


def make_speech(tmp):
    raw = os.path.join(tmp, "tts.wav")
    subprocess.run(["espeak-ng", "-s", "150", "-w", raw, TEXT], check=True)
    files = {}
    common = ["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-i", raw,
              "-af", "apad", "-t", "60"]
    files["mp3 44.1 kHz stereo"] = os.path.join(tmp, "speech60.mp3")
    subprocess.run(common + ["-af", "apad,pan=stereo|c0=c0|c1=c0", "-ar", "44100",
                             "-c:a", "libmp3lame", "-b:a", "128k", files["mp3 44.1 kHz stereo"]],
                   check=True)
    files["wav 16 kHz mono"] = os.path.join(tmp, "speech60.wav")
    subprocess.run(common + ["-ar", "16000", "-ac", "1", "-c:a", "pcm_s16le",
                             files["wav 16 kHz mono"]], check=True)
    return files


def time_lipsync(binary, path, repeat):
    out = subprocess.run([binary, "audio", path, "--json", "--repeat", str(repeat)],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    return r["median_ms"], r


def time_librosa(path, repeat):
    import librosa
    from audio_reference import wav2lip_mel
    loads, mels, totals = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        wav, _ = librosa.load(path, sr=16000)
        t1 = time.perf_counter()
        mel = wav2lip_mel(wav)
        t2 = time.perf_counter()
        loads.append((t1 - t0) * 1e3)
        mels.append((t2 - t1) * 1e3)
        totals.append((t2 - t0) * 1e3)
    return {"load": statistics.median(loads), "mel": statistics.median(mels),
            "total": statistics.median(totals)}, mel.shape


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lipsync", default=os.path.join(ROOT, "target", "release", "lipsync"))
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    import librosa
    print(f"# {time.strftime('%Y-%m-%d')} on {platform.node()}: {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}; librosa {librosa.__version__}, "
          f"median of {args.repeat}")
    print()
    print("| input (60 s speech) | lipsync decode | resample | mel | lipsync total "
          "| librosa load+resample | librosa mel | librosa total | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in make_speech(tmp).items():
            ours, info = time_lipsync(args.lipsync, path, args.repeat)
            ref, shape = time_librosa(path, args.repeat)
            assert info["mel_frames"] == shape[1], (info["mel_frames"], shape)
            print(f"| {name} | {ours['decode']:.1f} ms | {ours['resample']:.1f} ms "
                  f"| {ours['mel']:.1f} ms | **{ours['total']:.1f} ms** | {ref['load']:.1f} ms "
                  f"| {ref['mel']:.1f} ms | **{ref['total']:.1f} ms** "
                  f"| {ref['total'] / ours['total']:.1f}× |")


if __name__ == "__main__":
    main()
