//! The video encoders as the pipeline uses them: frames in, a streamed fragmented MP4 out.
//! The segmented (parallel) encoder must make the same video as the single-process one:
//! every frame, exact timestamps, a keyframe every second, the audio, and bytes that start
//! flowing while frames are still being written. Needs ffmpeg and ffprobe on the PATH
//! (scripts/test.sh installs them).

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{decode_frames, num, probe, stream, text, top_level_boxes, wav};
use lipsync::media::audio::Fps;
use lipsync::media::image::Frame;
use lipsync::media::video::{self, EncoderSettings, Sink};

/// An odd size, so the encoders' padding is exercised too.
const W: u32 = 101;
const H: u32 = 75;

/// Frame `i` of a moving test pattern: a gradient with a square that moves.
fn frame(i: usize) -> Frame {
    let mut rgb = Vec::with_capacity((W * H * 3) as usize);
    for y in 0..H as usize {
        for x in 0..W as usize {
            let inside = (x + 100 - 2 * i % 100) % 100 < 20 && (20..50).contains(&y);
            let v = if inside {
                [230, 40, 40]
            } else {
                [(x * 2) as u8, (y * 3) as u8, ((x + y + i) % 256) as u8]
            };
            rgb.extend_from_slice(&v);
        }
    }
    Frame {
        width: W,
        height: H,
        rgb,
    }
}

/// A sink that keeps everything in memory, shared so the test can watch it fill.
#[derive(Clone, Default)]
struct Memory(Arc<Mutex<Vec<u8>>>);

impl Write for Memory {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Memory {
    fn bytes(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

fn speech(dir: &Path, seconds: f64) -> PathBuf {
    let rate = 16000;
    let samples: Vec<f32> = (0..(seconds * rate as f64) as usize)
        .map(|i| 0.3 * (i as f32 * 440.0 * std::f32::consts::TAU / rate as f32).sin())
        .collect();
    let path = dir.join("tone.wav");
    std::fs::write(&path, wav(&samples, rate, 1)).unwrap();
    path
}

fn settings(workers: usize, audio: Option<PathBuf>) -> EncoderSettings {
    let mut s = EncoderSettings::new(W, H, Fps::DEFAULT);
    s.workers = workers;
    s.audio = audio;
    s
}

/// Encodes `n` frames, returning the MP4 bytes.
fn encode(s: EncoderSettings, n: usize) -> Vec<u8> {
    let sink = Memory::default();
    let mut enc = video::spawn(s, Box::new(sink.clone())).unwrap();
    for i in 0..n {
        enc.write_frame(&frame(i)).unwrap();
    }
    let summary = enc.finish().unwrap();
    assert_eq!(summary.frames, n as u64);
    let bytes = sink.bytes();
    assert_eq!(summary.bytes, bytes.len() as u64);
    bytes
}

/// Video packet (pts in seconds, keyframe) pairs.
fn packets(path: &Path) -> Vec<(f64, bool)> {
    let out = Command::new("ffprobe")
        .args(["-v", "error", "-select_streams", "v", "-show_entries"])
        .args(["packet=pts_time,flags", "-of", "csv=p=0"])
        .arg(path)
        .output()
        .unwrap();
    text(&out.stdout)
        .lines()
        .map(|l| {
            let (t, flags) = l.split_once(',').unwrap();
            (t.parse().unwrap(), flags.starts_with('K'))
        })
        .collect()
}

/// A decoded 102×76 picture without the encoder's padding row and column.
fn crop(decoded: &[u8]) -> Vec<u8> {
    decoded
        .chunks_exact(102 * 3)
        .take(H as usize)
        .flat_map(|row| row[..W as usize * 3].to_vec())
        .collect()
}

fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    10.0 * (255.0f64.powi(2) / mse.max(1e-10)).log10()
}

#[test]
fn segmented_encoding_makes_the_same_video_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let n = 70; // segments of 25, 25 and 20 frames
    let audio = speech(dir.path(), n as f64 / 25.0);
    for (workers, name) in [(1, "single.mp4"), (3, "segmented.mp4"), (2, "two.mp4")] {
        let bytes = encode(settings(workers, Some(audio.clone())), n);
        let boxes = top_level_boxes(&bytes);
        assert_eq!(
            &boxes[..2],
            ["ftyp", "moov"],
            "{workers} workers: {boxes:?}"
        );
        let moofs = boxes.iter().filter(|b| *b == "moof").count();
        assert!(
            moofs >= 3,
            "{workers} workers: a fragment per second: {boxes:?}"
        );
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();

        let p = probe(&path);
        let v = stream(&p, "video");
        assert_eq!(v["codec_name"], "h264");
        assert_eq!(
            (v["width"].as_u64(), v["height"].as_u64()),
            (Some(102), Some(76))
        );
        assert_eq!(num(&v["nb_read_frames"]) as usize, n, "{workers} workers");
        let a = stream(&p, "audio");
        assert_eq!(a["codec_name"], "aac");
        assert!(num(&a["start_time"]).abs() < 1e-6, "{a}");
        assert!(
            (num(&a["duration"]) - 2.8).abs() < 0.05,
            "{workers} workers: audio lasts {}",
            a["duration"]
        );

        let pk = packets(&path);
        assert_eq!(pk.len(), n);
        for (i, &(t, key)) in pk.iter().enumerate() {
            assert!(
                (t - i as f64 / 25.0).abs() < 1e-6,
                "{workers} workers: frame {i} at {t}"
            );
            assert_eq!(
                key,
                i % 25 == 0,
                "{workers} workers: frame {i} keyframe {key}"
            );
        }

        // Every frame is the frame written, in order, at the single encoder's quality.
        let decoded = decode_frames(&path, 102, 76);
        assert_eq!(decoded.len(), n);
        for (i, d) in decoded.iter().enumerate() {
            let cropped = crop(d);
            let q = psnr(&cropped, &frame(i).rgb);
            assert!(q > 33.0, "{workers} workers: frame {i} PSNR {q:.1} dB");
            // Not some other frame: the square moves 2 px a frame.
            if i > 0 {
                assert!(
                    q > psnr(&cropped, &frame(i - 1).rgb) + 3.0,
                    "frame {i} order"
                );
            }
        }
    }
    // The two files decode to nearly the same pictures.
    let a = decode_frames(&dir.path().join("single.mp4"), 102, 76);
    let b = decode_frames(&dir.path().join("segmented.mp4"), 102, 76);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(psnr(x, y) > 38.0, "frame {i}: {:.1} dB apart", psnr(x, y));
    }
}

/// Encodes frames `from..from + n` of the pattern with `s`, checks the video (every frame,
/// in order, a keyframe every second from the first).
fn encode_and_check(s: EncoderSettings, from: usize, n: usize, what: &str) {
    let sink = Memory::default();
    let mut enc = video::spawn(s, Box::new(sink.clone())).unwrap();
    for i in 0..n {
        enc.write_frame(&frame(from + i)).unwrap();
    }
    assert_eq!(enc.finish().unwrap().frames, n as u64, "{what}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.mp4");
    std::fs::write(&path, sink.bytes()).unwrap();
    let pk = packets(&path);
    assert_eq!(pk.len(), n, "{what}");
    for (i, &(t, key)) in pk.iter().enumerate() {
        assert!(
            (t - i as f64 / 25.0).abs() < 1e-6,
            "{what}: frame {i} at {t}"
        );
        assert_eq!(key, i % 25 == 0, "{what}: frame {i} keyframe {key}");
    }
    let decoded = decode_frames(&path, 102, 76);
    assert_eq!(decoded.len(), n, "{what}");
    for (i, d) in decoded.iter().enumerate() {
        // This video's frame: not a picture left over from the last video, nor padding.
        let q = psnr(&crop(d), &frame(from + i).rgb);
        assert!(q > 33.0, "{what}: frame {i} PSNR {q:.1} dB");
        let next = psnr(&crop(d), &frame(from + i + 1).rgb);
        assert!(q > next + 3.0, "{what}: frame {i} is another frame");
    }
}

#[test]
fn workers_kept_between_videos_make_every_video_whole() {
    // The service's way: a process pool, so the workers outlive each video.
    let spares = video::Spares::new();
    let pooled = || {
        let mut s = settings(2, None);
        s.spares = Some(spares.clone());
        s
    };
    let mut first = None;
    // Lengths that end mid-segment on either worker, on a segment boundary, and a video
    // that only needs the first worker. Each video's pattern starts somewhere else.
    for (v, n) in [37usize, 50, 1, 26, 60].into_iter().enumerate() {
        encode_and_check(pooled(), 3 * v + 1, n, &format!("video {v} ({n} frames)"));
        let mut ids = spares.kept_ids();
        ids.sort_unstable();
        assert_eq!(ids.len(), 2, "video {v}: both workers kept");
        // The same two processes serve every video.
        assert_eq!(ids, *first.get_or_insert(ids.clone()), "video {v}");
    }
    // A video given up half way ends its workers instead of keeping them; the next one
    // starts new ones, which are kept after it.
    let mut enc = video::spawn(pooled(), Box::new(std::io::sink())).unwrap();
    for i in 0..30 {
        enc.write_frame(&frame(i)).unwrap();
    }
    drop(enc);
    assert_eq!(spares.kept(), 0, "both were in use, and ended");
    encode_and_check(pooled(), 3, 40, "after a dropped video");
    let ids = spares.kept_ids();
    assert_eq!(ids.len(), 2);
    assert!(ids.iter().all(|id| !first.as_ref().unwrap().contains(id)));
    // Kept workers that die meanwhile (killed from outside) are not used: the next video
    // starts its own.
    for id in &ids {
        let killed = Command::new("kill")
            .args(["-KILL", &id.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
    }
    std::thread::sleep(Duration::from_millis(300));
    encode_and_check(pooled(), 7, 30, "after the kept workers died");
    let fresh = spares.kept_ids();
    assert_eq!(fresh.len(), 2);
    assert!(
        fresh.iter().all(|id| !ids.contains(id)),
        "{fresh:?} {ids:?}"
    );
}

#[test]
fn encoders_started_ahead_are_the_ones_a_video_takes() {
    // One encoder (one process) and two workers (two kept workers and a muxer).
    for workers in [1, 2] {
        let spares = video::Spares::new();
        let mut ahead = settings(workers, None);
        ahead.spares = Some(spares.clone());
        video::start_encoders_ahead(&ahead).unwrap();
        let kept = if workers == 1 { 0 } else { 2 };
        assert_eq!(spares.kept(), kept, "{workers} worker(s)");
        assert_eq!(
            spares.idle(),
            1,
            "{workers} worker(s): the process that takes the speech"
        );
        // Again: no more workers, and a second spare (the pool keeps two per command line).
        video::start_encoders_ahead(&ahead).unwrap();
        assert_eq!(
            (spares.kept(), spares.idle()),
            (kept, 2),
            "{workers} worker(s)"
        );
        let mut started = spares.kept_ids();
        started.sort_unstable();
        // A video with speech through the pipe takes them (WAV; M4A would be read by name).
        let mut s = ahead.clone();
        s.audio = Some(common::media_path("arctic_a0007.wav"));
        let sink = Memory::default();
        let waiting = spares.idle_ids();
        let mut enc = video::spawn(s, Box::new(sink.clone())).unwrap();
        // One of the two is taken (its replacement, a new process, may already be there).
        let still = spares.idle_ids();
        assert_eq!(
            waiting.iter().filter(|p| still.contains(p)).count(),
            1,
            "{workers} worker(s): one taken"
        );
        for i in 0..30 {
            enc.write_frame(&frame(i)).unwrap();
        }
        assert_eq!(enc.finish().unwrap().frames, 30);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.mp4");
        std::fs::write(&path, sink.bytes()).unwrap();
        assert_eq!(packets(&path).len(), 30, "{workers} worker(s)");
        // The workers that served it (and are kept again) are those started ahead.
        let mut ids = spares.kept_ids();
        ids.sort_unstable();
        assert_eq!(ids, started, "{workers} worker(s)");
    }
}

#[test]
fn lengths_around_segment_boundaries_and_without_audio() {
    for n in [1, 24, 25, 26, 50] {
        let bytes = encode(settings(3, None), n);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.mp4");
        std::fs::write(&path, bytes).unwrap();
        let pk = packets(&path);
        assert_eq!(pk.len(), n, "{n} frames");
        assert!(pk
            .iter()
            .enumerate()
            .all(|(i, &(t, k))| { (t - i as f64 / 25.0).abs() < 1e-6 && k == (i % 25 == 0) }));
        let p = probe(&path);
        assert_eq!(p["streams"].as_array().unwrap().len(), 1, "video only");
    }
    // No frames at all: an error-free empty stream is fine, but not a hang.
    let enc = video::spawn(settings(2, None), Box::new(std::io::sink())).unwrap();
    let _ = enc.finish();
}

#[test]
fn segmented_output_streams_while_frames_are_still_coming() {
    let sink = Memory::default();
    let mut enc = video::spawn(settings(2, None), Box::new(sink.clone())).unwrap();
    for i in 0..60 {
        enc.write_frame(&frame(i)).unwrap();
    }
    // Segment 0 is complete and segment 1 has started: the first fragment must come out
    // without any more frames or the end of the input.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let boxes = top_level_boxes(&sink.bytes());
        if boxes.iter().any(|b| b == "mdat") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no fragment before the end: {boxes:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    enc.finish().unwrap();
}

/// A sink that fails after `limit` bytes (a client that went away).
struct Failing(usize);

impl Write for Failing {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.0 < b.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "client left",
            ));
        }
        self.0 -= b.len();
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes up to `frames` frames and finishes; the first error, which there must be.
fn first_error(mut enc: Box<dyn video::VideoEncoder>, frames: usize) -> lipsync::media::Error {
    for i in 0..frames {
        if let Err(e) = enc.write_frame(&frame(i)) {
            return e;
        }
    }
    enc.finish().expect_err("the encoder should have failed")
}

#[test]
fn failures_are_errors_that_end_promptly() {
    // The output goes away mid-stream: writing or finishing reports it.
    for workers in [1, 3] {
        let sink: Sink = Box::new(Failing(2000));
        let enc = video::spawn(settings(workers, None), sink).unwrap();
        let start = Instant::now();
        let err = first_error(enc, 400);
        assert!(err.to_string().contains("went away"), "{workers}: {err}");
        assert!(start.elapsed() < Duration::from_secs(60));
    }

    // A worker's ffmpeg fails: its message comes back, nothing hangs. (A stand-in ffmpeg
    // that refuses to make FLV but muxes like the real one.)
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("ffmpeg");
    std::fs::write(
        &fake,
        "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = flv ] && { echo 'x264 exploded' >&2; exit 3; }; done\nexec ffmpeg \"$@\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut s = settings(2, None);
    s.ffmpeg = fake;
    let enc = video::spawn(s, Box::new(std::io::sink())).unwrap();
    let err = first_error(enc, 200);
    assert!(err.to_string().contains("x264 exploded"), "{err}");

    // Frames of the wrong size are refused; an encoder dropped unfinished cleans up.
    let mut enc = video::spawn(settings(3, None), Box::new(std::io::sink())).unwrap();
    enc.write_frame(&frame(0)).unwrap();
    let wrong = Frame {
        width: W + 1,
        height: H,
        rgb: vec![0; ((W + 1) * H * 3) as usize],
    };
    assert!(enc
        .write_frame(&wrong)
        .unwrap_err()
        .to_string()
        .contains("expects"));
    let start = Instant::now();
    drop(enc);
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// A sink that takes `open` bytes, then blocks until released (a client that stops reading).
struct Stalling {
    open: usize,
    gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Write for Stalling {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.open >= b.len() {
            self.open -= b.len();
            return Ok(b.len());
        }
        let (lock, cv) = &*self.gate;
        let mut released = lock.lock().unwrap();
        while !*released {
            released = cv.wait(released).unwrap();
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_stalled_output_stops_the_segmented_encoder_taking_frames() {
    // 512×512 frames with changing content; the output stops after the first 100 kB.
    let (w, h) = (512u32, 512u32);
    let frames: Vec<Frame> = (0..10)
        .map(|i| Frame {
            width: w,
            height: h,
            rgb: (0..(w * h * 3) as usize)
                .map(|p| ((p * 31 + i * 977) % 251) as u8)
                .collect(),
        })
        .collect();
    let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let sink = Stalling {
        open: 100_000,
        gate: gate.clone(),
    };
    let mut s = EncoderSettings::new(w, h, Fps::DEFAULT);
    s.workers = 2;
    let mut enc = video::spawn(s, Box::new(sink)).unwrap();
    let written = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = written.clone();
    let producer = std::thread::spawn(move || {
        for i in 0..1000 {
            if enc.write_frame(&frames[i % frames.len()]).is_err() {
                return Err(i);
            }
            count.store(i + 1, std::sync::atomic::Ordering::SeqCst);
        }
        enc.finish().map(|s| s.frames as usize).map_err(|_| 1000)
    });
    // Wait until the producer stops making progress.
    let mut last = usize::MAX;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        std::thread::sleep(Duration::from_millis(1500));
        let now = written.load(std::sync::atomic::Ordering::SeqCst);
        if now == last {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the producer never stalled ({now})"
        );
        last = now;
    }
    // What the queues may hold: per worker a segment of frames and one of pictures, the
    // muxer's open fragment, a few in pipes. Far from all 1000.
    assert!(
        last < 200,
        "{last} frames taken for an output that is not being read"
    );
    // Released, everything completes.
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    assert_eq!(producer.join().unwrap(), Ok(1000));
}
