//! `bench --sections enhancers`: each `--enhancer-checkpoint`'s faces/s in f32 where `serve`
//! runs it, on the faces a render gives it (96×96, or aligned 512×512 for GFPGAN; batches 1, 4
//! and 16 with the CPU pass, 1, 4, 16 and 64 with the tensor pass on CUDA; a restorer's
//! batches stop at what the engine runs at once, [`restore::CHUNK`]), and what asking for it adds to a whole request: `--enhance-seconds`
//! of speech rendered on the echo device once plain and once with each enhancer (on the
//! bench's device), through the engine `serve` would start (its instances, batches and
//! encoder workers), so the difference is the enhancer's alone.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use lipsync::engine::enhance::Enhancers;
use lipsync::engine::pipeline::Options;
use lipsync::engine::Avatar;
use lipsync::engine::{landmarks, restore};
use lipsync::media::audio;
use lipsync::model::retinaface::RetinaFace;
use lipsync::model::DeviceKind;

use super::{read_file, request, request_settings, serve_settings, BenchArgs, CliError};

/// `device`: the bench's (`cuda` runs the tensor pass on `cuda_device`; cpu and echo the
/// CPU pass).
pub fn enhancers(
    a: &BenchArgs,
    avatar: &Avatar,
    device: DeviceKind,
    cuda_device: usize,
) -> Result<serde_json::Value, CliError> {
    let device = device.open(cuda_device)?;
    // Loaded as `serve` loads them: on the device, each one's pass chosen there.
    let enhancers = Arc::new(Enhancers::load(
        &a.enhancer_checkpoint,
        std::slice::from_ref(&device),
    )?);
    let mut rows = faces_per_second(&enhancers, &device, &a.batches)?;
    if a.enhance_seconds > 0.0 {
        let added = added_to_a_request(a, avatar, &enhancers, &device)?;
        for (row, added) in rows.iter_mut().zip(added) {
            row["request"] = added;
        }
    }
    if let Some(net) = enhancers.detector() {
        rows.push(detector_speed(net, avatar)?);
    }
    Ok(rows.into())
}

/// The landmark detector's speed (the CPU pass): on the region an avatar's landmark search
/// covers around the bench avatar's box, and on the whole frame; one untimed run, then the
/// median of three.
fn detector_speed(net: &RetinaFace, avatar: &Avatar) -> Result<serde_json::Value, CliError> {
    let frame = &avatar.frame;
    let (w, h) = (frame.width as usize, frame.height as usize);
    let [x0, y0, x1, y1] = landmarks::region(avatar.face, frame.width, frame.height);
    let median = |f: &dyn Fn() -> Result<(), CliError>| -> Result<f64, CliError> {
        f()?;
        let mut t: Vec<f64> = (0..3)
            .map(|_| {
                let start = Instant::now();
                f().map(|_| start.elapsed().as_secs_f64())
            })
            .collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        Ok(t[1])
    };
    let region = median(&|| {
        landmarks::in_frame(frame, avatar.face, net)?;
        Ok(())
    })?;
    let whole = median(&|| {
        net.detect(&frame.rgb, w, h, landmarks::MIN_SCORE, Some(5000), 0.4)?;
        Ok(())
    })?;
    let name = format!("RetinaFace ({})", net.backbone().name());
    let (rw, rh) = (x1 - x0, y1 - y0);
    println!("## Landmark detector (f32, the CPU pass, median of 3)\n");
    println!("| detector | region around the box | seconds | whole frame | seconds |");
    println!("|---|---|---|---|---|");
    println!("| {name} | {rw}x{rh} | {region:.3} s | {w}x{h} | {whole:.3} s |\n");
    Ok(serde_json::json!({
        "name": name, "kind": "retinaface", "device": "cpu",
        "region": [rw, rh], "region_seconds": region,
        "frame": [w, h], "frame_seconds": whole,
    }))
}

/// Faces/s of each enhancer by batch (`requested`, `--batches`; when empty 1, 4, 16 on the
/// CPU and also 64 on a GPU): one untimed run, then the median of three.
fn faces_per_second(
    enhancers: &Enhancers,
    device: &Device,
    requested: &[u32],
) -> Result<Vec<serde_json::Value>, CliError> {
    let (defaults, pass): (&[usize], _) = match device {
        Device::Cpu => (&[1, 4, 16], "the CPU pass"),
        _ => (&[1, 4, 16, 64], "the tensor pass on the GPU"),
    };
    let batches: Vec<usize> = if requested.is_empty() {
        defaults.to_vec()
    } else {
        requested.iter().map(|&b| b as usize).collect()
    };
    println!(
        "## Enhancers (f32, {pass}, median of 3; a restorer's batches up to {})\n",
        restore::CHUNK
    );
    let columns: Vec<String> = batches
        .iter()
        .map(|b| format!("batch {b} faces/s"))
        .collect();
    println!(
        "| enhancer | architecture | face | multiply-adds per face | {} |",
        columns.join(" | ")
    );
    println!("|---|---|---|---|{}", "---|".repeat(batches.len()));
    let mut rows = Vec::new();
    for e in enhancers.all() {
        let mut rates = serde_json::Map::new();
        let mut cells = Vec::new();
        let side = e.side();
        for &n in &batches {
            if e.restores() && n > restore::CHUNK {
                cells.push("—".into());
                continue;
            }
            // A smooth face-like ramp: the cost does not depend on the values.
            let faces: Vec<f32> = (0..n * 3 * side * side)
                .map(|i| (i % 251) as f32 / 250.0)
                .collect();
            e.forward(n, &faces)?;
            let mut times: Vec<f64> = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    e.forward(n, &faces).map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            times.sort_by(f64::total_cmp);
            let rate = n as f64 / times[1];
            cells.push(format!("{rate:.2}"));
            rates.insert(n.to_string(), rate.into());
        }
        let macs = e.net.multiply_adds(side, side);
        println!(
            "| {} | {} | {side}x{side} | {:.2} G | {} |",
            e.name,
            e.net.describe(),
            macs / 1e9,
            cells.join(" | ")
        );
        rows.push(serde_json::json!({
            "name": e.name.as_ref(), "kind": e.net.kind(), "architecture": e.net.describe(),
            "device": if e.on_device.is_some() { "cuda" } else { "cpu" },
            "multiply_adds_per_face": macs, "faces_per_second": rates, "face_side": side,
        }));
    }
    println!();
    Ok(rows)
}

/// For each enhancer (in the order given): the request's seconds plain and with it.
fn added_to_a_request(
    a: &BenchArgs,
    avatar: &Avatar,
    enhancers: &Arc<Enhancers>,
    device: &Device,
) -> Result<Vec<serde_json::Value>, CliError> {
    let (mut args, r) = serve_settings(DeviceKind::Echo, 0, &[])?;
    // serve_settings names a placeholder checkpoint; echo reads none.
    args.checkpoint = None;
    let (engine, _) = args.start_engine(&r, true, enhancers.clone())?;
    engine.wait_ready().map_err(CliError::Jobs)?;
    let clip = audio::load(&read_file(&a.audio)?, 3600.0)?.samples;
    let settings = request_settings(a, r.encoder_workers);
    let seconds = a.enhance_seconds;
    println!(
        "## What an enhancer adds to a request ({seconds} s of speech on a {}x{} photo, the \
         echo device: {} instance(s), batches up to {}, {} encoder worker(s); enhancers on \
         the {})\n",
        avatar.frame.width,
        avatar.frame.height,
        r.instances,
        r.max_batch,
        r.encoder_workers,
        if matches!(device, Device::Cpu) {
            "CPU"
        } else {
            "GPU"
        }
    );
    println!("| enhance | model frames | total | added | added per second of speech |");
    println!("|---|---|---|---|---|");
    let plain = request(
        &engine,
        &settings,
        avatar,
        &clip,
        seconds,
        Options::default(),
    )?;
    println!(
        "| none | {} | {:.2} s | | |",
        plain.model_frames, plain.seconds
    );
    let mut rows = Vec::new();
    for with in enhancers.all() {
        let options = Options {
            enhance: Some(with.clone()),
            ..Options::default()
        };
        let run = request(&engine, &settings, avatar, &clip, seconds, options)?;
        let added = run.seconds - plain.seconds;
        println!(
            "| {} | {} | {:.2} s | {added:.2} s | {:.3} s |",
            with.name,
            run.model_frames,
            run.seconds,
            added / seconds
        );
        rows.push(serde_json::json!({
            "speech_seconds": seconds, "model_frames": run.model_frames,
            "plain_seconds": plain.seconds, "seconds": run.seconds, "added_seconds": added,
            "added_seconds_per_speech_second": added / seconds,
        }));
    }
    println!();
    engine.shutdown();
    Ok(rows)
}
