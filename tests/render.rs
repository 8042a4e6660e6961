//! `lipsync render` and `lipsync detect` end to end, as a user runs them. Needs ffmpeg and
//! ffprobe on the PATH (scripts/test.sh installs them).

mod common;

use std::path::Path;
use std::process::Command;

use common::{
    checkpoint, decode_frames, lipsync, media_path, num, probe, stream, text, top_level_boxes,
};
use lipsync::media::face::FaceBox;

/// Mean absolute difference of two RGB frames inside a box.
fn box_difference(a: &[u8], b: &[u8], width: usize, r: &FaceBox) -> f64 {
    let mut sum = 0u64;
    for y in r.y1 as usize..r.y2 as usize {
        let row = (y * width + r.x1 as usize) * 3..(y * width + r.x2 as usize) * 3;
        sum += a[row.clone()]
            .iter()
            .zip(&b[row])
            .map(|(x, y)| u64::from(x.abs_diff(*y)))
            .sum::<u64>();
    }
    sum as f64 / (f64::from(r.width()) * f64::from(r.height()) * 3.0)
}

#[test]
fn render_makes_a_playable_video_that_covers_the_audio() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("astronaut.mp4");
    let faces = dir.path().join("faces");
    let o = lipsync(&[
        &"render",
        &"--checkpoint",
        &checkpoint("legacy_plain.pth"),
        &"--audio",
        &media_path("arctic_a0007.wav"),
        &"--image",
        &media_path("astronaut.png"),
        &"--out",
        &out,
        &"--faces-dir",
        &faces,
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    // The original rule's 97 model frames...
    let mut names: Vec<String> = std::fs::read_dir(&faces)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 97);
    assert_eq!(
        (names[0].as_str(), names[96].as_str()),
        ("00000.png", "00096.png")
    );
    let face = image::open(faces.join("00040.png")).unwrap();
    assert_eq!(
        (face.width(), face.height(), face.color()),
        (96, 96, image::ColorType::Rgb8)
    );

    // ...in a 100-frame H.264 + AAC video as long as the speech, both tracks from 0.
    let p = probe(&out);
    let v = stream(&p, "video");
    let a = stream(&p, "audio");
    assert_eq!(v["codec_name"], "h264");
    assert_eq!(a["codec_name"], "aac");
    assert_eq!(v["nb_read_frames"], "100");
    assert_eq!(v["r_frame_rate"], "25/1");
    assert_eq!(
        (v["width"].as_u64(), v["height"].as_u64()),
        (Some(512), Some(512))
    );
    assert_eq!(
        (a["sample_rate"].as_str(), a["channels"].as_u64()),
        (Some("16000"), Some(1))
    );
    assert_eq!(num(&v["start_time"]), 0.0);
    assert_eq!(num(&a["start_time"]), 0.0);
    assert!(
        (num(&v["duration"]) - 4.0).abs() < 1e-3,
        "{}",
        v["duration"]
    );
    assert!(
        (num(&a["duration"]) - 4.0).abs() < 0.07,
        "{}",
        a["duration"]
    );

    // Fragmented: ftyp, moov, then moof/mdat pairs (a fragment at least every second).
    let bytes = std::fs::read(&out).unwrap();
    let boxes = top_level_boxes(&bytes);
    assert_eq!(&boxes[..2], ["ftyp", "moov"]);
    assert!(
        boxes.iter().filter(|b| *b == "moof").count() >= 4,
        "{boxes:?}"
    );

    // The video holds the 97th frame to the end: inside the face box the last three frames
    // are (up to x264's refinement of a static picture) the 97th, while the model's own
    // consecutive frames differ.
    let err = text(&o.stderr);
    let face: FaceBox = err
        .rsplit("face box ")
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let frames = decode_frames(&out, 512, 512);
    assert_eq!(frames.len(), 100);
    let moving = box_difference(&frames[95], &frames[96], 512, &face);
    for k in 97..100 {
        let held = box_difference(&frames[96], &frames[k], 512, &face);
        assert!(
            held * 2.0 < moving,
            "frame {k}: {held} vs model step {moving}"
        );
    }

    // Speech and lips in step: the decoded soundtrack lines up with the input at lag 0.
    let input = lipsync::media::audio::load(
        &std::fs::read(media_path("arctic_a0007.wav")).unwrap(),
        600.0,
    )
    .unwrap()
    .samples;
    let track = lipsync::media::audio::load(&bytes, 600.0).unwrap().samples;
    let score = |lag: i64| -> f64 {
        (8000..56000)
            .map(|i| f64::from(input[i]) * f64::from(track[(i as i64 + lag) as usize]))
            .sum()
    };
    let best = (-2048i64..=2048)
        .max_by(|&x, &y| score(x).total_cmp(&score(y)))
        .unwrap();
    assert_eq!(best, 0, "soundtrack is {best} samples off");
    // ...and it is the speech, not a rough copy of it: AAC at 128 kb/s by ffmpeg's fast
    // coder keeps it 37.5 dB above its coding noise here (30 allows for ffmpeg versions).
    let (signal, noise) = (8000..56000).fold((0.0, 0.0), |(s, n), i| {
        let (x, y) = (f64::from(input[i]), f64::from(track[i]));
        (s + x * x, n + (x - y) * (x - y))
    });
    let snr = 10.0 * (signal / noise).log10();
    assert!(snr > 30.0, "soundtrack SNR {snr:.1} dB");
}

#[test]
fn hard_blend_faces_match_the_pytorch_opencv_reference() {
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("render/reference.json")).unwrap(),
    )
    .unwrap();
    let b = meta["box"].as_array().unwrap();
    let box_arg = format!("{},{},{},{}", b[0], b[1], b[2], b[3]);
    let dir = tempfile::tempdir().unwrap();
    let faces = dir.path().join("faces");
    let o = lipsync(&[
        &"render",
        &"--checkpoint",
        &checkpoint("legacy_plain.pth"),
        &"--audio",
        &media_path("arctic_a0007_1s.wav"),
        &"--image",
        &media_path("astronaut.png"),
        &"--box",
        &box_arg,
        &"--blend",
        &"hard",
        &"--faces-dir",
        &faces,
        &"--out",
        &dir.path().join("out.mp4"),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let frames = meta["frames"].as_u64().unwrap() as usize;
    let mut worst = 0u8;
    for i in 0..frames {
        let name = format!("{i:05}.png");
        let ours = image::open(faces.join(&name)).unwrap().to_rgb8();
        let reference = image::open(common::fixture(&format!("render/faces/{name}")))
            .unwrap()
            .to_rgb8();
        let d = ours
            .as_raw()
            .iter()
            .zip(reference.as_raw())
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        worst = worst.max(d);
    }
    assert!(!faces.join(format!("{frames:05}.png")).exists());
    eprintln!("max difference from the PyTorch + OpenCV reference: {worst}/255");
    assert!(worst <= 2, "faces differ by {worst}/255");
}

/// Brows-to-chin boxes measured by hand on zoomed, gridded crops of the test photos.
const HAND_MEASURED: [(&str, FaceBox); 2] = [
    (
        "astronaut.png",
        FaceBox {
            x1: 180,
            y1: 90,
            x2: 270,
            y2: 177,
        },
    ),
    (
        "grace_hopper.jpg",
        FaceBox {
            x1: 180,
            y1: 172,
            x2: 360,
            y2: 328,
        },
    ),
];

#[test]
fn detect_finds_brows_to_chin_boxes() {
    for (name, want) in HAND_MEASURED {
        let o = lipsync(&[&"detect", &media_path(name), &"--json"]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let b: Vec<u32> = v["box"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let got = FaceBox {
            x1: b[0],
            y1: b[1],
            x2: b[2],
            y2: b[3],
        };
        let iou = got.iou(&want);
        eprintln!("{name}: {got} vs hand-measured {want}: IoU {iou:.2}");
        assert!(iou >= 0.7, "{name}: IoU {iou}");
        // Default pads add 10 pixels below the chin.
        assert_eq!(v["unpadded"][3].as_u64().unwrap() + 10, u64::from(got.y2));
        // The text form is the box alone, ready for --box.
        let o = lipsync(&[&"detect", &media_path(name)]);
        assert_eq!(text(&o.stdout).trim(), got.to_string());
    }
}

#[test]
fn odd_sizes_downscaling_and_explicit_boxes() {
    let dir = tempfile::tempdir().unwrap();
    let photo = image::open(media_path("astronaut.png")).unwrap();
    let odd = dir.path().join("odd.png");
    photo.crop_imm(100, 30, 301, 257).save(&odd).unwrap();
    let out = dir.path().join("odd.mp4");
    let o = lipsync(&[
        &"render",
        &"--checkpoint",
        &checkpoint("zip_bare.pt"),
        &"--audio",
        &media_path("arctic_a0007_1s.wav"),
        &"--image",
        &odd,
        &"--box",
        &"80,60,170,150",
        &"--fps",
        &"30000/1001",
        &"--out",
        &out,
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let p = probe(&out);
    let v = stream(&p, "video");
    assert_eq!(
        (v["width"].as_u64(), v["height"].as_u64()),
        (Some(302), Some(258))
    );
    assert_eq!(v["r_frame_rate"], "30000/1001");
    // 1.00 s at 29.97 fps: 30 frames (1.001 s) cover the speech.
    assert_eq!(v["nb_read_frames"], "30");

    // A photo larger than --max-side is downscaled (the detected box with it).
    let out = dir.path().join("small.mp4");
    let o = lipsync(&[
        &"render",
        &"--checkpoint",
        &checkpoint("zip_bare.pt"),
        &"--audio",
        &media_path("arctic_a0007_1s.wav"),
        &"--image",
        &media_path("grace_hopper.jpg"),
        &"--max-side",
        &"300",
        &"--out",
        &out,
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = stream(&probe(&out), "video").clone();
    assert_eq!(
        (v["width"].as_u64(), v["height"].as_u64()),
        (Some(256), Some(300))
    );
}

#[test]
fn jobs_render_many_and_one_failure_does_not_stop_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs.jsonl");
    let d = dir.path().display();
    let wav = media_path("arctic_a0007_1s.wav");
    let wav = wav.display();
    let astro = media_path("astronaut.png");
    let hopper = media_path("grace_hopper.jpg");
    std::fs::write(
        &jobs,
        format!(
            "{{\"audio\": \"{wav}\", \"image\": \"{}\", \"out\": \"{d}/a.mp4\", \"box\": \"180,90,270,187\", \"blend\": \"hard\"}}\n\
             \n\
             {{\"audio\": \"{wav}\", \"image\": \"{d}/missing.png\", \"out\": \"{d}/b.mp4\"}}\n\
             {{\"audio\": \"{wav}\", \"image\": \"{}\", \"out\": \"{d}/c.mp4\", \"fps\": 12.5, \"faces_dir\": \"{d}/c_faces\", \"crf\": 30}}\n\
             {{\"audio\": \"{wav}\", \"image\": \"{}\", \"out\": \"{d}/d.mp4\", \"typo\": 1}}\n",
            astro.display(),
            hopper.display(),
            astro.display()
        ),
    )
    .unwrap();
    let o = lipsync(&[
        &"render",
        &"--checkpoint",
        &checkpoint("zip_bare.pt"),
        &"--jobs",
        &jobs,
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("4 jobs") && err.contains("2 succeeded, 2 failed"),
        "{err}"
    );
    assert!(err.contains("missing.png"), "{err}");
    assert!(err.contains("typo"), "{err}");
    for (name, frames) in [("a.mp4", "25"), ("c.mp4", "13")] {
        let v = stream(&probe(&dir.path().join(name)), "video").clone();
        assert_eq!(v["nb_read_frames"], frames, "{name}");
    }
    // 1 s at 12.5 fps: the original loop draws 12 frames (the last window repeats), the video
    // needs 13.
    assert_eq!(
        std::fs::read_dir(dir.path().join("c_faces"))
            .unwrap()
            .count(),
        12
    );
    assert!(!dir.path().join("b.mp4").exists());
    let leftovers = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .to_string_lossy()
                .ends_with(".partial")
        })
        .count();
    assert_eq!(leftovers, 0);
}

#[test]
fn bad_inputs_get_clear_errors_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let gray = dir.path().join("gray.png");
    image::RgbImage::from_pixel(200, 200, image::Rgb([120, 120, 120]))
        .save(&gray)
        .unwrap();
    let ck = checkpoint("zip_bare.pt");
    let out = dir.path().join("x.mp4");
    let run = |audio: &Path, image: &Path, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_lipsync"))
            .arg("render")
            .args(["--checkpoint".as_ref(), ck.as_os_str()])
            .args(["--audio".as_ref(), audio.as_os_str()])
            .args(["--image".as_ref(), image.as_os_str()])
            .args(["--out".as_ref(), out.as_os_str()])
            .args(extra)
            .output()
            .unwrap();
        (o.status.code(), text(&o.stderr))
    };
    let wav = media_path("arctic_a0007_1s.wav");
    let png = media_path("astronaut.png");
    let (code, err) = run(&wav, &gray, &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("no face"), "{err}");
    let (code, err) = run(&wav, &png, &["--box", "400,400,600,600"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("bad box") && err.contains("512x512"), "{err}");
    let (code, err) = run(&png, &png, &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("not an audio file"), "{err}");
    let (code, err) = run(&wav, &wav, &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("not an image") && err.contains("WAV"), "{err}");
    let (code, err) = run(&wav, &png, &["--ffmpeg", "/nonexistent/ffmpeg"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("install ffmpeg"), "{err}");
    let (code, err) = run(&wav, &png, &["--max-pixels", "1000"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("too large"), "{err}");
    assert!(!out.exists());
    // Usage errors: exit 1.
    assert_eq!(run(&wav, &png, &["--crf", "60"]).0, Some(1));
    assert_eq!(run(&wav, &png, &["--blend", "soft"]).0, Some(1));
    assert_eq!(run(&wav, &png, &["--box", "1,2,3"]).0, Some(1));
}

/// The model's faces (8-bit BGR) for the first second of `speech` on the astronaut photo.
fn faces_for(
    model: &lipsync::model::Wav2Lip,
    avatar: &lipsync::engine::Avatar,
    audio: &[u8],
) -> Vec<Vec<u8>> {
    use lipsync::engine::render::{face_batch, mel_batch};
    use lipsync::media::audio::{self, Fps, FramePlan};
    let mut speech = audio::load(audio, 600.0).unwrap();
    speech.samples.truncate(16_000);
    let mel = speech.mel();
    let plan = FramePlan::new(mel.frames(), Fps::DEFAULT).unwrap();
    let dev = model.device().clone();
    let out = model
        .forward(
            &mel_batch(&mel, &plan, 0, plan.len(), &dev).unwrap(),
            &face_batch(avatar, plan.len(), &dev).unwrap(),
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    out.chunks_exact(3 * 96 * 96)
        .map(lipsync::media::face::prediction_to_bgr)
        .collect()
}

fn mean_difference(a: &[Vec<u8>], b: &[Vec<u8>]) -> f64 {
    let n = a.len().min(b.len());
    let sum: u64 = a[..n]
        .iter()
        .zip(&b[..n])
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| u64::from(p.abs_diff(*q))))
        .sum();
    sum as f64 / (n * 3 * 96 * 96) as f64
}

#[test]
fn the_same_speech_in_any_format_draws_the_same_faces() {
    use lipsync::media::face::{Blend, Pads};
    use lipsync::media::image::ImageLimits;
    let (w, _) =
        lipsync::model::GeneratorWeights::from_file(&checkpoint("legacy_plain.pth")).unwrap();
    let model =
        lipsync::model::Wav2Lip::load(&w, &candle_core::Device::Cpu, candle_core::DType::F32)
            .unwrap();
    let avatar = lipsync::engine::Avatar::prepare(
        &std::fs::read(media_path("astronaut.png")).unwrap(),
        &ImageLimits::default(),
        None,
        Pads::default(),
        Blend::Feather,
    )
    .unwrap();
    let read = |n: &str| std::fs::read(media_path(n)).unwrap();
    let base = faces_for(&model, &avatar, &read("arctic_a0007.wav"));
    assert_eq!(base.len(), 22);
    // 44.1 kHz stereo WAV, made from the FLAC (lossless) with hound.
    let flac = lipsync::media::audio::decode::decode(&read("arctic_a0007_44k_stereo.flac"), 600.0)
        .unwrap();
    let stereo: Vec<f32> = flac.samples.iter().flat_map(|&x| [x, x]).collect();
    let wav = common::wav(&stereo, 44_100, 2);
    let mut inputs = vec![("44.1 kHz stereo WAV".to_string(), wav)];
    for ext in ["flac", "mp3", "ogg", "m4a"] {
        inputs.push((
            ext.to_string(),
            read(&format!("arctic_a0007_44k_stereo.{ext}")),
        ));
    }
    let mut worst_same = 0f64;
    for (name, bytes) in &inputs {
        let faces = faces_for(&model, &avatar, bytes);
        let d = mean_difference(&base, &faces);
        worst_same = worst_same.max(d);
        eprintln!(
            "{name}: {} frames, mean face difference {:.2}/255",
            faces.len(),
            d
        );
        assert!(faces.len().abs_diff(base.len()) <= 1, "{name}");
        assert!(d < 3.0, "{name}: {d}/255");
    }
    // Different speech: the same words read backwards.
    let mut speech = lipsync::media::audio::load(&read("arctic_a0007.wav"), 600.0).unwrap();
    speech.samples.reverse();
    let other = faces_for(&model, &avatar, &common::wav(&speech.samples, 16_000, 1));
    let d = mean_difference(&base, &other);
    eprintln!("different speech: mean face difference {d:.2}/255");
    // Clearly different: beyond the same-speech bound, and far beyond any codec's effect.
    assert!(
        d > 3.0 && d > 2.0 * worst_same,
        "different speech: {d}/255, same speech up to {worst_same}/255"
    );
}

#[test]
fn a_lossless_render_carries_every_composited_frame_exactly() {
    // Frames go to the encoder processes in reused buffers, and for a photo only the face's
    // region is copied into a buffer that held an earlier frame. With x264 lossless
    // (`--crf 0`) the decoded video must be, frame for frame, the composited frames
    // (`--frames-dir`) converted to YUV 4:2:0, then the last one held to the end of the
    // audio: a buffer brought up to date wrongly shows an earlier frame's mouth. One process,
    // and the segmented encoder with two and three workers.
    use lipsync::media::image::Frame;
    use lipsync::media::yuv::Yuv420;
    let dir = tempfile::tempdir().unwrap();
    for workers in ["1", "2", "3"] {
        let out = dir.path().join(format!("w{workers}.mp4"));
        let frames_dir = dir.path().join(format!("frames{workers}"));
        let o = lipsync(&[
            &"render",
            &"--device",
            &"echo",
            &"--audio",
            &media_path("arctic_a0007.wav"),
            &"--image",
            &media_path("astronaut.png"),
            &"--crf",
            &"0",
            &"--encoder-workers",
            &workers,
            &"--frames-dir",
            &frames_dir,
            &"--out",
            &out,
        ]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let mut names: Vec<_> = std::fs::read_dir(&frames_dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        let composited: Vec<Vec<u8>> = names
            .iter()
            .map(|p| {
                let rgb = image::open(p).unwrap().to_rgb8();
                let (w, h) = rgb.dimensions();
                Yuv420::from_rgb(&Frame::new(w, h, rgb.into_raw()))
                    .bytes()
                    .to_vec()
            })
            .collect();
        // The echo moves the mouth every frame, so no frame may stand in for the one before.
        assert!(composited.len() > 90, "{} frames kept", composited.len());
        for (k, pair) in composited.windows(2).enumerate() {
            assert!(pair[0] != pair[1], "frames {k} and {} are the same", k + 1);
        }
        let decoded = Command::new("ffmpeg")
            .args(["-v", "error", "-i"])
            .arg(&out)
            .args(["-map", "0:v", "-f", "rawvideo", "-pix_fmt", "yuv420p", "-"])
            .output()
            .unwrap();
        assert!(decoded.status.success(), "{}", text(&decoded.stderr));
        let size = composited[0].len();
        let video: Vec<&[u8]> = decoded.stdout.chunks_exact(size).collect();
        // 4.00 s of speech at 25 fps.
        assert_eq!(video.len(), 100, "{workers} worker(s)");
        let last = composited.last().unwrap();
        for (k, got) in video.iter().enumerate() {
            let want = composited.get(k).unwrap_or(last);
            assert!(got == want, "frame {k} with {workers} worker(s)");
        }
    }
}
