//! `lipsync bench --video CLIP`: what a clip avatar costs. Preparation (decode, detection,
//! smoothing, crops, JPEG frames; with and without an explicit box) and its size, then the
//! per-frame work of a request without the model: x264 alone encoding the looped clip (frames
//! decoded beforehand), the compositor on a prepared photo avatar, and the compositor on the
//! prepared clip (JPEG decode, paste, encode), all at the same encoder settings.

use std::sync::Arc;
use std::time::Instant;

use lipsync::engine::clip::{self, ClipOptions, Loop};
use lipsync::engine::compositor::Compositor;
use lipsync::engine::scheduler::Drawn;
use lipsync::engine::Avatar;
use lipsync::media::face::{Blend, Pads};
use lipsync::media::image::{Frame, DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE};
use lipsync::media::video::clip::ClipLimits;
use lipsync::media::video::{self, EncoderSettings};

use super::bench::BenchArgs;
use super::{read_file, CliError};

/// Rounds of the per-frame runs (each reports its median).
const ROUNDS: usize = 3;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn bench_clip(a: &BenchArgs, path: &std::path::Path) -> Result<serde_json::Value, CliError> {
    let bytes = read_file(path)?;
    let options = ClipOptions {
        ffmpeg: a.ffmpeg.clone(),
        limits: ClipLimits {
            max_seconds: 3600.0,
            max_pixels: DEFAULT_MAX_PIXELS,
        },
        max_side: DEFAULT_MAX_SIDE,
        smooth: true,
    };
    println!("## Clip avatar: {}\n", path.display());
    let t = Instant::now();
    let detected = clip::prepare(&bytes, &options, None, Pads::default(), Blend::Feather)?;
    let prepare_detect = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let boxed = clip::prepare(
        &bytes,
        &options,
        Some(detected.source_face),
        Pads::default(),
        Blend::Feather,
    )?;
    let prepare_box = t.elapsed().as_secs_f64();
    let c = boxed.clip.clone().expect("a clip avatar");
    let (w, h, n) = (c.width, c.height, c.len());
    println!(
        "{n} frames of {w}x{h} at {} fps ({:.1} s)\n",
        c.fps, c.duration
    );
    println!("| preparation | seconds | frames/s |");
    println!("|---|---|---|");
    for (what, s) in [
        (
            "detect + smooth + crops + JPEG (two decodes)",
            prepare_detect,
        ),
        ("explicit box: crops + JPEG (one decode)", prepare_box),
    ] {
        println!("| {what} | {s:.2} | {:.1} |", n as f64 / s);
    }
    let size = boxed.bytes();
    println!(
        "\nprepared size: {:.1} MB ({:.1} MB of JPEG frames, {:.0} KB per frame; raw frames would \
         take {:.1} MB)\n",
        size as f64 / 1e6,
        c.jpeg_bytes() as f64 / 1e6,
        c.jpeg_bytes() as f64 / n as f64 / 1e3,
        (w as usize * h as usize * 3 * n) as f64 / 1e6
    );

    // Two loops of the clip, pingpong: the frames a request of that length shows.
    let frames = 2 * n;
    let order: Vec<usize> = (0..frames).map(|k| Loop::PingPong.select(k, n)).collect();
    let t = Instant::now();
    let decoded: Vec<Frame> = (0..n)
        .map(|i| c.frame(i))
        .collect::<Result<_, _>>()
        .map_err(lipsync::engine::Error::from)?;
    let decode_ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
    println!("JPEG decoding alone: {decode_ms:.1} ms per frame\n");
    let photo = Arc::new(Avatar::from_frame(
        c.frame(0).map_err(lipsync::engine::Error::from)?,
        c.face(0),
        Blend::Feather,
    ));
    let mut runs = Vec::new();
    // x264 on every core, then on one thread (as when the other cores are free, e.g. a GPU
    // server, where clip frames are decoded beside the encoder).
    for threads in [None, Some(1)] {
        let settings = || {
            let mut s = EncoderSettings::new(w, h, c.fps);
            s.ffmpeg = a.ffmpeg.clone();
            s.workers = 1;
            s.threads = threads;
            s
        };
        let alone = || -> Result<f64, CliError> {
            let t = Instant::now();
            let mut enc = video::spawn(settings(), Box::new(std::io::sink()))?;
            for &i in &order {
                enc.write_frame(&decoded[i])?;
            }
            enc.finish()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let composite = |avatar: &Avatar| -> Result<f64, CliError> {
            let t = Instant::now();
            let mut enc = video::spawn(settings(), Box::new(std::io::sink()))?;
            {
                let mut out =
                    Compositor::new(avatar, Loop::PingPong, enc.as_mut(), &Default::default())?;
                for &i in &order {
                    out.push(&Drawn::face(
                        avatar.crop_bgr(i.min(avatar.frame_count() - 1)).to_vec(),
                    ))?;
                }
            }
            enc.finish()?;
            Ok(t.elapsed().as_secs_f64())
        };
        // Interleaved rounds, medians: a shared machine's load shifts between runs.
        let (mut xs, mut ps, mut cs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            xs.push(alone()?);
            ps.push(composite(&photo)?);
            cs.push(composite(&boxed)?);
        }
        let (x264, on_photo, on_clip) = (median(&mut xs), median(&mut ps), median(&mut cs));
        let label = threads.map_or("auto".to_string(), |t| t.to_string());
        println!(
            "| {frames} frames, x264 veryfast crf 20, {label} thread(s) (median of {ROUNDS}) | seconds | frames/s | vs x264 alone |"
        );
        println!("|---|---|---|---|");
        for (what, s) in [
            ("x264 alone (frames decoded beforehand)", x264),
            ("prepared photo avatar: paste + encode", on_photo),
            (
                "prepared clip avatar: JPEG decode + paste + encode",
                on_clip,
            ),
        ] {
            println!(
                "| {what} | {s:.2} | {:.1} | {:+.1} % |",
                frames as f64 / s,
                (s / x264 - 1.0) * 100.0
            );
        }
        println!();
        runs.push(serde_json::json!({
            "x264_threads": label, "x264_alone_s": x264, "photo_s": on_photo, "clip_s": on_clip,
        }));
    }
    Ok(serde_json::json!({
        "clip": path.display().to_string(), "frames": n, "width": w, "height": h,
        "fps": c.fps.value(), "box": detected.source_face.to_array(), "prepare_detect_s": prepare_detect, "prepare_box_s": prepare_box,
        "bytes": size, "jpeg_bytes": c.jpeg_bytes(), "request_frames": frames,
        "jpeg_decode_ms": decode_ms, "runs": runs,
    }))
}
