//! Enhancers on the engine: the files loaded at start-up (`--enhancer-checkpoint`), the name a
//! request gives (`enhance=esrgan`) resolved to one of them, each one's cost measured once at
//! start-up, and the stage that runs them on a batch's predicted faces.
//!
//! The stage runs on the model instance's own thread right after the generator, one
//! sub-batch per enhancer over the batch's frames that asked for it; those frames come back
//! as the enhanced face (96·s × 96·s BGR), which the compositor resizes into the face box as
//! it does the 96×96 one. It computes in f32 on the CPU (the CUDA path is not built yet: a
//! CUDA engine refuses enhancers at start-up).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::Error;
use crate::media::face;
use crate::model::arch::FACE_SIZE;
use crate::model::enhancer::{self, Enhancer, EnhancerNet, Kind};

/// The enhancer a frame asks for.
#[derive(Clone)]
pub struct EnhanceWith {
    pub name: Arc<str>,
    pub net: Arc<dyn EnhancerNet>,
    /// One 96×96 face, measured at start-up (what live admission weighs its faces by).
    pub seconds_per_face: f64,
}

impl std::fmt::Debug for EnhanceWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EnhanceWith({})", self.name)
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

/// What `enhance` may say besides a kind or a name: no enhancer.
pub const NONE: &str = "none";

impl Enhancers {
    /// Loads every file (its kind recognised from its keys) and measures each one's cost on
    /// one 96×96 face. Two files with the same name (file stem) are refused: requests pick
    /// enhancers by it.
    pub fn load(paths: &[PathBuf]) -> Result<Enhancers, crate::model::Error> {
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
            let grey = vec![0.5f32; 3 * FACE_SIZE * FACE_SIZE];
            let t = Instant::now();
            enhancer.net.forward_cpu(1, FACE_SIZE, FACE_SIZE, &grey)?;
            let seconds_per_face = t.elapsed().as_secs_f64();
            tracing::info!(
                "enhancer {} ({}, {}): {:.1} ms per 96x96 face on the CPU",
                enhancer.name,
                enhancer.kind().name(),
                enhancer.net.describe(),
                seconds_per_face * 1e3
            );
            let with = EnhanceWith {
                name: enhancer.name.as_str().into(),
                net: enhancer.net.clone(),
                seconds_per_face,
            };
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
                    "device": "cpu",
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
/// that share an enhancer run as one batch.
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
        let mut rgb = Vec::with_capacity(group.len() * 3 * PLANE);
        for &j in &group {
            let p = &preds[j * 3 * PLANE..(j + 1) * 3 * PLANE];
            // The generator draws BGR; the enhancers take RGB.
            for c in [2, 1, 0] {
                rgb.extend_from_slice(&p[c * PLANE..(c + 1) * PLANE]);
            }
        }
        let result = with
            .net
            .forward_cpu(group.len(), FACE_SIZE, FACE_SIZE, &rgb);
        let s = with.net.scale();
        let side = FACE_SIZE * s;
        for (k, &j) in group.iter().enumerate() {
            out[j] = Some(match &result {
                Ok(v) => {
                    let face_len = 3 * side * side;
                    let mut bgr = enhancer::planar_to_rgb8(&v[k * face_len..][..face_len]);
                    face::swap_red_blue(&mut bgr);
                    Ok(bgr)
                }
                Err(e) => Err(format!("enhancer {}: {e}", with.name)),
            });
        }
    }
    out
}
