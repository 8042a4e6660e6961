//! Enhancers on the engine: the files loaded at start-up (`--enhancer-checkpoint`), the name a
//! request gives (`enhance=esrgan`) resolved to one of them, each one's cost measured once at
//! start-up, and a batch of faces run through one of them ([`run_batch`]).
//!
//! They run on their own instances ([`super::enhance_pool`], `--enhancer-instances`): a model
//! instance hands over the faces that asked for an enhancer as soon as it has drawn them, and
//! the enhanced face (96·s × 96·s BGR) is what the frame's request gets, which the compositor
//! resizes into the face box as it does the 96×96 one. They compute in f32: on the CPU with
//! the enhancer's CPU pass, on a GPU with its tensor pass (candle's `conv2d`, cuDNN's
//! convolutions), each instance with its own copy of the weights there.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;

use super::Error;
use crate::media::face;
use crate::model::arch::FACE_SIZE;
use crate::model::enhancer::{self, Applies, DeviceNet, Enhancer, EnhancerNet, Kind};
use crate::model::retinaface::{self, RetinaFace};

/// The enhancer a frame asks for.
#[derive(Clone)]
pub struct EnhanceWith {
    pub name: Arc<str>,
    pub net: Arc<dyn EnhancerNet>,
    /// Its weights on the GPU, where the engine runs on one (else the CPU pass runs).
    pub on_device: Option<Arc<dyn DeviceNet>>,
    /// One face (96×96, or one aligned face for a restorer), measured at start-up (what live
    /// admission weighs its faces by).
    pub seconds_per_face: f64,
    /// For a restorer: the landmark detector loaded beside it, which finds the landmarks of
    /// an avatar that has no client landmarks ([`Avatar::detect_landmarks`]).
    pub landmarks: Option<Arc<RetinaFace>>,
}

impl std::fmt::Debug for EnhanceWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EnhanceWith({})", self.name)
    }
}

impl EnhanceWith {
    /// `n` RGB faces `(n, 3, side, side)` in [0, 1] through the enhancer, on its device
    /// (`side` is [`EnhanceWith::side`]).
    pub fn forward(&self, n: usize, rgb: &[f32]) -> crate::model::Result<Vec<f32>> {
        let side = self.side();
        match &self.on_device {
            Some(d) => d.forward(n, side, side, rgb),
            None => self.net.forward_cpu(n, side, side, rgb),
        }
    }

    /// Where a render applies it.
    pub fn applies(&self) -> Applies {
        self.net.applies()
    }

    /// Whether it restores the pasted face aligned to a template (GFPGAN) rather than the
    /// generator's face.
    pub fn restores(&self) -> bool {
        matches!(self.applies(), Applies::AlignedFace(_))
    }

    /// The side of the faces it takes: the generator's 96, or the template's.
    pub fn side(&self) -> usize {
        side_of(self.applies())
    }

    /// The most faces one pass of it takes.
    pub fn chunk(&self) -> usize {
        if self.restores() {
            super::restore::CHUNK
        } else {
            CHUNK
        }
    }
}

/// The side of the square faces an enhancer applied so takes.
fn side_of(applies: Applies) -> usize {
    match applies {
        Applies::Face => FACE_SIZE,
        Applies::AlignedFace(side) => side,
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
    /// On a GPU, the weights of enhancer instances 1, 2, … (instance 0 runs
    /// `with.on_device`).
    copies: Vec<Arc<dyn DeviceNet>>,
}

/// A landmark detector loaded with the enhancers.
struct Detector {
    name: String,
    path: PathBuf,
    net: Arc<RetinaFace>,
}

/// The enhancers loaded at start-up, and how many instances run them; and the landmark
/// detector (RetinaFace) loaded beside them, if any.
pub struct Enhancers {
    list: Vec<Loaded>,
    instances: usize,
    detector: Option<Detector>,
}

impl Default for Enhancers {
    fn default() -> Self {
        Enhancers {
            list: Vec::new(),
            instances: 1,
            detector: None,
        }
    }
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
pub const CHUNK: usize = enhancer::MAX_BATCH;

/// What `enhance` may say besides a kind or a name: no enhancer.
pub const NONE: &str = "none";

impl Enhancers {
    /// Loads every file (its kind recognised from its keys) and measures each one's cost on
    /// one 96×96 face. Two files with the same name (file stem) are refused: requests pick
    /// enhancers by it. `devices` has one device per enhancer instance (at least one): on a
    /// GPU each instance's copy of the weights goes to its device and the tensor pass runs;
    /// on the CPU the CPU pass.
    pub fn load(paths: &[PathBuf], devices: &[Device]) -> Result<Enhancers, crate::model::Error> {
        let (device, others) = devices
            .split_first()
            .ok_or_else(|| crate::model::Error::Settings("no device for the enhancers".into()))?;
        let instances = devices.len();
        let mut list: Vec<Loaded> = Vec::with_capacity(paths.len());
        let mut detector: Option<Detector> = None;
        for path in paths {
            let ck = crate::model::checkpoint::read(path)?;
            if let Some(net) = retinaface::recognise(&ck) {
                let net = net?;
                if let Some(other) = &detector {
                    return Err(crate::model::Error::Settings(format!(
                        "two landmark detectors ({} and {}): load one",
                        other.path.display(),
                        path.display()
                    )));
                }
                tracing::info!(
                    "landmark detector {}: RetinaFace ({}) on the CPU",
                    path.display(),
                    net.backbone().name()
                );
                detector = Some(Detector {
                    name: enhancer::name_of(path),
                    path: path.clone(),
                    net,
                });
                continue;
            }
            let enhancer = enhancer::from_checkpoint(path, &ck)?;
            if enhancer.name == NONE || Kind::NAMES.contains(&enhancer.name.as_str()) {
                return Err(crate::model::Error::Settings(format!(
                    "{}: an enhancer file may not be named {:?} (requests use that word)",
                    path.display(),
                    enhancer.name
                )));
            }
            // Rendering runs an enhancer on the generator's faces or on the pasted face
            // aligned to its template: one that cannot take that size is refused here.
            let side = side_of(enhancer.net.applies());
            if let Err(e) = enhancer.net.check_size(side, side) {
                return Err(crate::model::Error::Settings(format!(
                    "{}: {e}; rendering runs it on {side}x{side} faces",
                    path.display()
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
                gpu => match enhancer.net.on_device(gpu) {
                    Ok(net) => Some(net),
                    // A network without a device pass runs its CPU pass on the enhancer
                    // instances' threads, and `/info` says so.
                    Err(crate::model::Error::Unsupported(why)) => {
                        tracing::warn!("enhancer {}: {why}; it runs on the CPU", enhancer.name);
                        None
                    }
                    Err(e) => return Err(e),
                },
            };
            let copies = match on_device {
                None => Vec::new(),
                Some(_) => others
                    .iter()
                    .map(|d| enhancer.net.on_device(d))
                    .collect::<Result<_, _>>()?,
            };
            let mut with = EnhanceWith {
                name: enhancer.name.as_str().into(),
                net: enhancer.net.clone(),
                on_device,
                seconds_per_face: 0.0,
                landmarks: None,
            };
            let grey = vec![0.5f32; 3 * side * side];
            // The first pass on a GPU loads kernels and picks algorithms: time the second.
            if with.on_device.is_some() {
                with.forward(1, &grey)?;
            }
            let t = Instant::now();
            with.forward(1, &grey)?;
            with.seconds_per_face = t.elapsed().as_secs_f64();
            if with.restores() {
                // A restored face also costs its warps and blend on the CPU.
                with.seconds_per_face += super::restore::warp_seconds(side);
            }
            tracing::info!(
                "enhancer {} ({}, {}): {:.1} ms per {side}x{side} face on the {}",
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
            list.push(Loaded {
                enhancer,
                with,
                copies,
            });
        }
        if let Some(d) = &detector {
            let mut restorers = 0;
            for l in list.iter_mut().filter(|l| l.with.restores()) {
                l.with.landmarks = Some(d.net.clone());
                restorers += 1;
            }
            if restorers == 0 {
                tracing::warn!(
                    "landmark detector {}: no enhancer that needs landmarks is loaded (GFPGAN), \
                     so it will not run",
                    d.path.display()
                );
            }
        }
        Ok(Enhancers {
            list,
            instances,
            detector,
        })
    }

    /// The landmark detector, when one is loaded beside a restorer that uses it: what an
    /// avatar's preparation runs ([`Avatar::detect_landmarks`]).
    pub fn landmark_detector(&self) -> Option<&Arc<RetinaFace>> {
        let d = self.detector.as_ref()?;
        self.list
            .iter()
            .any(|l| l.with.restores())
            .then_some(&d.net)
    }

    /// The landmark detector loaded, used or not.
    pub fn detector(&self) -> Option<&Arc<RetinaFace>> {
        self.detector.as_ref().map(|d| &d.net)
    }

    /// For `/info`: the landmark detector, or null.
    pub fn detector_info(&self) -> serde_json::Value {
        match &self.detector {
            None => serde_json::Value::Null,
            Some(d) => serde_json::json!({
                "name": d.name,
                "kind": "retinaface",
                "architecture": format!("RetinaFace ({})", d.net.backbone().name()),
                "checkpoint": d.path,
                "device": "cpu",
                "used": self.landmark_detector().is_some(),
            }),
        }
    }

    /// Enhancers already made, on the CPU (the engine's tests).
    #[cfg(test)]
    pub(crate) fn for_tests(withs: Vec<EnhanceWith>, instances: usize) -> Enhancers {
        let list = withs
            .into_iter()
            .map(|with| Loaded {
                enhancer: Enhancer {
                    name: with.name.to_string(),
                    path: PathBuf::from(format!("{}.pth", with.name)),
                    net: with.net.clone(),
                },
                with,
                copies: Vec::new(),
            })
            .collect();
        Enhancers {
            list,
            instances,
            detector: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The instances that run the enhancers (`--enhancer-instances`).
    pub fn instances(&self) -> usize {
        self.instances
    }

    /// The weights on the device that enhancer instance `k` runs `with` on (`None`: the CPU
    /// pass).
    pub fn instance_net(&self, with: &EnhanceWith, k: usize) -> Option<Arc<dyn DeviceNet>> {
        let loaded = self.list.iter().find(|l| l.with == *with);
        match (k, loaded) {
            (1.., Some(l)) if k <= l.copies.len() => Some(l.copies[k - 1].clone()),
            _ => with.on_device.clone(),
        }
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

    /// Device memory the enhancers hold on a GPU: per instance, every one's weights and the
    /// largest one's activations (an instance runs one enhancer at a time, at most
    /// [`EnhanceWith::chunk`] faces at once). 0 on the CPU.
    pub fn device_bytes(&self) -> u64 {
        let each: Vec<(u64, u64)> = self
            .list
            .iter()
            .filter_map(|l| Some((l.with.on_device.as_ref()?, l.with.side(), l.with.chunk())))
            .map(|(d, side, n)| {
                let weights = d.bytes(0, side, side);
                (weights, d.bytes(n, side, side) - weights)
            })
            .collect();
        let per_instance =
            each.iter().map(|e| e.0).sum::<u64>() + each.iter().map(|e| e.1).max().unwrap_or(0);
        per_instance * self.instances as u64
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
                let side = l.with.side();
                serde_json::json!({
                    "name": e.name,
                    "kind": e.kind(),
                    "architecture": e.net.describe(),
                    "scale": e.net.scale(),
                    "checkpoint": e.path,
                    "device": if l.with.on_device.is_some() { "cuda" } else { "cpu" },
                    "conv_path": l.with.on_device.as_ref().map_or("cpu", |d| d.conv_path()),
                    "dtype": "f32",
                    "instances": self.instances,
                    "ms_per_face": seconds_per_face * 1e3,
                    "faces_per_second": 1.0 / seconds_per_face.max(1e-9),
                    "multiply_adds_per_face": e.net.multiply_adds(side, side),
                    "applies_to": match l.with.applies() {
                        Applies::Face => "face",
                        Applies::AlignedFace(_) => "aligned_face",
                    },
                    "face_side": side,
                })
            })
            .collect()
    }
}

/// Faces through one enhancer: each of `faces` is a prediction, `(3, 96, 96)` planar BGR in
/// [0, 1]; `net` the weights on the device to run it on (`None`: the CPU pass). Returns each
/// enhanced face as interleaved BGR bytes, [`CHUNK`] faces at a time.
pub fn run_batch(
    with: &EnhanceWith,
    net: Option<&dyn DeviceNet>,
    faces: &[&[f32]],
) -> Result<Vec<Vec<u8>>, String> {
    const PLANE: usize = FACE_SIZE * FACE_SIZE;
    let s = with.net.scale();
    let face_len = 3 * (FACE_SIZE * s) * (FACE_SIZE * s);
    let mut out = Vec::with_capacity(faces.len());
    for chunk in faces.chunks(CHUNK) {
        let mut rgb = Vec::with_capacity(chunk.len() * 3 * PLANE);
        for p in chunk {
            if p.len() != 3 * PLANE {
                return Err(format!("a face of {} values, not {}", p.len(), 3 * PLANE));
            }
            // The generator draws BGR; the enhancers take RGB.
            for c in [2, 1, 0] {
                rgb.extend_from_slice(&p[c * PLANE..(c + 1) * PLANE]);
            }
        }
        let n = chunk.len();
        let v = match net {
            Some(d) => d.forward(n, FACE_SIZE, FACE_SIZE, &rgb),
            None => with.net.forward_cpu(n, FACE_SIZE, FACE_SIZE, &rgb),
        }
        .map_err(|e| e.to_string())?;
        for k in 0..n {
            let mut bgr = enhancer::planar_to_rgb8(&v[k * face_len..][..face_len]);
            face::swap_red_blue(&mut bgr);
            out.push(bgr);
        }
    }
    Ok(out)
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
            landmarks: None,
        }
    }

    #[test]
    fn a_batch_runs_in_chunks_on_either_pass_and_each_face_is_its_own() {
        // More faces than a chunk: each enhanced face is what the enhancer makes of that face
        // alone (chunking mixes nothing up), and the tensor pass (what a GPU runs, here on
        // candle's CPU) gives the same bytes as the CPU pass, within a level.
        let net = enhancer::recognise(&checkpoint(&compact_keys(4, 1, 2))).unwrap();
        let n = 2 * CHUNK + 5;
        let plane = 3 * FACE_SIZE * FACE_SIZE;
        let preds: Vec<f32> = (0..n * plane)
            .map(|i| ((i * 31 + i / 977) % 256) as f32 / 255.0)
            .collect();
        let faces: Vec<&[f32]> = preds.chunks_exact(plane).collect();
        let cpu = with(&net, None);
        let tensors = with(&net, Some(&Device::Cpu));
        let got = run_batch(&cpu, None, &faces).unwrap();
        assert_eq!(got.len(), n);
        for (i, face) in got.iter().enumerate() {
            assert_eq!(face.len(), 3 * 192 * 192, "face {i}");
            assert_eq!(
                face,
                &run_batch(&cpu, None, &[faces[i]]).unwrap()[0],
                "face {i}"
            );
            let on_tensors =
                run_batch(&tensors, tensors.on_device.as_deref(), &[faces[i]]).unwrap();
            let worst = face
                .iter()
                .zip(&on_tensors[0])
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap();
            assert!(worst <= 1, "face {i}: the passes differ by {worst}");
        }
        // A face of the wrong size is an error, not a panic.
        assert!(run_batch(&cpu, None, &[&preds[..10]]).is_err());
        assert_eq!(Enhancers::default().device_bytes(), 0);
    }
}
