//! `bench --sections enhancers`: each `--enhancer-checkpoint`'s faces/s on 96×96 faces at
//! batches 1 and 16, in f32 on the CPU (what `serve` runs), and what asking for it adds to a
//! whole request: `--enhance-seconds` of speech rendered on the echo device once plain and
//! once with each enhancer, through the engine `serve` would start (its instances, batches
//! and encoder workers), so the difference is the enhancer's alone.

use std::time::Instant;

use lipsync::engine::pipeline::Options;
use lipsync::engine::Avatar;
use lipsync::media::audio;
use lipsync::model::arch::FACE_SIZE;
use lipsync::model::DeviceKind;

use super::{read_file, request, request_settings, serve_settings, BenchArgs, CliError};

pub fn enhancers(a: &BenchArgs, avatar: &Avatar) -> Result<serde_json::Value, CliError> {
    let mut rows = faces_per_second(a)?;
    if a.enhance_seconds > 0.0 {
        let added = added_to_a_request(a, avatar)?;
        for (row, added) in rows.iter_mut().zip(added) {
            row["request"] = added;
        }
    }
    Ok(rows.into())
}

/// Faces/s of each enhancer at batches 1 and 16: one untimed run, then the median of three.
fn faces_per_second(a: &BenchArgs) -> Result<Vec<serde_json::Value>, CliError> {
    use lipsync::model::enhancer;
    println!("## Enhancers (96x96 faces, f32 on the CPU, median of 3)\n");
    println!(
        "| enhancer | architecture | multiply-adds per face | batch 1 faces/s | batch 16 faces/s |"
    );
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    for path in &a.enhancer_checkpoint {
        let e = enhancer::load(path)?;
        let mut rates = Vec::new();
        for n in [1usize, 16] {
            // A smooth face-like ramp: the cost does not depend on the values.
            let faces: Vec<f32> = (0..n * 3 * FACE_SIZE * FACE_SIZE)
                .map(|i| (i % 251) as f32 / 250.0)
                .collect();
            e.net.forward_cpu(n, FACE_SIZE, FACE_SIZE, &faces)?;
            let mut times: Vec<f64> = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    e.net
                        .forward_cpu(n, FACE_SIZE, FACE_SIZE, &faces)
                        .map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            times.sort_by(f64::total_cmp);
            rates.push(n as f64 / times[1]);
        }
        let macs = e.net.multiply_adds(FACE_SIZE, FACE_SIZE);
        println!(
            "| {} | {} | {:.2} G | {:.2} | {:.2} |",
            e.name,
            e.net.describe(),
            macs / 1e9,
            rates[0],
            rates[1]
        );
        rows.push(serde_json::json!({
            "name": e.name, "kind": e.kind(), "architecture": e.net.describe(),
            "multiply_adds_per_face": macs, "faces_per_second": {"1": rates[0], "16": rates[1]},
        }));
    }
    println!();
    Ok(rows)
}

/// For each enhancer (in the order given): the request's seconds plain and with it.
fn added_to_a_request(a: &BenchArgs, avatar: &Avatar) -> Result<Vec<serde_json::Value>, CliError> {
    let mut flags = Vec::new();
    for path in &a.enhancer_checkpoint {
        flags.push("--enhancer-checkpoint".to_string());
        flags.push(path.display().to_string());
    }
    let (mut args, r) = serve_settings(DeviceKind::Echo, 0, &flags)?;
    // serve_settings names a placeholder checkpoint; echo reads none.
    args.checkpoint = None;
    let enhancers = args.load_enhancers(&r)?;
    let (engine, _) = args.start_engine(&r, true, enhancers.clone())?;
    engine.wait_ready().map_err(CliError::Jobs)?;
    let clip = audio::load(&read_file(&a.audio)?, 3600.0)?.samples;
    let settings = request_settings(a, r.encoder_workers);
    let seconds = a.enhance_seconds;
    println!(
        "## What an enhancer adds to a request ({seconds} s of speech on a {}x{} photo, the \
         echo device: {} instance(s), batches up to {}, {} encoder worker(s))\n",
        avatar.frame.width, avatar.frame.height, r.instances, r.max_batch, r.encoder_workers
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
