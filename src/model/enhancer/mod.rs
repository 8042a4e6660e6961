//! Enhancers: networks that sharpen the generator's faces, loaded from the files their authors
//! publish and recognised from the files' keys (never from the file name).
//!
//! Each kind is one file behind [`EnhancerNet`]: it says whether a checkpoint is its kind
//! ([`Recogniser`]), checks every key and shape strictly, and runs its f32 forward pass on the
//! CPU. [`load`] tries the recognisers in turn.
//!
//! | kind | file | architectures |
//! |---|---|---|
//! | `esrgan` | [`esrgan`] | Real-ESRGAN's SRVGGNetCompact and RRDBNet |
//! | `gfpgan` | [`gfpgan`] | GFPGAN v1.3 / v1.4 (`GFPGANv1Clean`, 512) |

mod device;
pub mod esrgan;
pub mod gfpgan;
#[cfg(test)]
pub(crate) mod testing;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::checkpoint::{self, Checkpoint};
use super::{Error, Result};

/// The kinds of enhancer, as requests name them (`enhance=esrgan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Esrgan,
    Gfpgan,
}

named_enum!(Kind, "an enhancer kind", { "esrgan" => Esrgan, "gfpgan" => Gfpgan });

impl Kind {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// Where a render applies an enhancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// On the generator's 96×96 face, before it is pasted (Real-ESRGAN): the compositor
    /// pastes the enhanced face instead.
    Face,
    /// On the pasted face aligned to the FFHQ template of this side (GFPGAN): the restored
    /// face is warped back into the frame through the lower-face mask
    /// (`media::face::restore`).
    AlignedFace(usize),
}

/// An enhancer's weights, ready to run; shared by everything that runs it.
pub trait EnhancerNet: Send + Sync {
    fn kind(&self) -> Kind;
    /// Where a render applies it.
    fn applies(&self) -> Applies {
        Applies::Face
    }
    /// The architecture and its settings, for `/info` and messages
    /// (`SRVGGNetCompact (32 convolutions, x4)`).
    fn describe(&self) -> String;
    /// How many times larger the output is than the input, per side.
    fn scale(&self) -> usize;
    /// Refuses input sizes the network cannot take (x2's pixel-unshuffle needs even sides).
    fn check_size(&self, height: usize, width: usize) -> Result<()>;
    /// Multiply-adds for one image of `height × width`.
    fn multiply_adds(&self, height: usize, width: usize) -> f64;
    /// `n` RGB images, `(n, 3, height, width)` in [0, 1], in; `(n, 3, height·s, width·s)`
    /// clamped to [0, 1] out, in f32 on the CPU.
    fn forward_cpu(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>>;
    /// The same network with its weights on `device`, run as candle tensors in f32; on CUDA
    /// its convolutions take the own cuDNN path (`--conv-engine cudnn`, warmed up and
    /// checked against the CPU pass here) or candle's `conv2d`.
    fn on_device(&self, device: &candle_core::Device) -> Result<Arc<dyn DeviceNet>>;
}

/// An enhancer's weights on a device ([`EnhancerNet::on_device`]). Inputs and outputs are
/// host memory, as [`EnhancerNet::forward_cpu`]'s; one batch runs at a time.
pub trait DeviceNet: Send + Sync {
    /// `n` RGB images, `(n, 3, height, width)` in [0, 1], in; `(n, 3, height·s, width·s)`
    /// clamped to [0, 1] out.
    fn forward(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>>;
    /// Device memory for a batch of `n` images of `height × width`: the weights plus an
    /// estimate of the activations alive at the pass's peak.
    fn bytes(&self, n: usize, height: usize, width: usize) -> u64;
    /// How its convolutions run: `cudnn` (the own cuDNN path, as the generator's) or
    /// `candle` (candle's `conv2d`).
    fn conv_path(&self) -> &'static str;
}

/// The most faces one pass of an enhancer takes at once (the engine's batches run in pieces
/// of this; the own cuDNN path is timed at it).
pub const MAX_BATCH: usize = 32;

/// Looks at a checkpoint's keys: `None` when it is not this kind, else the loaded network or
/// why this kind's file is not complete.
pub type Recogniser = fn(&Checkpoint) -> Option<Result<Arc<dyn EnhancerNet>>>;

/// Every kind's recogniser, in the order they are tried.
const RECOGNISERS: &[Recogniser] = &[esrgan::recognise, gfpgan::recognise];

/// A loaded enhancer file.
#[derive(Clone)]
pub struct Enhancer {
    /// Its name in requests: the file's stem (`realesr-general-x4v3`).
    pub name: String,
    pub path: PathBuf,
    pub net: Arc<dyn EnhancerNet>,
}

impl std::fmt::Debug for Enhancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enhancer")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("net", &self.net.describe())
            .finish()
    }
}

impl Enhancer {
    pub fn kind(&self) -> Kind {
        self.net.kind()
    }
}

/// Reads an enhancer file and recognises its kind from the keys.
pub fn load(path: &Path) -> Result<Enhancer> {
    from_checkpoint(path, &checkpoint::read(path)?)
}

/// The enhancer in `ck`, read from `path`, recognised from its keys.
pub fn from_checkpoint(path: &Path, ck: &Checkpoint) -> Result<Enhancer> {
    Ok(Enhancer {
        name: name_of(path),
        path: path.to_path_buf(),
        net: recognise(ck)?,
    })
}

/// A loaded file's name in requests and listings: its stem.
pub fn name_of(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The network a checkpoint holds, by the first recogniser that knows its keys.
pub fn recognise(ck: &Checkpoint) -> Result<Arc<dyn EnhancerNet>> {
    for r in RECOGNISERS {
        if let Some(net) = r(ck) {
            return net;
        }
    }
    let keys: Vec<&str> = ck.tensors.iter().take(6).map(|(k, _)| k.as_str()).collect();
    Err(Error::Unsupported(format!(
        "no enhancer is recognised from this checkpoint's keys ({}{}); known: {}",
        keys.join(", "),
        if ck.tensors.len() > keys.len() {
            ", ..."
        } else {
            ""
        },
        super::one_of(Kind::NAMES)
    )))
}

/// Checks a checkpoint against an architecture's full list of tensors (key, shape), strictly:
/// the first missing key, wrong shape or extra key is the error, named for `model`. Returns
/// the tensors in f32, in the list's order.
pub(crate) fn strict_tensors(
    ck: &Checkpoint,
    model: &str,
    expected: &[(String, Vec<usize>)],
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(expected.len());
    for (key, shape) in expected {
        let Some(t) = ck.get(key) else {
            return Err(mismatch(model, format!("the tensor {key} is missing")));
        };
        if &t.shape != shape {
            return Err(mismatch(
                model,
                format!("the tensor {key} has shape {:?}, not {shape:?}", t.shape),
            ));
        }
        let v: Vec<f32> = t
            .to_tensor()?
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        if v.iter().any(|x| !x.is_finite()) {
            return Err(Error::NonFinite { key: key.clone() });
        }
        out.push(v);
    }
    if let Some((extra, _)) = ck
        .tensors
        .iter()
        .find(|(k, _)| !expected.iter().any(|(e, _)| e == k))
    {
        return Err(mismatch(
            model,
            format!("the checkpoint has a tensor it does not use: {extra}"),
        ));
    }
    Ok(out)
}

/// An enhancer's output as 8-bit pixels: `(3, h, w)` planar RGB in [0, 1] (one image of
/// `v.len() / 3` pixels) to interleaved RGB, `round(x · 255)` as Real-ESRGAN's wrapper writes
/// it.
pub fn planar_to_rgb8(v: &[f32]) -> Vec<u8> {
    let plane = v.len() / 3;
    let mut out = vec![0u8; 3 * plane];
    for (i, px) in out.chunks_exact_mut(3).enumerate() {
        for (c, o) in px.iter_mut().enumerate() {
            *o = (v[c * plane + i].clamp(0.0, 1.0) * 255.0).round() as u8;
        }
    }
    out
}

/// A model whose checkpoint does not hold exactly its tensors.
pub(crate) fn mismatch(model: &str, detail: String) -> Error {
    Error::Mismatch {
        model: model.into(),
        detail,
    }
}

/// The dimensions of a checkpoint's tensor, if it has that key.
pub(crate) fn dims<'a>(ck: &'a Checkpoint, key: &str) -> Option<&'a [usize]> {
    ck.get(key).map(|t| t.shape.as_slice())
}
