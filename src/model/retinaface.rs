//! RetinaFace (biubug6/Pytorch_Retinaface, MIT; as facexlib 0.3.0 builds it): a face detector
//! that gives boxes, scores and five landmarks, loaded from the published files and recognised
//! from their keys:
//! - `detection_Resnet50_Final.pth` (facexlib): a torchvision ResNet-50 body, its `layer2`,
//!   `layer3` and `layer4` (strides 8, 16, 32) into a 256-channel FPN;
//! - `mobilenet0.25_Final.pth` (Pytorch_Retinaface): MobileNet-0.25's `stage1`–`stage3` into a
//!   64-channel FPN.
//!
//! Keys may carry DataParallel's `module.` prefix (both projects strip it when loading);
//! batch-norm's `num_batches_tracked` counters are accepted and unused. Every other tensor is
//! checked strictly.
//!
//! The network, in eval mode: the FPN's lateral 1×1 convolutions, the upper levels added in
//! after a nearest resize to the lower level's size and merged by a 3×3 convolution; on each
//! level an SSH context module (3×3 → half the channels; 3×3 → a quarter, then a 3×3 on it, and
//! a 3×3 → 3×3 chain on that, the three concatenated, ReLU); then per level three 1×1 heads
//! with two anchors per position: class (softmaxed), box (4) and landmarks (10). Every
//! convolution but the heads' is followed by a batch norm, folded into it here (the scale into
//! the weight, the shift into the bias). LeakyReLU's slope is 0.1 where the FPN is 64 channels
//! wide (MobileNet) and 0 (ReLU) at 256.
//!
//! The input is BGR minus (104, 117, 123), unscaled, as facexlib gives it. The priors are
//! facexlib's `PriorBox` (sizes 16/32, 64/128, 256/512 at strides 8, 16, 32; every position,
//! row by row, then the two sizes), and the outputs decode as its `decode`/`decode_landm`
//! with variances 0.1 and 0.2. f32 on the CPU.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use super::checkpoint::Checkpoint;
use super::cpu::{concat_all, Act, Activation, Conv};
use super::enhancer::strict_tensors;
use super::{Error, Result};

/// BGR means subtracted from the input.
const MEAN_BGR: [f32; 3] = [104.0, 117.0, 123.0];
/// Anchor sizes per level, and the levels' strides.
const MIN_SIZES: [[f32; 2]; 3] = [[16.0, 32.0], [64.0, 128.0], [256.0, 512.0]];
const STEPS: [usize; 3] = [8, 16, 32];
const VARIANCE: [f32; 2] = [0.1, 0.2];
const BN_EPS: f32 = 1e-5;

/// Which body the file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backbone {
    Resnet50,
    MobileNet025,
}

impl Backbone {
    pub fn name(self) -> &'static str {
        match self {
            Backbone::Resnet50 => "ResNet-50",
            Backbone::MobileNet025 => "MobileNet-0.25",
        }
    }

    /// The FPN's width.
    fn out_channels(self) -> usize {
        match self {
            Backbone::Resnet50 => 256,
            Backbone::MobileNet025 => 64,
        }
    }

    /// The body's three outputs' channels.
    fn in_channels(self) -> [usize; 3] {
        match self {
            Backbone::Resnet50 => [512, 1024, 2048],
            Backbone::MobileNet025 => [64, 128, 256],
        }
    }

    /// The FPN's and SSH's LeakyReLU slope.
    fn leaky(self) -> f32 {
        if self.out_channels() <= 64 {
            0.1
        } else {
            0.0
        }
    }
}

/// One face: its box `[x1, y1, x2, y2]`, score and landmarks `[x, y] × 5` (RetinaFace's
/// order: the eye on the image's left, the other eye, the nose, the mouth's left and right
/// corners), in the input's pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Face {
    pub bbox: [f32; 4],
    pub score: f32,
    pub landmarks: [f32; 10],
}

/// The network's outputs for one image, one row per prior: box offsets, class probabilities
/// (background, face) and landmark offsets.
#[derive(Debug, Clone)]
pub struct Raw {
    pub loc: Vec<[f32; 4]>,
    pub conf: Vec<[f32; 2]>,
    pub landms: Vec<[f32; 10]>,
}

/// A convolution and its folded batch norm, with the activation that follows it.
struct Cba {
    conv: Conv,
    slope: Option<f32>,
}

impl Cba {
    fn forward(&self, x: &Act, residual: Option<&Act>) -> Act {
        let act = match self.slope {
            None => Activation::None,
            Some(0.0) => Activation::Relu,
            Some(s) => Activation::Leaky(s),
        };
        self.conv.forward(x, residual, act)
    }
}

/// A depthwise 3×3 convolution (padding 1) and its folded batch norm, then LeakyReLU.
struct Depthwise {
    /// `[c][9]`.
    weight: Vec<f32>,
    bias: Vec<f32>,
    stride: usize,
    slope: f32,
}

impl Depthwise {
    fn forward(&self, x: &Act) -> Act {
        let c = x.c;
        let out = |side: usize| (side + 2 - 3) / self.stride + 1;
        let (h, w) = (out(x.h), out(x.w));
        let mut data = vec![0f32; x.n * h * w * c];
        data.par_chunks_mut(w * c)
            .enumerate()
            .for_each(|(row, dst)| {
                let (b, oy) = (row / h, row % h);
                for ox in 0..w {
                    let px = &mut dst[ox * c..(ox + 1) * c];
                    px.copy_from_slice(&self.bias);
                    for ky in 0..3 {
                        let iy = (oy * self.stride + ky) as isize - 1;
                        if iy < 0 || iy >= x.h as isize {
                            continue;
                        }
                        for kx in 0..3 {
                            let ix = (ox * self.stride + kx) as isize - 1;
                            if ix < 0 || ix >= x.w as isize {
                                continue;
                            }
                            let src = ((b * x.h + iy as usize) * x.w + ix as usize) * c;
                            let tap = ky * 3 + kx;
                            for (ch, v) in px.iter_mut().enumerate() {
                                *v += x.data[src + ch] * self.weight[ch * 9 + tap];
                            }
                        }
                    }
                    for v in px.iter_mut() {
                        if *v < 0.0 {
                            *v *= self.slope;
                        }
                    }
                }
            });
        Act {
            n: x.n,
            h,
            w,
            c,
            data,
        }
    }
}

/// A torchvision ResNet bottleneck (stride on the 3×3).
struct Bottleneck {
    conv1: Cba,
    conv2: Cba,
    /// Its ReLU comes after the residual.
    conv3: Cba,
    downsample: Option<Cba>,
}

impl Bottleneck {
    fn forward(&self, x: &Act) -> Act {
        let identity = self.downsample.as_ref().map(|d| d.forward(x, None));
        let y = self.conv2.forward(&self.conv1.forward(x, None), None);
        self.conv3.forward(&y, Some(identity.as_ref().unwrap_or(x)))
    }
}

enum Body {
    Resnet {
        stem: Cba,
        /// layer1 … layer4.
        layers: Vec<Vec<Bottleneck>>,
    },
    MobileNet {
        first: Cba,
        /// Every conv_dw of stages 1–3, with the stage it ends (1, 2, 3) where it does.
        blocks: Vec<(Depthwise, Cba, Option<usize>)>,
    },
}

impl Body {
    /// The three feature maps the FPN takes (strides 8, 16, 32).
    fn forward(&self, x: &Act) -> [Act; 3] {
        let mut outs = Vec::with_capacity(3);
        match self {
            Body::Resnet { stem, layers } => {
                let mut y = max_pool_3x3_s2(&stem.forward(x, None));
                for (i, layer) in layers.iter().enumerate() {
                    for block in layer {
                        y = block.forward(&y);
                    }
                    if i >= 1 {
                        outs.push(y.clone());
                    }
                }
            }
            Body::MobileNet { first, blocks } => {
                let mut y = first.forward(x, None);
                for (dw, pw, ends) in blocks {
                    y = pw.forward(&dw.forward(&y), None);
                    if ends.is_some() {
                        outs.push(y.clone());
                    }
                }
            }
        }
        outs.try_into()
            .unwrap_or_else(|_| unreachable!("three levels"))
    }
}

struct Ssh {
    conv3: Cba,
    conv5_1: Cba,
    conv5_2: Cba,
    conv7_2: Cba,
    conv7_3: Cba,
}

impl Ssh {
    fn forward(&self, x: &Act) -> Act {
        let c3 = self.conv3.forward(x, None);
        let c5_1 = self.conv5_1.forward(x, None);
        let c5 = self.conv5_2.forward(&c5_1, None);
        let c7 = self
            .conv7_3
            .forward(&self.conv7_2.forward(&c5_1, None), None);
        concat_all(&[&c3, &c5, &c7])
    }
}

/// The loaded network.
pub struct RetinaFace {
    backbone: Backbone,
    body: Body,
    /// output1–3, merge1, merge2.
    lateral: [Cba; 3],
    merge: [Cba; 2],
    ssh: [Ssh; 3],
    /// Per level: class, box and landmark heads.
    heads: [[Conv; 3]; 3],
}

impl std::fmt::Debug for RetinaFace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RetinaFace({})", self.backbone.name())
    }
}

/// The file's tensors by name, `module.` stripped, batch-norm counters dropped.
fn normalised(ck: &Checkpoint) -> Checkpoint {
    let tensors = ck
        .tensors
        .iter()
        .filter(|(k, _)| !k.ends_with("num_batches_tracked"))
        .map(|(k, t)| {
            (
                k.strip_prefix("module.").unwrap_or(k).to_string(),
                t.clone(),
            )
        })
        .collect();
    Checkpoint {
        format: ck.format,
        tensors,
        metadata: ck.metadata.clone(),
    }
}

/// A RetinaFace network when the checkpoint has its keys (`None`: not RetinaFace).
pub fn recognise(ck: &Checkpoint) -> Option<Result<Arc<RetinaFace>>> {
    const HEAD: &str = "ClassHead.0.conv1x1.weight";
    ck.get(HEAD).or_else(|| ck.get(&format!("module.{HEAD}")))?;
    let ck = normalised(ck);
    let backbone = if ck.get("body.conv1.weight").is_some() {
        Backbone::Resnet50
    } else if ck.get("body.stage1.0.0.weight").is_some() {
        Backbone::MobileNet025
    } else {
        return Some(Err(Error::Unsupported(
            "a RetinaFace file whose body is neither ResNet-50 nor MobileNet-0.25".into(),
        )));
    };
    Some(RetinaFace::load(&ck, backbone).map(Arc::new))
}

/// Every tensor's key and shape, in a fixed order.
fn keys(backbone: Backbone) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    let conv = |out: &mut Vec<(String, Vec<usize>)>, p: &str, cout: usize, cin: usize, k: usize| {
        out.push((format!("{p}.weight"), vec![cout, cin, k, k]));
    };
    let bn = |out: &mut Vec<(String, Vec<usize>)>, p: &str, c: usize| {
        for n in ["weight", "bias", "running_mean", "running_var"] {
            out.push((format!("{p}.{n}"), vec![c]));
        }
    };
    match backbone {
        Backbone::Resnet50 => {
            conv(&mut out, "body.conv1", 64, 3, 7);
            bn(&mut out, "body.bn1", 64);
            let mut cin = 64;
            for (l, (blocks, width)) in [(3, 64), (4, 128), (6, 256), (3, 512)].iter().enumerate() {
                for i in 0..*blocks {
                    let p = format!("body.layer{}.{i}", l + 1);
                    conv(&mut out, &format!("{p}.conv1"), *width, cin, 1);
                    bn(&mut out, &format!("{p}.bn1"), *width);
                    conv(&mut out, &format!("{p}.conv2"), *width, *width, 3);
                    bn(&mut out, &format!("{p}.bn2"), *width);
                    conv(&mut out, &format!("{p}.conv3"), 4 * width, *width, 1);
                    bn(&mut out, &format!("{p}.bn3"), 4 * width);
                    if i == 0 {
                        conv(&mut out, &format!("{p}.downsample.0"), 4 * width, cin, 1);
                        bn(&mut out, &format!("{p}.downsample.1"), 4 * width);
                    }
                    cin = 4 * width;
                }
            }
        }
        Backbone::MobileNet025 => {
            conv(&mut out, "body.stage1.0.0", 8, 3, 3);
            bn(&mut out, "body.stage1.0.1", 8);
            for (stage, i, cin, cout, _) in mobilenet_blocks() {
                let p = format!("body.stage{stage}.{i}");
                out.push((format!("{p}.0.weight"), vec![cin, 1, 3, 3]));
                bn(&mut out, &format!("{p}.1"), cin);
                conv(&mut out, &format!("{p}.3"), cout, cin, 1);
                bn(&mut out, &format!("{p}.4"), cout);
            }
        }
    }
    let c = backbone.out_channels();
    for (i, cin) in backbone.in_channels().iter().enumerate() {
        conv(&mut out, &format!("fpn.output{}.0", i + 1), c, *cin, 1);
        bn(&mut out, &format!("fpn.output{}.1", i + 1), c);
    }
    for m in ["merge1", "merge2"] {
        conv(&mut out, &format!("fpn.{m}.0"), c, c, 3);
        bn(&mut out, &format!("fpn.{m}.1"), c);
    }
    for s in 1..=3 {
        for (name, cout, cin) in [
            ("conv3X3", c / 2, c),
            ("conv5X5_1", c / 4, c),
            ("conv5X5_2", c / 4, c / 4),
            ("conv7X7_2", c / 4, c / 4),
            ("conv7x7_3", c / 4, c / 4),
        ] {
            conv(&mut out, &format!("ssh{s}.{name}.0"), cout, cin, 3);
            bn(&mut out, &format!("ssh{s}.{name}.1"), cout);
        }
    }
    for (head, k) in [("ClassHead", 2), ("BboxHead", 4), ("LandmarkHead", 10)] {
        for i in 0..3 {
            let p = format!("{head}.{i}.conv1x1");
            out.push((format!("{p}.weight"), vec![2 * k, c, 1, 1]));
            out.push((format!("{p}.bias"), vec![2 * k]));
        }
    }
    out
}

/// MobileNet-0.25's conv_dw blocks: (stage, index in the stage, in, out, stride).
fn mobilenet_blocks() -> Vec<(usize, usize, usize, usize, usize)> {
    let mut v = vec![
        (1, 1, 8, 16, 1),
        (1, 2, 16, 32, 2),
        (1, 3, 32, 32, 1),
        (1, 4, 32, 64, 2),
        (1, 5, 64, 64, 1),
        (2, 0, 64, 128, 2),
    ];
    v.extend((1..6).map(|i| (2, i, 128, 128, 1)));
    v.extend([(3, 0, 128, 256, 2), (3, 1, 256, 256, 1)]);
    v
}

/// Named tensors, taken once each.
struct Tensors(HashMap<String, Vec<f32>>);

impl Tensors {
    fn take(&mut self, key: &str) -> Vec<f32> {
        self.0
            .remove(key)
            .unwrap_or_else(|| panic!("{key} checked present"))
    }

    /// Batch norm `p` as per-channel (scale, shift).
    fn bn(&mut self, p: &str) -> (Vec<f32>, Vec<f32>) {
        let (g, b) = (
            self.take(&format!("{p}.weight")),
            self.take(&format!("{p}.bias")),
        );
        let (m, v) = (
            self.take(&format!("{p}.running_mean")),
            self.take(&format!("{p}.running_var")),
        );
        let scale: Vec<f32> = g
            .iter()
            .zip(&v)
            .map(|(g, v)| g / (v + BN_EPS).sqrt())
            .collect();
        let shift = b
            .iter()
            .zip(&m)
            .zip(&scale)
            .map(|((b, m), s)| b - m * s)
            .collect();
        (scale, shift)
    }

    /// Convolution `conv` (no bias) and batch norm `bn` folded, then `slope` (`None`: none).
    fn cba(
        &mut self,
        conv: &str,
        bn: &str,
        shape: (usize, usize, usize),
        stride: usize,
        slope: Option<f32>,
    ) -> Cba {
        let (cin, cout, k) = shape;
        let mut w = self.take(&format!("{conv}.weight"));
        let (scale, shift) = self.bn(bn);
        let per_out = cin * k * k;
        for (o, s) in scale.iter().enumerate() {
            w[o * per_out..(o + 1) * per_out]
                .iter_mut()
                .for_each(|v| *v *= s);
        }
        Cba {
            conv: Conv::strided(&w, &shift, (cin, cout, k), stride, k / 2),
            slope,
        }
    }

    fn head(&mut self, p: &str, cin: usize, cout: usize) -> Conv {
        let (w, b) = (
            self.take(&format!("{p}.weight")),
            self.take(&format!("{p}.bias")),
        );
        Conv::new(&w, &b, cin, cout, 1)
    }
}

impl RetinaFace {
    fn load(ck: &Checkpoint, backbone: Backbone) -> Result<RetinaFace> {
        let expected = keys(backbone);
        let model = format!("RetinaFace ({})", backbone.name());
        let values = strict_tensors(ck, &model, &expected)?;
        let mut t = Tensors(expected.into_iter().map(|(k, _)| k).zip(values).collect());
        let body = match backbone {
            Backbone::Resnet50 => {
                let stem = t.cba("body.conv1", "body.bn1", (3, 64, 7), 2, Some(0.0));
                let mut cin = 64;
                let mut layers = Vec::new();
                for (l, (blocks, width, stride)) in
                    [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)]
                        .into_iter()
                        .enumerate()
                {
                    let mut layer = Vec::new();
                    for i in 0..blocks {
                        let p = format!("body.layer{}.{i}", l + 1);
                        let s = if i == 0 { stride } else { 1 };
                        let c = |n: &str| format!("{p}.{n}");
                        let conv1 = t.cba(&c("conv1"), &c("bn1"), (cin, width, 1), 1, Some(0.0));
                        let conv2 = t.cba(&c("conv2"), &c("bn2"), (width, width, 3), s, Some(0.0));
                        let conv3 =
                            t.cba(&c("conv3"), &c("bn3"), (width, 4 * width, 1), 1, Some(0.0));
                        let downsample = (i == 0).then(|| {
                            t.cba(
                                &c("downsample.0"),
                                &c("downsample.1"),
                                (cin, 4 * width, 1),
                                s,
                                None,
                            )
                        });
                        layer.push(Bottleneck {
                            conv1,
                            conv2,
                            conv3,
                            downsample,
                        });
                        cin = 4 * width;
                    }
                    layers.push(layer);
                }
                Body::Resnet { stem, layers }
            }
            Backbone::MobileNet025 => {
                let first = t.cba(
                    "body.stage1.0.0",
                    "body.stage1.0.1",
                    (3, 8, 3),
                    2,
                    Some(0.1),
                );
                let blocks = mobilenet_blocks()
                    .into_iter()
                    .map(|(stage, i, cin, cout, stride)| {
                        let p = format!("body.stage{stage}.{i}");
                        let mut w = t.take(&format!("{p}.0.weight"));
                        let (scale, shift) = t.bn(&format!("{p}.1"));
                        for (ch, s) in scale.iter().enumerate() {
                            w[ch * 9..(ch + 1) * 9].iter_mut().for_each(|v| *v *= s);
                        }
                        let dw = Depthwise {
                            weight: w,
                            bias: shift,
                            stride,
                            slope: 0.1,
                        };
                        let pw = t.cba(
                            &format!("{p}.3"),
                            &format!("{p}.4"),
                            (cin, cout, 1),
                            1,
                            Some(0.1),
                        );
                        let last = match stage {
                            1 => 5,
                            2 => 5,
                            _ => 1,
                        };
                        (dw, pw, (i == last).then_some(stage))
                    })
                    .collect();
                Body::MobileNet { first, blocks }
            }
        };
        let c = backbone.out_channels();
        let slope = Some(backbone.leaky());
        let ins = backbone.in_channels();
        let lateral = [0, 1, 2].map(|i| {
            let p = format!("fpn.output{}", i + 1);
            t.cba(
                &format!("{p}.0"),
                &format!("{p}.1"),
                (ins[i], c, 1),
                1,
                slope,
            )
        });
        let merge = [1, 2].map(|i| {
            let p = format!("fpn.merge{i}");
            t.cba(&format!("{p}.0"), &format!("{p}.1"), (c, c, 3), 1, slope)
        });
        let ssh = [1, 2, 3].map(|s| {
            let mut part = |name: &str, cin: usize, cout: usize, slope: Option<f32>| {
                let p = format!("ssh{s}.{name}");
                t.cba(
                    &format!("{p}.0"),
                    &format!("{p}.1"),
                    (cin, cout, 3),
                    1,
                    slope,
                )
            };
            // The parts that end the module take its ReLU (applied after the concatenation,
            // the same per channel).
            Ssh {
                conv3: part("conv3X3", c, c / 2, Some(0.0)),
                conv5_1: part("conv5X5_1", c, c / 4, slope),
                conv5_2: part("conv5X5_2", c / 4, c / 4, Some(0.0)),
                conv7_2: part("conv7X7_2", c / 4, c / 4, slope),
                conv7_3: part("conv7x7_3", c / 4, c / 4, Some(0.0)),
            }
        });
        let heads = [0, 1, 2].map(|i| {
            [("ClassHead", 4), ("BboxHead", 8), ("LandmarkHead", 20)]
                .map(|(h, cout)| t.head(&format!("{h}.{i}.conv1x1"), c, cout))
        });
        Ok(RetinaFace {
            backbone,
            body,
            lateral,
            merge,
            ssh,
            heads,
        })
    }

    pub fn backbone(&self) -> Backbone {
        self.backbone
    }

    /// The network's outputs on an RGB image (`width × height`, interleaved 8-bit).
    pub fn forward(&self, rgb: &[u8], width: usize, height: usize) -> Result<Raw> {
        if width == 0 || height == 0 || rgb.len() != 3 * width * height {
            return Err(Error::BadInput(format!(
                "{} bytes for a {width}x{height} RGB image",
                rgb.len()
            )));
        }
        let data = rgb
            .chunks_exact(3)
            .flat_map(|p| {
                [
                    f32::from(p[2]) - MEAN_BGR[0],
                    f32::from(p[1]) - MEAN_BGR[1],
                    f32::from(p[0]) - MEAN_BGR[2],
                ]
            })
            .collect();
        let x = Act {
            n: 1,
            h: height,
            w: width,
            c: 3,
            data,
        };
        let [c1, c2, c3] = self.body.forward(&x);
        let o1 = self.lateral[0].forward(&c1, None);
        let o2 = self.lateral[1].forward(&c2, None);
        let o3 = self.lateral[2].forward(&c3, None);
        let o2 = self.merge[1].forward(&add(&o2, &nearest(&o3, o2.h, o2.w)), None);
        let o1 = self.merge[0].forward(&add(&o1, &nearest(&o2, o1.h, o1.w)), None);
        let (mut loc, mut conf, mut landms) = (Vec::new(), Vec::new(), Vec::new());
        for (level, feature) in [o1, o2, o3].iter().enumerate() {
            let f = self.ssh[level].forward(feature);
            let [class, bbox, landmark] = &self.heads[level];
            let class = class.forward(&f, None, Activation::None);
            conf.extend(class.data.chunks_exact(2).map(|v| softmax2(v[0], v[1])));
            let bbox = bbox.forward(&f, None, Activation::None);
            loc.extend(bbox.data.chunks_exact(4).map(|v| [v[0], v[1], v[2], v[3]]));
            let lm = landmark.forward(&f, None, Activation::None);
            landms.extend(
                lm.data
                    .chunks_exact(10)
                    .map(|v| <[f32; 10]>::try_from(v).expect("ten values")),
            );
        }
        Ok(Raw { loc, conf, landms })
    }

    /// Faces in an RGB image: every prior scored above `threshold`, the `top_k` best of
    /// them (all: `None`), decoded, then non-maximum suppression at IoU `nms`, best first.
    pub fn detect(
        &self,
        rgb: &[u8],
        width: usize,
        height: usize,
        threshold: f32,
        top_k: Option<usize>,
        nms: f32,
    ) -> Result<Vec<Face>> {
        let raw = self.forward(rgb, width, height)?;
        Ok(decode(&raw, width, height, threshold, top_k, nms))
    }
}

/// facexlib's `PriorBox` for an image of `height × width`: `[cx, cy, w, h]` relative to it.
pub fn priors(height: usize, width: usize) -> Vec<[f32; 4]> {
    let mut out = Vec::new();
    for (k, &step) in STEPS.iter().enumerate() {
        let (fh, fw) = (height.div_ceil(step), width.div_ceil(step));
        for i in 0..fh {
            for j in 0..fw {
                for &size in &MIN_SIZES[k] {
                    let (w, h) = (width as f64, height as f64);
                    out.push([
                        ((j as f64 + 0.5) * step as f64 / w) as f32,
                        ((i as f64 + 0.5) * step as f64 / h) as f32,
                        (f64::from(size) / w) as f32,
                        (f64::from(size) / h) as f32,
                    ]);
                }
            }
        }
    }
    out
}

/// The raw outputs as faces (see [`RetinaFace::detect`]).
pub fn decode(
    raw: &Raw,
    width: usize,
    height: usize,
    threshold: f32,
    top_k: Option<usize>,
    nms: f32,
) -> Vec<Face> {
    let priors = priors(height, width);
    let (w, h) = (width as f32, height as f32);
    assert_eq!(priors.len(), raw.conf.len(), "one output row per prior");
    let mut order: Vec<usize> = (0..priors.len())
        .filter(|&i| raw.conf[i][1] > threshold)
        .collect();
    // Best first, as facexlib's `argsort()[::-1]` orders them: ascending by score (ties in
    // prior order), reversed, so equal scores come later prior first.
    order.sort_by(|&a, &b| raw.conf[a][1].total_cmp(&raw.conf[b][1]));
    order.reverse();
    if let Some(k) = top_k {
        order.truncate(k);
    }
    let faces: Vec<Face> = order
        .into_iter()
        .map(|i| {
            let (p, l, m) = (priors[i], raw.loc[i], raw.landms[i]);
            let cx = p[0] + l[0] * VARIANCE[0] * p[2];
            let cy = p[1] + l[1] * VARIANCE[0] * p[3];
            let bw = p[2] * (l[2] * VARIANCE[1]).exp();
            let bh = p[3] * (l[3] * VARIANCE[1]).exp();
            let (x1, y1) = (cx - bw / 2.0, cy - bh / 2.0);
            let bbox = [x1 * w, y1 * h, (x1 + bw) * w, (y1 + bh) * h];
            let mut landmarks = [0f32; 10];
            for k in 0..5 {
                landmarks[2 * k] = (p[0] + m[2 * k] * VARIANCE[0] * p[2]) * w;
                landmarks[2 * k + 1] = (p[1] + m[2 * k + 1] * VARIANCE[0] * p[3]) * h;
            }
            Face {
                bbox,
                score: raw.conf[i][1],
                landmarks,
            }
        })
        .collect();
    suppress(faces, nms)
}

/// Greedy non-maximum suppression of faces sorted best first: a face overlapping a kept one
/// by IoU above `threshold` is dropped (torchvision's `nms`).
fn suppress(faces: Vec<Face>, threshold: f32) -> Vec<Face> {
    let area = |b: &[f32; 4]| (b[2] - b[0]) * (b[3] - b[1]);
    let mut kept: Vec<Face> = Vec::new();
    for f in faces {
        let overlaps = kept.iter().any(|k| {
            let (a, b) = (&k.bbox, &f.bbox);
            let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
            let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
            let inter = iw * ih;
            inter / (area(a) + area(b) - inter) > threshold
        });
        if !overlaps {
            kept.push(f);
        }
    }
    kept
}

fn softmax2(a: f32, b: f32) -> [f32; 2] {
    let m = a.max(b);
    let (ea, eb) = ((a - m).exp(), (b - m).exp());
    [ea / (ea + eb), eb / (ea + eb)]
}

fn add(a: &Act, b: &Act) -> Act {
    assert_eq!((a.h, a.w, a.c), (b.h, b.w, b.c), "a sum of one shape");
    let mut out = a.clone();
    out.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x += y);
    out
}

/// PyTorch's `interpolate(mode="nearest")` to `h × w`: source index `floor(i · in / out)`,
/// the scale in f32.
fn nearest(x: &Act, h: usize, w: usize) -> Act {
    let c = x.c;
    let pick = |i: usize, from: usize, to: usize| {
        let scale = from as f32 / to as f32;
        ((i as f32 * scale).floor() as usize).min(from - 1)
    };
    let mut data = Vec::with_capacity(x.n * h * w * c);
    for b in 0..x.n {
        for y in 0..h {
            let sy = pick(y, x.h, h);
            for xx in 0..w {
                let sx = pick(xx, x.w, w);
                let at = ((b * x.h + sy) * x.w + sx) * c;
                data.extend_from_slice(&x.data[at..at + c]);
            }
        }
    }
    Act {
        n: x.n,
        h,
        w,
        c,
        data,
    }
}

/// ResNet's stem pooling: 3×3, stride 2, padding 1 (padding never wins).
fn max_pool_3x3_s2(x: &Act) -> Act {
    let c = x.c;
    let out = |side: usize| (side + 2 - 3) / 2 + 1;
    let (h, w) = (out(x.h), out(x.w));
    let mut data = vec![f32::NEG_INFINITY; x.n * h * w * c];
    for b in 0..x.n {
        for oy in 0..h {
            for ox in 0..w {
                let dst = ((b * h + oy) * w + ox) * c;
                for ky in 0..3 {
                    let iy = (oy * 2 + ky) as isize - 1;
                    if iy < 0 || iy >= x.h as isize {
                        continue;
                    }
                    for kx in 0..3 {
                        let ix = (ox * 2 + kx) as isize - 1;
                        if ix < 0 || ix >= x.w as isize {
                            continue;
                        }
                        let src = ((b * x.h + iy as usize) * x.w + ix as usize) * c;
                        for ch in 0..c {
                            data[dst + ch] = data[dst + ch].max(x.data[src + ch]);
                        }
                    }
                }
            }
        }
    }
    Act {
        n: x.n,
        h,
        w,
        c,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priors_follow_facexlibs_order_and_nms_keeps_the_best_of_overlaps() {
        // A 20x40 image: levels of 3x5, 2x3 and 1x2 positions, two sizes each.
        let p = priors(20, 40);
        assert_eq!(p.len(), 2 * (3 * 5 + 2 * 3 + 2));
        assert_eq!(p[0], [4.0 / 40.0, 4.0 / 20.0, 16.0 / 40.0, 16.0 / 20.0]);
        assert_eq!(p[1][2], 32.0 / 40.0);
        // The second position of the first row.
        assert_eq!(p[2][0], 12.0 / 40.0);
        let face = |x: f32, score: f32| Face {
            bbox: [x, 0.0, x + 10.0, 10.0],
            score,
            landmarks: [0.0; 10],
        };
        let kept = suppress(vec![face(0.0, 0.9), face(1.0, 0.8), face(20.0, 0.7)], 0.4);
        assert_eq!(kept.iter().map(|f| f.score).collect::<Vec<_>>(), [0.9, 0.7]);
    }
}
