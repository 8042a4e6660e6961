//! Enhancers on the engine: the files loaded at start-up (`--enhancer-checkpoint`), the name a
//! request gives (`enhance=esrgan`) resolved to one of them, each one's cost measured once at
//! start-up, and the stage that runs them on a batch's predicted faces.
//!
//! The stage runs on the model instance's own thread right after the generator, one
//! sub-batch per enhancer over the batch's frames that asked for it; those frames come back
//! as the enhanced face (96·s × 96·s BGR), which the compositor resizes into the face box as
//! it does the 96×96 one. It computes in f32: on the CPU with the enhancer's CPU pass, on a
//! GPU with its tensor pass (candle's `conv2d`, cuDNN's convolutions), its weights loaded
//! once on the GPU and shared by the instances (one batch at a time).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;

use super::Error;
use crate::media::face;
use crate::model::arch::FACE_SIZE;
use crate::model::enhancer::{self, DeviceNet, Enhancer, EnhancerNet, Kind};

/// The enhancer a frame asks for.
#[derive(Clone)]
pub struct EnhanceWith {
    pub name: Arc<str>,
    pub net: Arc<dyn EnhancerNet>,
    /// Its weights on the GPU, where the engine runs on one (else the CPU pass runs).
    pub on_device: Option<Arc<dyn DeviceNet>>,
    /// One 96×96 face, measured at start-up (what live admission weighs its faces by).
    pub seconds_per_face: f64,
}

impl std::fmt::Debug for EnhanceWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EnhanceWith({})", self.name)
    }
}

impl EnhanceWith {
    /// `n` RGB faces `(n, 3, 96, 96)` in [0, 1] through the enhancer, on its device.
    pub fn forward(&self, n: usize, rgb: &[f32]) -> crate::model::Result<Vec<f32>> {
        match &self.on_device {
            Some(d) => d.forward(n, FACE_SIZE, FACE_SIZE, rgb),
            None => self.net.forward_cpu(n, FACE_SIZE, FACE_SIZE, rgb),
        }
    }
}

impl PartialEq for EnhanceWith {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.net, &other.net)
    }
}

struct Loaded {
    enhancer: Enhancer,
    with: EnhanceWith,
}

/// The enhancers loaded at start-up.
#[derive(Default)]
pub struct Enhancers {
    list: Vec<Loaded>,
}

impl std::fmt::Debug for Enhancers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.list.iter().map(|l| &l.enhancer.name))
            .finish()
    }
}

/// The most faces an enhancer runs at once: a batch's faces run in chunks of this, which
/// bounds the enhancer's activations (a compact x4 network holds about 0.6 GB of them for 64
/// faces) while keeping its throughput (flat from batch 16 on the CPU).
pub const CHUNK: usize = 32;

/// What `enhance` may say besides a kind or a name: no enhancer.
pub const NONE: &str = "none";

impl Enhancers {
    /// Loads every file (its kind recognised from its keys) and measures each one's cost on
    /// one 96×96 face. Two files with the same name (file stem) are refused: requests pick
    /// enhancers by it. On a GPU `device` each one's weights go there once and its tensor
    /// pass runs; on the CPU its CPU pass.
    pub fn load(paths: &[PathBuf], device: &Device) -> Result<Enhancers, crate::model::Error> {
        let mut list: Vec<Loaded> = Vec::with_capacity(paths.len());
        for path in paths {
            let enhancer = enhancer::load(path)?;
            if enhancer.name == NONE || Kind::NAMES.contains(&enhancer.name.as_str()) {
                return Err(crate::model::Error::Settings(format!(
                    "{}: an enhancer file may not be named {:?} (requests use that word)",
                    path.display(),
                    enhancer.name
                )));
            }
            if let Some(twin) = list.iter().find(|l| l.enhancer.name == enhancer.name) {
                return Err(crate::model::Error::Settings(format!(
                    "two enhancers named {:?} ({} and {}): requests pick enhancers by file \
                     name, so rename one",
                    enhancer.name,
                    twin.enhancer.path.display(),
                    path.display()
                )));
            }
            let on_device = match device {
                Device::Cpu => None,
                gpu => Some(enhancer.net.on_device(gpu)?),
            };
            let mut with = EnhanceWith {
                name: enhancer.name.as_str().into(),
                net: enhancer.net.clone(),
                on_device,
                seconds_per_face: 0.0,
            };
            let grey = vec![0.5f32; 3 * FACE_SIZE * FACE_SIZE];
            // The first pass on a GPU loads kernels and picks algorithms: time the second.
            if with.on_device.is_some() {
                with.forward(1, &grey)?;
            }
            let t = Instant::now();
            with.forward(1, &grey)?;
            with.seconds_per_face = t.elapsed().as_secs_f64();
            tracing::info!(
                "enhancer {} ({}, {}): {:.1} ms per 96x96 face on the {}",
                enhancer.name,
                enhancer.kind().name(),
                enhancer.net.describe(),
                with.seconds_per_face * 1e3,
                if with.on_device.is_some() {
                    "GPU"
                } else {
                    "CPU"
                }
            );
            list.push(Loaded { enhancer, with });
        }
        Ok(Enhancers { list })
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The enhancer a request asks for: `None`, empty or `none` for none; a kind (`esrgan`)
    /// when exactly one enhancer of that kind is loaded; or an enhancer's name (its file
    /// stem). Anything else is [`Error::EnhancerNotLoaded`], saying what is loaded.
    pub fn resolve(&self, ask: Option<&str>) -> Result<Option<EnhanceWith>, Error> {
        let ask = ask.map(str::trim).unwrap_or("");
        if ask.is_empty() || ask == NONE {
            return Ok(None);
        }
        if let Some(l) = self.list.iter().find(|l| l.enhancer.name == ask) {
            return Ok(Some(l.with.clone()));
        }
        let loaded = || {
            if self.list.is_empty() {
                "no enhancer is loaded (start the server with --enhancer-checkpoint FILE)"
                    .to_string()
            } else {
                let names: Vec<String> = self
                    .list
                    .iter()
                    .map(|l| format!("{} ({})", l.enhancer.name, l.enhancer.kind().name()))
                    .collect();
                format!("loaded: {}", names.join(", "))
            }
        };
        if let Ok(kind) = ask.parse::<Kind>() {
            let of_kind: Vec<&Loaded> = self
                .list
                .iter()
                .filter(|l| l.enhancer.kind() == kind)
                .collect();
            return match of_kind.as_slice() {
                [one] => Ok(Some(one.with.clone())),
                [] => Err(Error::EnhancerNotLoaded(format!(
                    "no {ask} enhancer is loaded; {}",
                    loaded()
                ))),
                several => Err(Error::EnhancerNotLoaded(format!(
                    "{} {ask} enhancers are loaded: name one ({})",
                    several.len(),
                    several
                        .iter()
                        .map(|l| l.enhancer.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))),
            };
        }
        Err(Error::EnhancerNotLoaded(format!(
            "no enhancer {ask:?}: {}",
            loaded()
        )))
    }

    /// Device memory the enhancers hold on a GPU for a batch of `n` faces: every one's
    /// weights, and the largest one's activations (the stage runs one enhancer at a time, at
    /// most [`CHUNK`] faces at once). 0 on the CPU.
    pub fn device_bytes(&self, n: usize) -> u64 {
        let n = n.min(CHUNK);
        let each: Vec<(u64, u64)> = self
            .list
            .iter()
            .filter_map(|l| l.with.on_device.as_ref())
            .map(|d| {
                let weights = d.bytes(0, FACE_SIZE, FACE_SIZE);
                (weights, d.bytes(n, FACE_SIZE, FACE_SIZE) - weights)
            })
            .collect();
        each.iter().map(|e| e.0).sum::<u64>() + each.iter().map(|e| e.1).max().unwrap_or(0)
    }

    /// The enhancers as requests name them.
    pub fn all(&self) -> impl Iterator<Item = &EnhanceWith> {
        self.list.iter().map(|l| &l.with)
    }

    /// For `/info`: each enhancer's name, kind, architecture, scale, file and measured cost.
    pub fn info(&self) -> serde_json::Value {
        self.list
            .iter()
            .map(|l| {
                let e = &l.enhancer;
                let seconds_per_face = l.with.seconds_per_face;
                serde_json::json!({
                    "name": e.name,
                    "kind": e.kind(),
                    "architecture": e.net.describe(),
                    "scale": e.net.scale(),
                    "checkpoint": e.path,
                    "device": if l.with.on_device.is_some() { "cuda" } else { "cpu" },
                    "dtype": "f32",
                    "ms_per_face": seconds_per_face * 1e3,
                    "faces_per_second": 1.0 / seconds_per_face.max(1e-9),
                    "multiply_adds_per_face": e.net.multiply_adds(FACE_SIZE, FACE_SIZE),
                })
            })
            .collect()
    }
}

/// The enhancement stage of a batch: `asks[i]` is frame i's enhancer (or none), `preds` the
/// batch's predictions, `(3, 96, 96)` planar BGR in [0, 1] each. Returns, for each frame
/// that asked, its enhanced face as interleaved BGR bytes (`None` for the others); frames
/// that share an enhancer run together, [`CHUNK`] at a time.
pub fn run(asks: &[Option<&EnhanceWith>], preds: &[f32]) -> Vec<Option<Result<Vec<u8>, String>>> {
    const PLANE: usize = FACE_SIZE * FACE_SIZE;
    let mut out: Vec<Option<Result<Vec<u8>, String>>> = vec![None; asks.len()];
    for i in 0..asks.len() {
        // Frames of an enhancer already run have their answer.
        let Some(with) = asks[i].filter(|_| out[i].is_none()) else {
            continue;
        };
        let group: Vec<usize> = (i..asks.len())
            .filter(|&j| asks[j].is_some_and(|w| w == with))
            .collect();
        let s = with.net.scale();
        let face_len = 3 * (FACE_SIZE * s) * (FACE_SIZE * s);
        for chunk in group.chunks(CHUNK) {
            let mut rgb = Vec::with_capacity(chunk.len() * 3 * PLANE);
            for &j in chunk {
                let p = &preds[j * 3 * PLANE..(j + 1) * 3 * PLANE];
                // The generator draws BGR; the enhancers take RGB.
                for c in [2, 1, 0] {
                    rgb.extend_from_slice(&p[c * PLANE..(c + 1) * PLANE]);
                }
            }
            let result = with.forward(chunk.len(), &rgb);
            for (k, &j) in chunk.iter().enumerate() {
                out[j] = Some(match &result {
                    Ok(v) => {
                        let mut bgr = enhancer::planar_to_rgb8(&v[k * face_len..][..face_len]);
                        face::swap_red_blue(&mut bgr);
                        Ok(bgr)
                    }
                    Err(e) => Err(format!("enhancer {}: {e}", with.name)),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::enhancer::testing::{checkpoint, compact_keys};

    fn with(net: &Arc<dyn EnhancerNet>, device: Option<&Device>) -> EnhanceWith {
        EnhanceWith {
            name: "tiny".into(),
            net: net.clone(),
            on_device: device.map(|d| net.on_device(d).unwrap()),
            seconds_per_face: 0.0,
        }
    }

    #[test]
    fn the_stage_answers_every_frame_that_asked_in_chunks_on_either_pass() {
        // More frames than a chunk, every other one asking: each asking frame gets the face
        // its enhancer makes of its own prediction alone (chunking mixes nothing up), the
        // others nothing; the tensor pass (what a GPU runs, here on candle's CPU) gives the
        // same bytes as the CPU pass, within a level.
        let net = enhancer::recognise(&checkpoint(&compact_keys(4, 1, 2))).unwrap();
        let n = 2 * CHUNK + 5;
        let preds: Vec<f32> = (0..n * 3 * FACE_SIZE * FACE_SIZE)
            .map(|i| ((i * 31 + i / 977) % 256) as f32 / 255.0)
            .collect();
        let cpu = with(&net, None);
        let tensors = with(&net, Some(&Device::Cpu));
        let asks: Vec<Option<&EnhanceWith>> =
            (0..n).map(|i| (i % 2 == 0).then_some(&cpu)).collect();
        let got = run(&asks, &preds);
        let alone = |i: usize, w: &EnhanceWith| {
            let p = &preds[i * 3 * FACE_SIZE * FACE_SIZE..(i + 1) * 3 * FACE_SIZE * FACE_SIZE];
            run(&[Some(w)], p).remove(0).unwrap().unwrap()
        };
        for (i, face) in got.iter().enumerate() {
            match face {
                None => assert!(i % 2 == 1, "frame {i} asked and got nothing"),
                Some(face) => {
                    let face = face.as_ref().unwrap();
                    assert_eq!(face.len(), 3 * 192 * 192, "frame {i}");
                    assert_eq!(face, &alone(i, &cpu), "frame {i}");
                    let on_tensors = alone(i, &tensors);
                    let worst = face
                        .iter()
                        .zip(&on_tensors)
                        .map(|(a, b)| a.abs_diff(*b))
                        .max()
                        .unwrap();
                    assert!(worst <= 1, "frame {i}: the passes differ by {worst}");
                }
            }
        }
        let loaded = Enhancers::default();
        assert_eq!(loaded.device_bytes(512), 0);
    }
}
