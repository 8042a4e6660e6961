//! The model parts of `lipsync bench`: frames/s and device memory by dtype, path and batch;
//! instances sharing the frames in flight; accuracy against an exact f32 reference; load and
//! warm-up time with and without the autotune cache file.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use lipsync::engine::backend::{load_wav2lip, Wav2LipLoader};
use lipsync::engine::render::{face_batch, mel_batch};
use lipsync::engine::{Avatar, Engine};
use lipsync::media::audio::{self, Fps, FramePlan};
use lipsync::model::wav2lip::ActivationRanges;
use lipsync::model::{self, DeviceKind, GeneratorWeights, Wav2Lip};
use serde_json::{json, Value};

use super::{
    device_name, forward_sync, inputs, per_instance_batch, serve_settings, timed, BenchArgs, Plan,
};
use crate::commands::{read_file, CliError};

/// Faces in the accuracy run: enough to cover several mouth shapes; fewer on the CPU, where
/// the half-precision paths are candle's (slow) operations.
const ACCURACY_FRAMES_CUDA: usize = 32;
const ACCURACY_FRAMES_CPU: usize = 8;

/// How often the memory sampler reads the device's memory while a forward runs.
const MEMORY_SAMPLE: Duration = Duration::from_micros(200);

/// Reads how much device memory is in use on a model's GPU: total minus free, from the
/// driver (`cuMemGetInfo`), so it counts everything on the device (the bench is alone there
/// in a GPU run). Nothing on the CPU.
#[derive(Clone)]
pub(super) struct Meter {
    #[cfg(feature = "cuda")]
    context: Option<Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>>,
}

impl Meter {
    pub(super) fn new(dev: &Device) -> Meter {
        #[cfg(feature = "cuda")]
        {
            Meter {
                context: match dev {
                    Device::Cuda(d) => Some(d.cuda_stream().context().clone()),
                    _ => None,
                },
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dev;
            Meter {}
        }
    }

    /// Bytes in use now; `None` on the CPU (or if the driver does not answer).
    pub(super) fn in_use(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Some(ctx) = &self.context {
            return ctx
                .mem_get_info()
                .ok()
                .map(|(free, total)| total.saturating_sub(free) as u64);
        }
        None
    }

    /// The most bytes in use while `f` runs, read every [`MEMORY_SAMPLE`] from a second
    /// thread (a peak shorter than that may be missed); `None` on the CPU, where `f` still
    /// runs.
    pub(super) fn peak_during(
        &self,
        f: impl FnOnce() -> Result<(), CliError>,
    ) -> Result<Option<u64>, CliError> {
        let Some(start) = self.in_use() else {
            f()?;
            return Ok(None);
        };
        let peak = AtomicU64::new(start);
        let stop = AtomicBool::new(false);
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(used) = self.in_use() {
                        peak.fetch_max(used, Ordering::Relaxed);
                    }
                    std::thread::sleep(MEMORY_SAMPLE);
                }
            });
            let r = f();
            stop.store(true, Ordering::Relaxed);
            r
        });
        result?;
        let end = self.in_use().unwrap_or(0);
        Ok(Some(peak.load(Ordering::Relaxed).max(end)))
    }
}

/// A memory table cell: MiB, or why there is no number.
fn mib(bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!("{:.0}", b as f64 / (1u64 << 20) as f64),
        None => "n/a (cpu)".into(),
    }
}

/// Frames/s by dtype, convolution path (the serving one, and on CUDA candle's beside it) and
/// batch, then the device memory of each: in use before the model is loaded, once it is
/// loaded and checked, and at its peak during two forwards at each batch. Returns the
/// frames/s rows and the memory rows.
pub(super) fn model(
    a: &BenchArgs,
    plan: &Plan,
    weights: &Arc<GeneratorWeights>,
) -> Result<(Value, Value), CliError> {
    let cuda = plan.device == DeviceKind::Cuda;
    println!(
        "## Model only ({}, frames/s, one instance)\n",
        device_name(plan.device)
    );
    println!("| dtype | convolutions | {} |", plan.batch_columns(""));
    println!("|---|---|{}", "---|".repeat(plan.batches.len()));
    let mut rows = Vec::new();
    let mut memory = Vec::new();
    let mut notes = Vec::new();
    let mut ranges = None;
    for &p in &plan.dtypes {
        let dev = plan.device.open_instance(plan.cuda_device)?;
        let meter = Meter::new(&dev);
        let before = meter.in_use();
        let dtype = model::compute_dtype(&dev, p);
        let mut m = Wav2Lip::load(weights, &dev, dtype)?;
        // As the service does: the own path is checked at batch 2 and at the largest batch.
        let first = m.conv_engine();
        if let Some(psnr) = m.verify_cudnn_path_at(plan.largest_batch())? {
            if m.conv_engine() != first {
                notes.push(format!(
                    "{}: the {first} path failed its start-up check ({psnr:.1} dB); candle's \
                     operations only",
                    dtype.as_str()
                ));
            }
        }
        // The serving path; in f16/bf16 also with the overflow check the service adds
        // (measured on the checkpoint as the service does); and on CUDA candle's operations
        // beside it (the reference).
        let own = m.conv_engine();
        let mut paths = vec![(own, false)];
        if dtype != DType::F32 {
            if ranges.is_none() {
                ranges = Some(ActivationRanges::measure(weights)?);
            }
            m.check_overflow(ranges.as_ref().expect("measured"));
            paths.push((own, true));
        }
        if cuda && own != "candle" {
            paths.push(("candle", false));
        }
        for (path, guarded) in paths {
            if path == "candle" {
                m.use_candle_operations();
            }
            let label = if guarded {
                format!("{path} + overflow check")
            } else {
                path.to_string()
            };
            let loaded = meter.in_use();
            let (mut cells, mut peaks) = (Vec::new(), Vec::new());
            for &b in &plan.batches {
                if path == "candle" && a.candle_max_batch.is_some_and(|max| b as u32 > max) {
                    cells.push("skipped".to_string());
                    peaks.push(None);
                    continue;
                }
                let (mel, face) = inputs(b, &dev)?;
                let run = || forward_sync(&m, &mel, &face, guarded);
                run()?; // warm-up (and autotuning)
                let (runs, t) = timed(a.seconds, run)?;
                let fps = (runs * b) as f64 / t.as_secs_f64();
                // Memory after timing, so the sampler does not disturb the timed runs.
                let peak = meter.peak_during(|| {
                    run()?;
                    run()
                })?;
                rows.push(json!({
                    "dtype": p, "compute_dtype": dtype.as_str(), "path": path,
                    "overflow_check": guarded, "batch": b, "fps": fps, "peak_memory_bytes": peak
                }));
                cells.push(format!("{fps:.1}"));
                peaks.push(Some(peak));
            }
            println!("| {} | {label} | {} |", dtype.as_str(), cells.join(" | "));
            memory.push((dtype.as_str(), label, before, loaded, peaks));
        }
    }
    if let Some(max) = a.candle_max_batch.filter(|_| cuda) {
        notes.push(format!(
            "candle's operations skipped above batch {max} (--candle-max-batch)"
        ));
    }
    for note in &notes {
        println!("\n{note}");
    }

    println!(
        "\n## Device memory in use ({}, MiB: before loading, once loaded and checked, peak \
         during two forwards at each batch, read every {} µs)\n",
        device_name(plan.device),
        MEMORY_SAMPLE.as_micros()
    );
    println!(
        "| dtype | convolutions | before load | loaded | {} |",
        plan.batch_columns(" peak")
    );
    println!("|---|---|---|---|{}", "---|".repeat(plan.batches.len()));
    let mut memory_rows = Vec::new();
    for (dtype, path, before, loaded, peaks) in memory {
        println!(
            "| {dtype} | {path} | {} | {} | {} |",
            mib(before),
            mib(loaded),
            peaks
                .iter()
                .map(|&p| p.map_or_else(|| "skipped".to_string(), mib))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        memory_rows.push(json!({
            "compute_dtype": dtype, "path": path, "before_load_bytes": before,
            "loaded_bytes": loaded,
            "peaks": plan.batches.iter().zip(&peaks)
                .filter_map(|(b, p)| p.map(|p| json!({ "batch": b, "peak_bytes": p })))
                .collect::<Vec<_>>(),
        }));
    }
    let memory = json!({
        "measured": cuda,
        "note": if cuda { "device total minus free (cuMemGetInfo)" } else { "n/a (cpu)" },
        "rows": memory_rows,
    });
    Ok((Value::Array(rows), memory))
}

/// One instance against several sharing the same frames in flight (each of n instances runs
/// batches of frames / n), all loaded as the service loads them and running its forward (with
/// the overflow check in f16/bf16), in the service precision, measured together: aggregate
/// frames/s.
pub(super) fn instances(
    a: &BenchArgs,
    plan: &Plan,
    weights: &Arc<GeneratorWeights>,
) -> Result<Value, CliError> {
    println!(
        "\n## Instances ({} frames in flight shared by the instances, {}, aggregate frames/s)\n",
        plan.instance_frames,
        plan.service_text()
    );
    let first = plan.instances.first().copied().unwrap_or(1);
    println!(
        "| instances | batch each | frames in flight | frames/s | vs {first} instance(s) | device MiB after warm-up | device MiB at peak |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut base = None;
    for &n in &plan.instances {
        let batch = per_instance_batch(plan.instance_frames, n);
        // All instances load (as the service does, checking the own path at their batch) and
        // warm up, then measure together; their frames/s add up.
        let rates = Mutex::new(Vec::new());
        let errors = Mutex::new(None);
        let barrier = Barrier::new(n);
        let paths = Mutex::new(Vec::new());
        // Device memory in use (the whole device: contexts included) once every instance
        // has warmed up, and its peak while they run.
        let after_warm_up = Mutex::new(None);
        let meter = Mutex::new(None::<Meter>);
        let peak = AtomicU64::new(0);
        let running = AtomicBool::new(true);
        std::thread::scope(|s| {
            s.spawn(|| {
                while running.load(Ordering::Relaxed) {
                    if let Some(used) = meter.lock().unwrap().as_ref().and_then(|m| m.in_use()) {
                        peak.fetch_max(used, Ordering::Relaxed);
                    }
                    std::thread::sleep(MEMORY_SAMPLE);
                }
            });
            let workers: Vec<_> = (0..n)
                .map(|_| {
                    s.spawn(|| {
                        let run = || -> Result<(), CliError> {
                            let ready = (|| {
                                let m = load_wav2lip(
                                    weights,
                                    plan.device,
                                    plan.cuda_device,
                                    plan.service,
                                    batch,
                                )?;
                                let (mel, face) = inputs(batch, m.device())?;
                                forward_sync(&m, &mel, &face, true)?;
                                Ok::<_, CliError>((m, mel, face))
                            })();
                            // Even when this one failed, so the others go on.
                            if barrier.wait().is_leader() {
                                if let Ok((m, _, _)) = &ready {
                                    let meter_now = Meter::new(m.device());
                                    *after_warm_up.lock().unwrap() = meter_now.in_use();
                                    *meter.lock().unwrap() = Some(meter_now);
                                }
                            }
                            let (m, mel, face) = ready?;
                            paths.lock().unwrap().push(m.conv_engine());
                            let (runs, t) =
                                timed(a.seconds, || forward_sync(&m, &mel, &face, true))?;
                            rates
                                .lock()
                                .unwrap()
                                .push((runs * batch) as f64 / t.as_secs_f64());
                            Ok(())
                        };
                        if let Err(e) = run() {
                            *errors.lock().unwrap() = Some(e.to_string());
                        }
                    })
                })
                .collect();
            for w in workers {
                let _ = w.join();
            }
            running.store(false, Ordering::Relaxed);
        });
        let after_warm_up = after_warm_up.into_inner().unwrap();
        let peak = Some(peak.into_inner()).filter(|&p| p > 0);
        if let Some(e) = errors.into_inner().unwrap() {
            return Err(CliError::Jobs(format!("instance run failed: {e}")));
        }
        let fps: f64 = rates.into_inner().unwrap().iter().sum();
        let base = *base.get_or_insert(fps);
        let mut paths = paths.into_inner().unwrap();
        paths.dedup();
        println!(
            "| {n} | {batch} | {} | {fps:.1} | {:.2}x | {} | {} |",
            n * batch,
            fps / f64::max(base, 1e-9),
            mib(after_warm_up),
            mib(peak.or(after_warm_up)),
        );
        rows.push(json!({
            "instances": n, "batch": batch, "frames_in_flight": n * batch, "fps": fps,
            "dtype": plan.service, "paths": paths,
            "device_bytes_after_warm_up": after_warm_up, "device_bytes_peak": peak,
        }));
    }
    Ok(Value::Array(rows))
}

/// The exact f32 reference for the accuracy run, on the CPU (no TF32 there): on a CUDA bench
/// the own f32 CPU pass, on a CPU bench candle's f32 operations (so the own CPU pass, the
/// CPU bench's serving path, is compared with another implementation).
fn exact_reference(
    weights: &GeneratorWeights,
    device: DeviceKind,
) -> Result<(Wav2Lip, &'static str), CliError> {
    let mut m = Wav2Lip::load(weights, &Device::Cpu, DType::F32)?;
    if device == DeviceKind::Cpu {
        m.use_candle_operations();
        Ok((m, "candle's f32 operations on the CPU"))
    } else {
        Ok((m, "the own f32 CPU pass"))
    }
}

/// Faces predicted from the avatar and the first frames of the speech by every precision and
/// convolution path, against an exact f32 reference computed on the CPU from the full-precision
/// weights: PSNR (faces in 0–1) and largest difference.
pub(super) fn accuracy(
    a: &BenchArgs,
    plan: &Plan,
    weights: &GeneratorWeights,
    avatar: &Avatar,
) -> Result<Value, CliError> {
    let cuda = plan.device == DeviceKind::Cuda;
    let frames = if cuda {
        ACCURACY_FRAMES_CUDA
    } else {
        ACCURACY_FRAMES_CPU
    };
    let speech = audio::load(&read_file(&a.audio)?, 3600.0)?;
    let mel = speech.mel();
    let frame_plan = FramePlan::new(mel.frames(), Fps::DEFAULT)?;
    let n = frame_plan.len().min(frames);
    let err = |e: lipsync::engine::Error| CliError::Jobs(e.to_string());
    let mel_in = mel_batch(&mel, &frame_plan, 0, n, &Device::Cpu).map_err(err)?;
    let face_in = face_batch(avatar, n, &Device::Cpu).map_err(err)?;
    if let Some(path) = &a.accuracy_inputs {
        let tensors = std::collections::HashMap::from([
            ("mel".to_string(), mel_in.clone()),
            ("face".to_string(), face_in.clone()),
        ]);
        candle_core::safetensors::save(&tensors, path).map_err(model::Error::from)?;
    }
    let cpu_f32 = |t: Tensor| -> Result<Tensor, CliError> {
        Ok(t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(model::Error::from)?)
    };
    let (reference, reference_name) = exact_reference(weights, plan.device)?;
    let reference = cpu_f32(reference.forward(&mel_in, &face_in)?)?;
    println!(
        "\n## Accuracy ({n} faces from {} and {}, vs {reference_name}: exact f32, \
         full-precision weights)\n",
        a.image.display(),
        a.audio.display()
    );
    println!("| dtype | convolutions | PSNR | max difference |");
    println!("|---|---|---|---|");
    let dev = plan.device.open_instance(plan.cuda_device)?;
    let (mel_dev, face_dev) = (
        mel_in.to_device(&dev).map_err(model::Error::from)?,
        face_in.to_device(&dev).map_err(model::Error::from)?,
    );
    let mut rows = Vec::new();
    for &p in &plan.dtypes {
        let dtype = model::compute_dtype(&dev, p);
        let mut m = Wav2Lip::load(weights, &dev, dtype)?;
        m.verify_cudnn_path_at(n)?;
        let mut paths = vec![m.conv_engine()];
        if m.conv_engine() != "candle" && cuda {
            paths.push("candle");
        }
        for path in paths {
            if path == "candle" {
                m.use_candle_operations();
            }
            let out = cpu_f32(m.forward(&mel_dev, &face_dev)?)?;
            let psnr = model::wav2lip::face_psnr(&out, &reference)?;
            let max = (out - &reference)
                .and_then(|d| d.abs())
                .and_then(|d| d.flatten_all())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .map_err(model::Error::from)?;
            println!("| {} | {path} | {psnr:.1} dB | {max:.2e} |", dtype.as_str());
            rows.push(json!({
                "dtype": p, "compute_dtype": dtype.as_str(), "path": path,
                "reference": reference_name, "frames": n,
                "psnr_db": if psnr.is_finite() { Some(psnr) } else { None }, "max_diff": max
            }));
        }
    }
    Ok(Value::Array(rows))
}

/// Load and warm-up of one instance as `serve` runs it (the service precision, its batch
/// sizes up to the largest measured batch), first with no autotune cache file (every
/// algorithm searched; the file is written at the end of warm-up), then reading that file.
/// Each run is a fresh process: a process keeps the choices it made.
pub(super) fn autotune(a: &BenchArgs, plan: &Plan, checkpoint: &Path) -> Result<Value, CliError> {
    let io = |e: std::io::Error| CliError::Jobs(format!("autotune run: {e}"));
    let dir = tempfile::tempdir().map_err(io)?;
    let cache = dir.path().join("autotune.json");
    let exe = std::env::current_exe().map_err(io)?;
    // A flag's value as its name (the enums serialise to the names their parsers take).
    fn flag(v: impl serde::Serialize) -> String {
        serde_json::to_value(v)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }
    let engine = flag(a.conv.conv_engine);
    println!(
        "\n## Autotune (one instance's load, check and warm-up as serve runs them: {}, \
         batches up to {}, --conv-engine {engine}; each a fresh process)\n",
        plan.service_text(),
        plan.largest_batch()
    );
    println!("| run | cache file | load + warm-up | choices searched | choices from the file | convolutions |");
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for run in ["cold", "cached"] {
        let file_before = std::fs::metadata(&cache).ok().map(|m| m.len());
        let out = std::process::Command::new(&exe)
            .arg("bench")
            .arg("--autotune-probe")
            .arg("--checkpoint")
            .arg(checkpoint)
            .args(["--device", device_name(plan.device)])
            .args(["--cuda-device", plan.cuda_device.to_string().as_str()])
            .args(["--service-dtype", plan.service.dtype().as_str()])
            .args(["--conv-engine", engine.as_str()])
            .args(["--conv-layout", flag(a.conv.conv_layout).as_str()])
            .args(["--conv-upsampling", flag(a.conv.conv_upsampling).as_str()])
            .args([
                "--cudnn-workspace",
                a.conv.cudnn_workspace.to_string().as_str(),
            ])
            .arg("--autotune-cache")
            .arg(&cache)
            .args(["--batches", plan.largest_batch().to_string().as_str()])
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(io)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let probe: Option<Value> = stdout
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok());
        let Some(probe) = probe.filter(|_| out.status.success()) else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            return Err(CliError::Jobs(format!(
                "the {run} autotune run failed ({}): {}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
            )));
        };
        let seconds = probe["seconds"].as_f64().unwrap_or(f64::NAN);
        let known = probe["known"].as_u64().unwrap_or(0);
        let searched = probe["searched"].as_u64().unwrap_or(0);
        let path = probe["conv_path"].as_str().unwrap_or("unknown").to_string();
        let file_text = match file_before {
            None => "none".to_string(),
            Some(bytes) => format!("{:.1} KB from the cold run", bytes as f64 / 1000.0),
        };
        println!(
            "| {run} | {file_text} | {seconds:.2} s | {searched} | {} | {path} |",
            known - searched.min(known)
        );
        rows.push(json!({
            "run": run, "cache_file_bytes": file_before, "seconds": seconds,
            "searched": searched, "from_file": known - searched.min(known), "conv_path": path,
            "dtype": plan.service, "max_batch": plan.largest_batch()
        }));
    }
    if plan.device == DeviceKind::Cpu {
        println!("\n(cpu: no algorithm search, so both runs do the same work)");
    }
    Ok(Value::Array(rows))
}

/// The autotune run's child: starts the engine `serve` would with one instance, times it
/// until ready, prints one JSON line.
pub(super) fn autotune_probe(plan: &Plan, weights: Arc<GeneratorWeights>) -> Result<(), CliError> {
    let max_batch = plan.largest_batch().to_string();
    let flags = [
        "--dtype",
        plan.service.dtype().as_str(),
        "--instances",
        "1",
        "--max-batch",
        max_batch.as_str(),
    ]
    .map(String::from);
    let (args, r) = serve_settings(plan.device, plan.cuda_device, &flags)?;
    let loader = Wav2LipLoader::new(weights, r.device, r.cuda_device, r.max_batch);
    let start = Instant::now();
    let engine = Engine::start(Arc::new(loader), args.pool_config(&r));
    let ready = engine.wait_ready();
    let seconds = start.elapsed().as_secs_f64();
    let conv_path = engine.status().conv_path();
    engine.shutdown();
    ready.map_err(CliError::Jobs)?;
    #[cfg(feature = "cuda")]
    let (known, searched) = model::cudnn::autotune_counts();
    #[cfg(not(feature = "cuda"))]
    let (known, searched) = (0usize, 0usize);
    println!(
        "{}",
        json!({
            "seconds": seconds, "known": known, "searched": searched, "conv_path": conv_path,
            "max_batch": r.max_batch, "pad_batches": r.pad_batches
        })
    );
    Ok(())
}

/// Profiled passes per batch in the layers run; each layer's least time is kept.
const LAYER_RUNS: usize = 3;

/// Each layer's time in one forward pass of the own cuDNN path (CUDA events around every
/// layer, [`Wav2Lip::profile_layers`]), at each batch, in the service precision, after the
/// batch's autotuning: milliseconds per pass and microseconds per frame, with the algorithm,
/// workspace and fusion each layer runs at the largest batch. What is left of the whole pass
/// is the concatenations, layout conversions and sigmoid. CUDA only.
pub(super) fn layers(plan: &Plan, weights: &Arc<GeneratorWeights>) -> Result<Value, CliError> {
    let conv = lipsync::model::cudnn::settings();
    println!(
        "\n## Layers (own cuDNN path, {}, {:?} activations, {:?} upsampling, workspace up to \
         {} MiB; ms per forward pass (µs per frame), least of {LAYER_RUNS} passes)\n",
        plan.service_text(),
        conv.layout,
        conv.upsampling,
        conv.workspace_limit >> 20
    );
    #[cfg(not(feature = "cuda"))]
    {
        let _ = weights;
        println!("Only in CUDA builds.");
        Ok(Value::Null)
    }
    #[cfg(feature = "cuda")]
    {
        use lipsync::model::wav2lip::LayerProfile;
        let dev = plan.device.open_instance(plan.cuda_device)?;
        let dtype = model::compute_dtype(&dev, plan.service);
        let mut m = Wav2Lip::load(weights, &dev, dtype)?;
        m.verify_cudnn_path_at(plan.largest_batch())?;
        if m.conv_engine() != "cudnn" {
            println!(
                "The own path is not in use ({} operations): no layer times.",
                m.conv_engine()
            );
            return Ok(Value::Null);
        }
        let mut profiles: Vec<(usize, LayerProfile)> = Vec::new();
        for &b in &plan.batches {
            let (mel, face) = inputs(b, &dev)?;
            // The batch's searches and fusion timings, then one steady pass.
            forward_sync(&m, &mel, &face, false)?;
            forward_sync(&m, &mel, &face, false)?;
            let mut best: Option<LayerProfile> = None;
            for _ in 0..LAYER_RUNS {
                let p = m
                    .profile_layers(&mel, &face)?
                    .ok_or_else(|| CliError::Jobs("the own path is not in use".into()))?;
                best = Some(match best {
                    None => p,
                    Some(mut q) => {
                        for (a, b) in q.layers.iter_mut().zip(&p.layers) {
                            a.ms = a.ms.min(b.ms);
                        }
                        q.total_ms = q.total_ms.min(p.total_ms);
                        q
                    }
                });
            }
            profiles.push((b, best.expect("LAYER_RUNS > 0")));
        }
        let largest = plan.largest_batch();
        let report = m.cudnn_report();
        let at_largest = |path: &str| {
            report
                .iter()
                .find(|r| r.path == path && r.input[0] == largest)
        };
        let cell = |ms: f32, b: usize| format!("{ms:.3} ({:.2})", ms as f64 * 1e3 / b as f64);
        println!(
            "| layer | input c×h×w | algorithm at batch {largest} | math | workspace MiB | fused | {} |",
            plan.batch_columns("")
        );
        println!(
            "|---|---|---|---|---|---|{}",
            "---|".repeat(plan.batches.len())
        );
        let mut rows = Vec::new();
        let Some((_, first)) = profiles.first() else {
            return Ok(Value::Null);
        };
        for (i, layer) in first.layers.iter().enumerate() {
            let [_, c, h, w] = layer.input;
            let r = at_largest(&layer.path);
            let times: Vec<f32> = profiles.iter().map(|(_, p)| p.layers[i].ms).collect();
            println!(
                "| {} | {c}×{h}×{w} | {} | {} | {} | {} | {} |",
                layer.path,
                r.map_or("-".into(), |r| r.algo.clone()),
                r.map_or("-".into(), |r| format!("{:?}", r.math)),
                r.map_or("-".into(), |r| format!(
                    "{:.1}",
                    r.workspace as f64 / 1048576.0
                )),
                r.map_or("-".into(), |r| r.fused.to_string()),
                profiles
                    .iter()
                    .zip(&times)
                    .map(|((b, _), &ms)| cell(ms, *b))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
            rows.push(json!({
                "path": layer.path, "input": layer.input,
                "algo": r.map(|r| r.algo.clone()), "workspace_bytes": r.map(|r| r.workspace),
                "fused": r.map(|r| r.fused),
                "ms": plan.batches.iter().zip(&times)
                    .map(|(b, ms)| json!({ "batch": b, "ms": ms })).collect::<Vec<_>>(),
            }));
        }
        let sums: Vec<f32> = profiles
            .iter()
            .map(|(_, p)| p.layers.iter().map(|l| l.ms).sum())
            .collect();
        let summary = |label: &str, f: &dyn Fn(usize, f32, &LayerProfile) -> String| {
            println!(
                "| {label} | | | | | | {} |",
                profiles
                    .iter()
                    .zip(&sums)
                    .map(|((b, p), &sum)| f(*b, sum, p))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        };
        summary("all layers", &|b, sum, _| cell(sum, b));
        summary("between layers", &|b, sum, p| cell(p.total_ms - sum, b));
        summary("whole pass", &|b, _, p| cell(p.total_ms, b));
        summary("frames/s", &|b, _, p| {
            format!("{:.0}", b as f64 * 1e3 / p.total_ms as f64)
        });
        Ok(json!({
            "layout": conv.layout, "upsampling": conv.upsampling,
            "workspace_limit_bytes": conv.workspace_limit,
            "dtype": dtype.as_str(), "layers": rows,
            "passes": profiles.iter().zip(&sums).map(|((b, p), sum)| json!({
                "batch": b, "total_ms": p.total_ms, "layers_ms": sum,
            })).collect::<Vec<_>>(),
        }))
    }
}

/// Batch sizes the memory section plans when `--batches` is not given: serve's on CUDA.
const MEMORY_BATCHES: [usize; 6] = [1, 16, 64, 128, 256, 512];

/// The planned path's arena (`--conv-epilogue own|auto`) per batch size, from the graph's
/// liveness alone (no GPU): for the flags' input padding and each upsampling form the flags
/// allow (`auto` picks among them per layer at warm-up), in every `--dtypes`, with the skip
/// concatenations the planner splits to stay within budget, and the estimate
/// `--gpu-memory-limit` splits batches by.
pub(super) fn memory(a: &BenchArgs, plan: &Plan) -> Result<Value, CliError> {
    use lipsync::engine::pool::estimated_bytes_with;
    use lipsync::model::cudnn::{Epilogue, Upsampling};
    use lipsync::model::netplan::{ArenaPlan, Graph, NetOptions, ARENA_BUDGET_PER_FRAME};
    use lipsync::model::upsample::UpForm;
    let conv = a.conv.settings();
    let batches: Vec<usize> = if a.batches.is_empty() {
        MEMORY_BATCHES.to_vec()
    } else {
        plan.batches.clone()
    };
    let forms = match conv.upsampling.form() {
        Some(f) => vec![f],
        None => UpForm::ALL.to_vec(),
    };
    let mib = |b: usize| format!("{:.1}", b as f64 / 1048576.0);
    println!(
        "\n## Planned memory (one instance's activation arena, --conv-input-pad {}; MiB; budget \
         {} MiB at batch 512 in f16)\n",
        conv.input_pad.name(),
        mib(ARENA_BUDGET_PER_FRAME * 512)
    );
    println!(
        "| upsampling | dtype | skips split | live peak per frame (MiB) | {} | estimate at batch {} |",
        batches
            .iter()
            .map(|b| format!("batch {b}"))
            .collect::<Vec<_>>()
            .join(" | "),
        batches.iter().max().copied().unwrap_or(1)
    );
    println!("|---|---|---|---|{}---|", "---|".repeat(batches.len()));
    let mut rows = Vec::new();
    for form in forms {
        let g = Graph::new(&NetOptions::new(conv.input_pad, form));
        for p in &plan.dtypes {
            let dtype = p.dtype();
            let elem = dtype.size_in_bytes();
            let planned: Vec<usize> = batches
                .iter()
                .map(|&n| {
                    let arena = ArenaPlan::new(&g, n, elem);
                    arena.check(&g).map(|()| arena.bytes)
                })
                .collect::<Result<_, String>>()
                .map_err(|e| CliError::Jobs(format!("the planned arena is invalid: {e}")))?;
            let largest = batches.iter().max().copied().unwrap_or(1);
            let settings = lipsync::model::cudnn::ConvSettings {
                epilogue: Epilogue::Own,
                upsampling: Upsampling::of(form),
                ..conv.clone()
            };
            let estimate = estimated_bytes_with(largest, dtype, &settings);
            let split: Vec<String> = g.split.iter().map(|b| format!("block {b}")).collect();
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                form.name(),
                dtype.as_str(),
                if split.is_empty() {
                    "none".into()
                } else {
                    split.join(", ")
                },
                mib(g.live_peak() * elem),
                planned
                    .iter()
                    .map(|&b| mib(b))
                    .collect::<Vec<_>>()
                    .join(" | "),
                mib(estimate as usize)
            );
            rows.push(json!({
                "upsampling": form.name(), "dtype": dtype.as_str(), "split": g.split,
                "live_peak_bytes_per_frame": g.live_peak() * elem,
                "planned_bytes": batches.iter().zip(&planned)
                    .map(|(b, p)| json!({ "batch": b, "bytes": p })).collect::<Vec<_>>(),
                "estimated_bytes": estimate,
            }));
        }
    }
    Ok(Value::Array(rows))
}

/// The configurations the compare section runs by default: the old default, everything
/// `auto`, and two ablations (no cuDNN fusion; unpadded inputs).
pub(super) const COMPARE_DEFAULT: [&str; 4] = [
    "subpixel:separate:none:on",
    "auto:auto:8:on",
    "auto:own:8:on",
    "auto:auto:none:on",
];

/// `UPSAMPLING:EPILOGUE:INPUT_PAD:ARENA` over the flags' other settings.
pub(super) fn compare_config(
    text: &str,
    base: &lipsync::model::cudnn::ConvSettings,
) -> Result<lipsync::model::cudnn::ConvSettings, CliError> {
    let parts: Vec<&str> = text.split(':').collect();
    let bad = |why: String| CliError::Jobs(format!("--compare-configs {text:?}: {why}"));
    let [up, epi, pad, arena] = parts[..] else {
        return Err(bad("want UPSAMPLING:EPILOGUE:INPUT_PAD:ARENA".into()));
    };
    let settings = lipsync::model::cudnn::ConvSettings {
        upsampling: up.parse().map_err(bad)?,
        epilogue: epi.parse().map_err(bad)?,
        input_pad: pad.parse().map_err(bad)?,
        arena: arena.parse().map_err(bad)?,
        ..base.clone()
    };
    settings.check().map_err(bad)?;
    Ok(settings)
}

/// The compare section's configurations (at most 4).
pub(super) fn compare_configs(
    a: &BenchArgs,
) -> Result<Vec<(String, lipsync::model::cudnn::ConvSettings)>, CliError> {
    let base = a.conv.settings();
    let texts: Vec<String> = if a.compare_configs.is_empty() {
        COMPARE_DEFAULT.iter().map(|s| s.to_string()).collect()
    } else {
        a.compare_configs.clone()
    };
    if texts.len() > 4 {
        return Err(CliError::Jobs(format!(
            "--compare-configs: at most 4 configurations, not {}",
            texts.len()
        )));
    }
    texts
        .iter()
        .map(|t| Ok((t.clone(), compare_config(t, &base)?)))
        .collect()
}

/// The model path's configurations in one process on the same weights, in the service
/// precision at each batch: during the first configuration with `auto` upsampling every
/// form is timed per layer (the table of forms); then per configuration frames/s, the peak
/// device memory of its forwards, the accuracy against the exact f32 reference (the start-up
/// check's measure and floor), and each layer's time at the largest batch. CUDA only.
pub(super) fn compare(
    a: &BenchArgs,
    plan: &Plan,
    weights: &Arc<GeneratorWeights>,
) -> Result<Value, CliError> {
    let configs = compare_configs(a)?;
    println!(
        "\n## Compare ({}, batches {}; one process, the same weights)\n",
        plan.service_text(),
        plan.batches
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (i, (text, s)) in configs.iter().enumerate() {
        println!(
            "{}. `{text}`: --conv-upsampling {} --conv-epilogue {} --conv-input-pad {} \
             --conv-arena {} --conv-layout {} (planned path: {})",
            i + 1,
            s.upsampling.name(),
            s.epilogue.name(),
            s.input_pad.name(),
            s.arena.name(),
            s.layout.name(),
            if s.planned() { "yes" } else { "no" }
        );
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = weights;
        println!("\nTimes need the CUDA build (the cuDNN path): nothing measured here.");
        Ok(
            json!({ "configs": configs.iter().map(|(t, _)| t).collect::<Vec<_>>(), "measured": false }),
        )
    }
    #[cfg(feature = "cuda")]
    {
        compare_cuda(a, plan, weights, &configs)
    }
}

#[cfg(feature = "cuda")]
fn compare_cuda(
    a: &BenchArgs,
    plan: &Plan,
    weights: &Arc<GeneratorWeights>,
    configs: &[(String, lipsync::model::cudnn::ConvSettings)],
) -> Result<Value, CliError> {
    use lipsync::model::wav2lip::{cudnn_check_floor, LayerProfile};
    let dev = plan.device.open_instance(plan.cuda_device)?;
    let dtype = model::compute_dtype(&dev, plan.service);
    let meter = Meter::new(&dev);
    let floor = cudnn_check_floor(dtype);
    let largest = plan.largest_batch();
    let mut results = Vec::new();
    let mut profiles: Vec<(String, LayerProfile)> = Vec::new();
    let mut forms_table = None;
    println!(
        "\n| configuration | batch | frames/s | ms per batch | peak device MiB | PSNR vs f32 (dB, floor {floor}) | path |"
    );
    println!("|---|---|---|---|---|---|---|");
    // Peaks above what the process held before the first configuration (the CUDA context):
    // a configuration's dropped model may leave memory in the pool for the next, so the
    // later rows are upper bounds.
    let before = meter.in_use();
    for (text, settings) in configs {
        let mut m = Wav2Lip::load(weights, &dev, dtype)?;
        m.use_conv_settings(settings.clone())?;
        // Warm-up as an instance runs it: every batch once (searches; the planned path's
        // first pass times the forms and the fusion), then once more with the choices.
        for &b in &plan.batches {
            let (mel, face) = inputs(b, &dev)?;
            forward_sync(&m, &mel, &face, false)?;
            forward_sync(&m, &mel, &face, false)?;
        }
        m.finish_warm_up();
        if forms_table.is_none() && settings.upsampling == lipsync::model::cudnn::Upsampling::Auto {
            forms_table = Some(m.cudnn_form_choices());
        }
        for &b in &plan.batches {
            let (mel, face) = inputs(b, &dev)?;
            let peak = meter.peak_during(|| {
                forward_sync(&m, &mel, &face, false)?;
                forward_sync(&m, &mel, &face, false)
            })?;
            let (runs, t) = timed(a.seconds, || forward_sync(&m, &mel, &face, false))?;
            let fps = (runs * b) as f64 / t.as_secs_f64();
            if b == largest {
                let mut best: Option<LayerProfile> = None;
                for _ in 0..LAYER_RUNS {
                    if let Some(p) = m.profile_layers(&mel, &face)? {
                        best = Some(match best {
                            None => p,
                            Some(mut q) => {
                                for (x, y) in q.layers.iter_mut().zip(&p.layers) {
                                    x.ms = x.ms.min(y.ms);
                                }
                                q.total_ms = q.total_ms.min(p.total_ms);
                                q
                            }
                        });
                    }
                }
                if let Some(p) = best {
                    profiles.push((text.clone(), p));
                }
            }
            // The accuracy at the largest batch (the start-up check's; it also runs candle's
            // slow operations once).
            let check = if b == largest {
                Some(m.check_conv_path(b, floor)?)
            } else {
                None
            };
            let used = match (peak, before) {
                (Some(p), Some(b0)) if p > b0 => Some(p - b0),
                _ => None,
            };
            println!(
                "| `{text}` | {b} | {fps:.0} | {:.2} | {} | {} | {} |",
                1e3 * b as f64 / fps,
                mib(used),
                check.as_ref().map_or("-".into(), |c| format!(
                    "{:.1}{}",
                    c.own_psnr,
                    if c.accepted {
                        ""
                    } else {
                        " (refused: candle's operations from here)"
                    }
                )),
                m.conv_engine()
            );
            results.push(json!({
                "config": text, "batch": b, "fps": fps, "peak_bytes": used,
                "psnr": check.as_ref().map(|c| c.own_psnr),
                "accepted": check.as_ref().map(|c| c.accepted),
                "path": m.conv_engine(),
            }));
        }
        drop(m);
    }
    // The forms, as timed in the warm-up of the first `auto` configuration.
    let mut forms_rows = Vec::new();
    if let Some(table) = forms_table {
        println!(
            "\n### Upsampling forms timed per layer (ms per batch, least of 3; the fastest kept)\n"
        );
        println!("| convolution and batch | subpixel | subpixel2x2 | phases | transposed | kept |");
        println!("|---|---|---|---|---|---|");
        for (key, choice) in &table {
            let cell = |f: lipsync::model::upsample::UpForm| {
                choice
                    .ms
                    .get(&f)
                    .map_or("-".to_string(), |ms| format!("{ms:.3}"))
            };
            use lipsync::model::upsample::UpForm::*;
            println!(
                "| {key} | {} | {} | {} | {} | {} |",
                cell(Subpixel),
                cell(Subpixel2x2),
                cell(Phases),
                cell(Transposed),
                choice.form.name()
            );
            forms_rows.push(json!({ "key": key, "form": choice.form, "ms": choice.ms }));
        }
    }
    // Each layer at the largest batch, µs per frame, side by side.
    if let Some((_, first)) = profiles.first() {
        println!(
            "\n### Layers at batch {largest} (µs per frame, CUDA events; convolutions and their epilogue)\n"
        );
        println!(
            "| layer | {} |",
            profiles
                .iter()
                .map(|(t, _)| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        println!("|---|{}", "---|".repeat(profiles.len()));
        let us = |ms: f32| format!("{:.2}", ms as f64 * 1e3 / largest as f64);
        for layer in &first.layers {
            let cells: Vec<String> = profiles
                .iter()
                .map(|(_, p)| {
                    p.layers
                        .iter()
                        .find(|l| l.path == layer.path)
                        .map_or("-".into(), |l| us(l.ms))
                })
                .collect();
            println!("| {} | {} |", layer.path, cells.join(" | "));
        }
        let sums: Vec<String> = profiles
            .iter()
            .map(|(_, p)| us(p.layers.iter().map(|l| l.ms).sum()))
            .collect();
        println!("| all layers | {} |", sums.join(" | "));
        let between: Vec<String> = profiles
            .iter()
            .map(|(_, p)| us(p.total_ms - p.layers.iter().map(|l| l.ms).sum::<f32>()))
            .collect();
        println!("| between layers | {} |", between.join(" | "));
        let whole: Vec<String> = profiles.iter().map(|(_, p)| us(p.total_ms)).collect();
        println!("| whole pass | {} |", whole.join(" | "));
    }
    Ok(json!({ "runs": results, "forms": forms_rows }))
}
