//! `bench`: model-only frames/s by batch size, precision and instance count; encoder
//! frames/s; end-to-end seconds and time to first byte through the service's pipeline (pool,
//! batcher, job, compositor, encoder), without HTTP.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use lipsync::config::choice;
use lipsync::engine::batcher::Limits;
use lipsync::engine::pool::PoolConfig;
use lipsync::engine::render::{face_batch, mel_batch};
use lipsync::engine::{Avatar, Engine, Job};
use lipsync::media::audio::{self, Fps, FramePlan};
use lipsync::media::face::{Blend, Pads};
use lipsync::media::image::ImageLimits;
use lipsync::media::video::{self, EncoderSettings};
use lipsync::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use lipsync::model::{self, DeviceKind, GeneratorWeights, Precision, Wav2Lip};

use super::{read_file, CliError};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Wav2Lip checkpoint (any form; `lipsync init-weights` output is fine: speed does not
    /// depend on the values).
    #[arg(long, env = "LIPSYNC_CHECKPOINT", required_unless_present = "video")]
    pub checkpoint: Option<PathBuf>,
    /// Where the model runs [default: cuda when built with CUDA and a GPU is present, else cpu].
    #[arg(long, value_parser = choice::<DeviceKind>(DeviceKind::NAMES))]
    pub device: Option<DeviceKind>,
    /// Precisions to measure, comma-separated [default: f32,f16,bf16 on CUDA, f32 on CPU].
    #[arg(long, value_delimiter = ',', value_parser = choice::<Precision>(Precision::NAMES))]
    pub dtypes: Vec<Precision>,
    #[command(flatten)]
    pub conv: lipsync::config::ConvArgs,
    /// Batch sizes to measure [default: 1,16,64,128,256,512 on CUDA, 1,4,16 on CPU].
    #[arg(long, value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Instance counts for the concurrency run [default: 1,2,3 on CUDA, 1,2 on CPU].
    #[arg(long, value_delimiter = ',')]
    pub instances: Vec<usize>,
    /// Batch size of the concurrency run [default: 128 on CUDA, 8 on CPU].
    #[arg(long)]
    pub instance_batch: Option<usize>,
    /// Seconds to measure each configuration.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Frames to encode in the encoder-only run (0 skips it): 1000 is 40 s of video.
    #[arg(long, default_value_t = 1000)]
    pub encode_frames: usize,
    /// Encoder worker counts for the encoder-only run [default: 1, 2, 4, 8, 16 up to the
    /// number of cores, and the serve default].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=64))]
    pub encoder_workers: Vec<u16>,
    /// Seconds of speech for the end-to-end runs [default: 10,40 on CUDA, 10 on CPU].
    #[arg(long, value_delimiter = ',')]
    pub e2e: Vec<f64>,
    /// Speech for the end-to-end runs (looped to length).
    #[arg(long, default_value = "tests/media/arctic_a0007.wav")]
    pub audio: PathBuf,
    /// Avatar for the encoder and end-to-end runs.
    #[arg(long, default_value = "tests/media/astronaut.png")]
    pub image: PathBuf,
    /// Measure a clip avatar instead of the model: its preparation and size, and compositing
    /// plus encoding on it vs on a photo vs x264 alone (no model, no checkpoint needed).
    #[arg(long)]
    pub video: Option<PathBuf>,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The ffmpeg executable.
    #[arg(long, env = "LIPSYNC_FFMPEG", default_value = "ffmpeg")]
    pub ffmpeg: PathBuf,
}

/// Runs `f` repeatedly for at least `seconds` (and 3 times); returns (runs, elapsed).
fn timed(
    seconds: f64,
    mut f: impl FnMut() -> Result<(), CliError>,
) -> Result<(usize, Duration), CliError> {
    let start = Instant::now();
    let mut runs = 0;
    while runs < 3 || start.elapsed().as_secs_f64() < seconds {
        f()?;
        runs += 1;
    }
    Ok((runs, start.elapsed()))
}

fn inputs(n: usize, dev: &candle_core::Device) -> Result<(Tensor, Tensor), CliError> {
    let mel =
        Tensor::randn(0f32, 1.0, (n, 1, MEL_BINS, MEL_STEPS), dev).map_err(model::Error::from)?;
    let face = Tensor::rand(0f32, 1.0, (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), dev)
        .map_err(model::Error::from)?;
    Ok((mel, face))
}

/// Faces predicted from the avatar and the first frames of the speech by
/// every precision and convolution path, against candle's operations in f32: PSNR (faces in
/// 0–1) and largest difference.
fn accuracy(
    a: &BenchArgs,
    device: DeviceKind,
    dtypes: &[Precision],
    weights: &GeneratorWeights,
    avatar: &Avatar,
) -> Result<serde_json::Value, CliError> {
    // Enough faces to cover several mouth shapes; fewer on the CPU, where candle is slow.
    let frames = if device == DeviceKind::Cuda { 32 } else { 8 };
    let speech = audio::load(&read_file(&a.audio)?, 3600.0)?;
    let mel = speech.mel();
    let plan = FramePlan::new(mel.frames(), Fps::DEFAULT)?;
    let n = plan.len().min(frames);
    let dev = device.open_instance()?;
    let err = |e: lipsync::engine::Error| CliError::Jobs(e.to_string());
    let mel_in = mel_batch(&mel, &plan, 0, n, &dev).map_err(err)?;
    let face_in = face_batch(avatar, n, &dev).map_err(err)?;
    let run = |m: &Wav2Lip| -> Result<Tensor, CliError> {
        Ok(m.forward(&mel_in, &face_in)?
            .to_dtype(DType::F32)
            .map_err(model::Error::from)?)
    };
    let mut reference = Wav2Lip::load(weights, &dev, DType::F32)?;
    reference.use_candle_operations();
    let reference = run(&reference)?;
    println!(
        "\n## Accuracy ({n} faces from {} and {}, vs candle's operations in f32)\n",
        a.image.display(),
        a.audio.display()
    );
    println!("| dtype | convolutions | PSNR | max difference |");
    println!("|---|---|---|---|");
    let mut rows = Vec::new();
    for &p in dtypes {
        let dtype = model::compute_dtype(&dev, p);
        let mut m = Wav2Lip::load(weights, &dev, dtype)?;
        m.verify_cudnn_path()?;
        let mut paths = vec![m.conv_engine()];
        if m.conv_engine() != "candle" && dtype != DType::F32 {
            paths.push("candle");
        }
        for path in paths {
            if path == "candle" {
                m.use_candle_operations();
            }
            let out = run(&m)?;
            let psnr = model::wav2lip::face_psnr(&out, &reference)?;
            let max = (out - &reference)
                .and_then(|d| d.abs())
                .and_then(|d| d.flatten_all())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .map_err(model::Error::from)?;
            println!("| {} | {path} | {psnr:.1} dB | {max:.2e} |", dtype.as_str());
            rows.push(serde_json::json!({
                "dtype": p, "compute_dtype": dtype.as_str(), "path": path,
                "psnr_db": if psnr.is_finite() { Some(psnr) } else { None }, "max_diff": max
            }));
        }
    }
    Ok(serde_json::Value::Array(rows))
}

/// One forward, waited for (reading a scalar back synchronises the device).
fn forward_sync(model: &Wav2Lip, mel: &Tensor, face: &Tensor) -> Result<(), CliError> {
    let out = model.forward(mel, face)?;
    out.to_dtype(DType::F32)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>())
        .map_err(model::Error::from)?;
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<(), CliError> {
    if let Some(clip) = &a.video {
        let results = super::bench_clip::bench_clip(&a, clip)?;
        if let Some(path) = &a.json {
            write_json(path, &results)?;
        }
        return Ok(());
    }
    let checkpoint = a.checkpoint.clone().expect("clap requires --checkpoint");
    a.conv.apply();
    let device = a.device.unwrap_or_else(DeviceKind::default_for_host);
    let cuda = device == DeviceKind::Cuda;
    let or = |v: &Vec<usize>, d: &[usize]| if v.is_empty() { d.to_vec() } else { v.clone() };
    let batches = or(
        &a.batches,
        if cuda {
            &[1, 16, 64, 128, 256, 512]
        } else {
            &[1, 4, 16]
        },
    );
    let instances = or(&a.instances, if cuda { &[1, 2, 3] } else { &[1, 2] });
    let instance_batch = a.instance_batch.unwrap_or(if cuda { 128 } else { 8 });
    let dtypes = if a.dtypes.is_empty() {
        if cuda {
            vec![Precision::F32, Precision::F16, Precision::Bf16]
        } else {
            vec![Precision::F32]
        }
    } else {
        a.dtypes.clone()
    };
    let e2e = if a.e2e.is_empty() {
        if cuda {
            vec![10.0, 40.0]
        } else {
            vec![10.0]
        }
    } else {
        a.e2e.clone()
    };
    let (weights, _) = GeneratorWeights::from_file(&checkpoint)?;
    let weights = Arc::new(weights.fold()?);
    let mut results = serde_json::json!({
        "device": device, "host_cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "version": env!("CARGO_PKG_VERSION"),
    });

    println!("## Model only ({device:?}, frames/s, one instance)\n");
    println!(
        "| dtype | convolutions | {} |",
        batches
            .iter()
            .map(|b| format!("batch {b}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---|{}", "---|".repeat(batches.len()));
    let mut model_rows = Vec::new();
    for &p in &dtypes {
        let dev = device.open_instance()?;
        let dtype = model::compute_dtype(&dev, p);
        let mut m = Wav2Lip::load(&weights, &dev, dtype)?;
        m.verify_cudnn_path()?;
        // The serving path, and on CUDA candle's operations beside it (the reference).
        let mut paths = vec![m.conv_engine()];
        if cuda && m.conv_engine() != "candle" {
            paths.push("candle");
        }
        for path in paths {
            if path == "candle" {
                m.use_candle_operations();
            }
            let mut cells = Vec::new();
            for &b in &batches {
                let (mel, face) = inputs(b, &dev)?;
                forward_sync(&m, &mel, &face)?; // warm-up (and autotuning)
                let (runs, t) = timed(a.seconds, || forward_sync(&m, &mel, &face))?;
                let fps = (runs * b) as f64 / t.as_secs_f64();
                model_rows.push(serde_json::json!({
                    "dtype": p, "compute_dtype": dtype.as_str(), "path": path, "batch": b, "fps": fps
                }));
                cells.push(format!("{fps:.1}"));
            }
            println!("| {} | {path} | {} |", dtype.as_str(), cells.join(" | "));
        }
    }
    results["model"] = serde_json::Value::Array(model_rows);

    println!(
        "\n## Instances (batch {instance_batch}, {:?}, aggregate frames/s)\n",
        dtypes[0]
    );
    println!("| instances | frames/s | vs one |");
    println!("|---|---|---|");
    let mut inst_rows = Vec::new();
    let mut one = 0.0;
    let precision = dtypes[0];
    for &n in &instances {
        // All instances load and warm up, then measure together; their frames/s add up.
        let rates = Arc::new(Mutex::new(Vec::new()));
        let barrier = Arc::new(std::sync::Barrier::new(n));
        let errors = Arc::new(Mutex::new(None));
        std::thread::scope(|s| {
            for _ in 0..n {
                let (weights, rates, errors) = (weights.clone(), rates.clone(), errors.clone());
                let barrier = barrier.clone();
                let seconds = a.seconds;
                s.spawn(move || {
                    let run = || -> Result<(), CliError> {
                        let ready = (|| {
                            let dev = device.open_instance()?;
                            let m = Wav2Lip::load(
                                &weights,
                                &dev,
                                model::compute_dtype(&dev, precision),
                            )?;
                            let (mel, face) = inputs(instance_batch, &dev)?;
                            forward_sync(&m, &mel, &face)?;
                            Ok::<_, CliError>((m, mel, face))
                        })();
                        barrier.wait(); // even when this one failed, so the others go on
                        let (m, mel, face) = ready?;
                        let (runs, t) = timed(seconds, || forward_sync(&m, &mel, &face))?;
                        rates
                            .lock()
                            .unwrap()
                            .push((runs * instance_batch) as f64 / t.as_secs_f64());
                        Ok(())
                    };
                    if let Err(e) = run() {
                        *errors.lock().unwrap() = Some(e.to_string());
                    }
                });
            }
        });
        if let Some(e) = errors.lock().unwrap().take() {
            return Err(CliError::Jobs(format!("instance run failed: {e}")));
        }
        let fps: f64 = rates.lock().unwrap().iter().sum();
        if n == instances[0] {
            one = fps / n as f64;
        }
        inst_rows.push(serde_json::json!({ "instances": n, "batch": instance_batch, "fps": fps }));
        println!("| {n} | {fps:.1} | {:.2}x |", fps / one.max(1e-9));
    }
    results["instances"] = serde_json::Value::Array(inst_rows);

    let avatar = Avatar::prepare(
        &read_file(&a.image)?,
        &ImageLimits::default(),
        None,
        Pads::default(),
        Blend::Feather,
    )?;
    results["accuracy"] = accuracy(&a, device, &dtypes, &weights, &avatar)?;

    let serve_workers = video::default_workers(cuda);
    if a.encode_frames > 0 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut workers: Vec<usize> = a.encoder_workers.iter().map(|&w| w as usize).collect();
        if workers.is_empty() {
            workers = [1, 2, 4, 8, 16]
                .into_iter()
                .filter(|&w| w <= cores)
                .collect();
            if !workers.contains(&serve_workers) {
                workers.push(serve_workers);
            }
        }
        let frames = moving_frames(&avatar, 50);
        let (w, h) = (avatar.frame.width, avatar.frame.height);
        println!(
            "\n## Encoder only ({} frames of {w}x{h}, x264 veryfast crf 20, fragmented MP4; {cores} cores)\n",
            a.encode_frames
        );
        println!("| encoder workers | x264 threads each | frames/s | seconds | vs one worker |");
        println!("|---|---|---|---|---|");
        let mut rows = Vec::new();
        let mut one = None;
        for &n in &workers {
            let mut settings = EncoderSettings::new(w, h, Fps::DEFAULT);
            settings.ffmpeg = a.ffmpeg.clone();
            settings.workers = n;
            let threads = if n == 1 {
                "auto".to_string()
            } else {
                settings.worker_threads().to_string()
            };
            let t = Instant::now();
            let mut enc = video::spawn(settings, Box::new(std::io::sink()))?;
            for i in 0..a.encode_frames {
                enc.write_frame(&frames[i % frames.len()])?;
            }
            enc.finish()?;
            let secs = t.elapsed().as_secs_f64();
            let fps = a.encode_frames as f64 / secs;
            let base = *one.get_or_insert(fps);
            println!(
                "| {n} | {threads} | {fps:.1} | {secs:.2} | {:.2}x |",
                fps / base
            );
            rows.push(serde_json::json!({ "workers": n, "threads": threads, "fps": fps, "seconds": secs }));
        }
        results["encoder"] =
            serde_json::json!({ "frames": a.encode_frames, "width": w, "height": h, "runs": rows });
    }

    println!(
        "\n## End to end (pool, batcher, compositor, encoder with {serve_workers} worker(s); no HTTP)\n"
    );
    println!("| speech | model frames | video frames | total | time to first byte |");
    println!("|---|---|---|---|---|");
    let loader = lipsync::engine::backend::Wav2LipLoader {
        weights: weights.clone(),
        device,
        max_batch: if cuda { 512 } else { 16 },
    };
    let engine = Engine::start(
        Arc::new(loader),
        PoolConfig {
            precision: dtypes[0],
            instances: instances
                .iter()
                .copied()
                .max()
                .unwrap_or(1)
                .min(if cuda { 3 } else { 1 }),
            limits: Limits {
                max_batch: if cuda { 512 } else { 16 },
                first_batch: if cuda { 16 } else { 4 },
                fill_batch: if cuda { 16 } else { 4 },
                max_queue: usize::MAX,
                max_ahead: if cuda { 1024 } else { 32 },
            },
            batch_wait: Duration::from_millis(2),
            pad_batches: cuda,
            memory_limit: None,
            warm_up: true,
            fill_latency: Duration::from_millis(150),
        },
    );
    engine.wait_ready().map_err(CliError::Jobs)?;
    let clip = audio::load(&read_file(&a.audio)?, 3600.0)?.samples;
    let mut e2e_rows = Vec::new();
    for &seconds in &e2e {
        let n = (seconds * 16_000.0) as usize;
        let samples: Vec<f32> = clip.iter().copied().cycle().take(n).collect();
        let wav = tempfile::Builder::new()
            .suffix(".wav")
            .tempfile()
            .map_err(|e| CliError::Jobs(e.to_string()))?;
        write_wav(wav.path(), &samples)?;
        let bytes = read_file(wav.path())?;
        let start = Instant::now();
        let speech = audio::load(&bytes, 3600.0)?;
        let face = avatar.crop(0);
        let planned = lipsync::engine::plan(&speech, Fps::DEFAULT, &|_| face.clone())?;
        let model_frames = planned.frames.len();
        let submission = engine
            .submit(planned.frames)
            .map_err(|_| CliError::Jobs("queue full".into()))?;
        let mut settings =
            EncoderSettings::new(avatar.frame.width, avatar.frame.height, Fps::DEFAULT);
        settings.audio = Some(wav.path().to_path_buf());
        settings.ffmpeg = a.ffmpeg.clone();
        settings.workers = serve_workers;
        let first = Arc::new(Mutex::new(None));
        let sink = FirstByte {
            start,
            first: first.clone(),
        };
        let encoder = video::spawn(settings, Box::new(sink))?;
        let job = Job {
            submission,
            video_frames: planned.video_frames,
            avatar: Arc::new(avatar.clone()),
            loop_mode: lipsync::engine::Loop::default(),
            faces_dir: None,
        };
        let summary = job.run(encoder, &|| false, &mut |_, _| {})?.summary;
        let total = start.elapsed().as_secs_f64();
        let ttfb = first.lock().unwrap().unwrap_or(f64::NAN);
        println!(
            "| {seconds} s | {} | {} | {total:.2} s | {ttfb:.2} s |",
            model_frames, summary.frames
        );
        e2e_rows.push(serde_json::json!({ "encoder_workers": serve_workers, "speech_seconds": seconds, "model_frames": model_frames, "video_frames": summary.frames, "seconds": total, "ttfb_seconds": ttfb }));
    }
    engine.shutdown();
    results["end_to_end"] = serde_json::Value::Array(e2e_rows);
    if let Some(path) = &a.json {
        write_json(path, &results)?;
    }
    Ok(())
}

fn write_json(path: &std::path::Path, results: &serde_json::Value) -> Result<(), CliError> {
    std::fs::write(path, serde_json::to_vec_pretty(results).unwrap_or_default()).map_err(|source| {
        CliError::Read {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// `n` different frames of the avatar, as lip sync makes them: the picture stays, the face
/// box changes from frame to frame (a moving texture, so x264 has real work there).
fn moving_frames(avatar: &Avatar, n: usize) -> Vec<lipsync::media::image::Frame> {
    let f = &avatar.frame;
    let b = avatar.face;
    (0..n)
        .map(|i| {
            let mut frame = f.clone();
            for y in b.y1 as usize..(b.y2 as usize).min(f.height as usize) {
                for x in b.x1 as usize..(b.x2 as usize).min(f.width as usize) {
                    let p = (y * f.width as usize + x) * 3;
                    for c in 0..3 {
                        let t = ((x * 7 + y * 3 + i * 11 + c * 13) % 64) as u8;
                        frame.rgb[p + c] = frame.rgb[p + c] / 2 + 2 * t;
                    }
                }
            }
            frame
        })
        .collect()
}

/// Discards the video, noting when its first byte came.
struct FirstByte {
    start: Instant,
    first: Arc<Mutex<Option<f64>>>,
}

impl Write for FirstByte {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.first
            .lock()
            .unwrap()
            .get_or_insert_with(|| self.start.elapsed().as_secs_f64());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_wav(path: &std::path::Path, samples: &[f32]) -> Result<(), CliError> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let err = |e: hound::Error| CliError::Jobs(format!("cannot write {}: {e}", path.display()));
    let mut w = hound::WavWriter::create(path, spec).map_err(err)?;
    for s in samples {
        w.write_sample((s.clamp(-1.0, 1.0) * 32767.0) as i16)
            .map_err(err)?;
    }
    w.finalize().map_err(err)
}
