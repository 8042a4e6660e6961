//! The planned forward pass (`--conv-epilogue own|auto`): the generator as a list of
//! operations on buffers, and where each buffer lives in one arena per instance.
//!
//! The operations are what the GPU runs, in order:
//! - [`Op::Input`]: the NCHW input (mel windows, faces) to NHWC, padded with zero channels
//!   (`--conv-input-pad 8`);
//! - [`Op::Conv`]: one cuDNN convolution (a layer's, or one of its upsampling form's) into a
//!   scratch buffer, or, for a layer cuDNN runs fused, straight into its output;
//! - [`Op::Epilogue`]: the own kernel (`src/model/kernels`): bias, residual, activation, the
//!   pixel shuffle, and the write into the layer's output or its channel slice of a skip
//!   concatenation, with the skip feature copied beside it; for the output layer the sigmoid
//!   and the NCHW output.
//!
//! No layout conversion happens inside the network. A residual layer's epilogue writes over
//! its input (its last reader), so a residual chain needs one buffer and a scratch.
//!
//! **Memory.** A buffer lives from the operation that first writes it to the last that reads
//! it ([`Graph::intervals`]); [`ArenaPlan::new`] gives each an offset, reusing memory once its
//! last reader has run (largest first, lowest free offset). Every size grows with the batch,
//! so the decisions below are the same at every batch size.
//!
//! **Skips.** A decoder block's last epilogue writes into its slice of the concatenation and
//! copies the skip feature beside it. That holds the layer's input, its scratch and the whole
//! concatenation at once; at 96×96 that is the peak. Where the planned peak would exceed
//! [`ARENA_BUDGET_PER_FRAME`] (1.5 GiB at batch 512 in f16, so that three instances, their
//! weights, workspace and the CUDA context fit 6 GB), the planner splits that concatenation
//! instead ([`Graph::split`]): no concatenation is made; the layer writes its output as it
//! would otherwise (over its input), and the next layer, whose convolution is linear in its
//! input channels, runs each of its convolutions twice: over the decoder's channels, then over
//! the skip's with their weights, adding to the first result (cuDNN's beta = 1). One
//! concatenation at a time, the one that lowers the peak most first.

use std::collections::{BTreeMap, BTreeSet};

use super::arch::{self, LayerKind, LayerSpec};
use super::cudnn::{ConvDims, InputPad};
use super::upsample::{self, UpForm};

/// Bytes per frame of f16 activations the plan may use: 1.5 GiB at batch 512.
pub const ARENA_BUDGET_PER_FRAME: usize = (3 << 30) / 2 / 512;

/// Every buffer starts at a multiple of this (cuDNN's and the kernels' 16-byte accesses, and
/// whole cache lines).
pub const ALIGN: usize = 256;

/// What the planned pass is built from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetOptions {
    pub input_pad: InputPad,
    /// The form of each upsampling layer, by path; layers not named take `default_form`.
    pub forms: BTreeMap<String, UpForm>,
    pub default_form: UpForm,
    /// Layers run by cuDNN's fused call (bias, residual and ReLU inside the convolution,
    /// written straight to their output). Only layers whose output is a whole buffer
    /// qualify ([`Graph::fusable`]); others named here run the own epilogue.
    pub fused: BTreeSet<String>,
}

impl NetOptions {
    pub fn new(input_pad: InputPad, default_form: UpForm) -> Self {
        NetOptions {
            input_pad,
            forms: BTreeMap::new(),
            default_form,
            fused: BTreeSet::new(),
        }
    }

    /// The form the upsampling layer at `path` runs.
    pub fn form(&self, path: &str) -> UpForm {
        self.forms.get(path).copied().unwrap_or(self.default_form)
    }
}

/// A layer of the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    pub path: String,
    pub spec: LayerSpec,
    /// Input channels as stored (padded for the first layers with `--conv-input-pad 8`).
    pub cin: usize,
    pub input_hw: (usize, usize),
    pub output_hw: (usize, usize),
    /// The upsampling form, for the five stride-2 transposed layers.
    pub form: Option<UpForm>,
    /// Run by cuDNN's fused call.
    pub fused: bool,
    /// Could be run by cuDNN's fused call ([`Graph::fusable`]).
    pub fusable: bool,
    /// The buffer it reads.
    pub input: usize,
    /// When it reads a split concatenation ([`Graph::split`]): the skip feature's buffer and
    /// channels, which follow the `cin - skip_c` channels of `input`.
    pub skip_input: Option<(usize, usize)>,
}

impl Layer {
    /// The layer's own convolution (cuDNN's backward-data for a transposed one).
    pub fn dims(&self) -> ConvDims {
        ConvDims::of(&self.spec).with_cin(self.cin)
    }

    /// The input channels each convolution of the layer reads in one go: all of them, or for
    /// a split concatenation the decoder's `(0, c)` and then the skip's `(c, skip_c)`.
    pub fn input_slices(&self) -> Vec<(usize, usize)> {
        match self.skip_input {
            Some((_, skip_c)) => vec![(0, self.cin - skip_c), (self.cin - skip_c, skip_c)],
            None => vec![(0, self.cin)],
        }
    }

    /// The convolutions the layer runs, in order: its own, or its form's.
    pub fn convs(&self) -> Vec<ConvDims> {
        match self.form {
            Some(f) if f != UpForm::Transposed => f
                .convs()
                .iter()
                .map(|c| ConvDims::of_form(c, &self.spec))
                .collect(),
            _ => vec![self.dims()],
        }
    }

    /// Whether the epilogue interleaves the phases of an upsampling form.
    pub fn shuffles(&self) -> bool {
        matches!(self.form, Some(f) if f != UpForm::Transposed)
    }

    /// The activation after the layer: ReLU, or nothing for the bare output convolution (the
    /// network's sigmoid follows it).
    pub fn relu(&self) -> bool {
        self.spec.kind != LayerKind::Plain
    }
}

/// One activation or scratch buffer: `h`×`w` pixels of `c` channels per frame, NHWC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buffer {
    pub name: String,
    pub h: usize,
    pub w: usize,
    pub c: usize,
}

impl Buffer {
    /// Values per frame.
    pub fn values(&self) -> usize {
        self.h * self.w * self.c
    }

    /// Bytes at batch `n` in a dtype of `elem` bytes, rounded up to [`ALIGN`].
    pub fn bytes(&self, n: usize, elem: usize) -> usize {
        (self.values() * n * elem).next_multiple_of(ALIGN)
    }
}

/// Which convolution of a layer an [`Op::Conv`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvPart {
    /// The layer's own (backward-data for a transposed layer).
    Layer,
    /// Convolution `i` of the layer's upsampling form ([`UpForm::convs`]).
    Form(usize),
}

/// The activation an epilogue applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    None,
    Relu,
    Sigmoid,
}

/// Where an epilogue writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// Buffer `buf`, the values from channel `offset` of its `c`: a whole buffer (offset 0,
    /// as many channels as the layer) or the layer's slice of a concatenation.
    Buffer { buf: usize, offset: usize },
    /// The network's output: NCHW, outside the arena.
    Output,
}

/// The own kernel after a layer's convolution(s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epilogue {
    /// The layer whose bias, activation and shuffle apply.
    pub layer: usize,
    /// The raw convolution outputs (one, or one per phase convolution of a form).
    pub srcs: Vec<usize>,
    /// Added before the activation (a residual layer's input).
    pub residual: Option<usize>,
    /// Copied beside the output, after its channels.
    pub skip: Option<usize>,
    pub dst: Dest,
    pub act: Act,
}

/// One step of the planned pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// The mel windows (`face: false`) or faces, NCHW, into buffer `dst`.
    Input {
        face: bool,
        dst: usize,
    },
    /// A convolution of `layer` reading `src` and writing `dst` (a scratch buffer, or the
    /// output for a fused layer, whose residual is `src`): over the input channels `slice`
    /// (first, count) of the layer's weights, `src` holding exactly those; with `accumulate`
    /// added to what `dst` holds (the second half of a split concatenation).
    Conv {
        layer: usize,
        part: ConvPart,
        src: usize,
        dst: usize,
        slice: (usize, usize),
        accumulate: bool,
    },
    Epilogue(Epilogue),
}

impl Op {
    /// Buffers read, then buffers written.
    pub fn uses(&self) -> (Vec<usize>, Vec<usize>) {
        match self {
            Op::Input { dst, .. } => (vec![], vec![*dst]),
            Op::Conv {
                src,
                dst,
                accumulate,
                ..
            } => {
                if *accumulate {
                    (vec![*src, *dst], vec![*dst])
                } else {
                    (vec![*src], vec![*dst])
                }
            }
            Op::Epilogue(e) => {
                let mut reads = e.srcs.clone();
                reads.extend(e.residual);
                reads.extend(e.skip);
                let writes = match e.dst {
                    Dest::Buffer { buf, .. } => vec![buf],
                    Dest::Output => vec![],
                };
                (reads, writes)
            }
        }
    }
}

/// The planned pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub layers: Vec<Layer>,
    pub buffers: Vec<Buffer>,
    pub ops: Vec<Op>,
    /// Decoder blocks whose concatenation is split: never made, its two parts read by the
    /// next layer's convolutions in turn (see the module's notes on skips).
    pub split: BTreeSet<usize>,
    /// The buffers holding the mel windows and the faces.
    pub inputs: (usize, usize),
}

/// Where a value lives while the graph is built.
#[derive(Debug, Clone, Copy)]
struct Value {
    buf: usize,
    h: usize,
    w: usize,
    /// All its channels (a split concatenation's: the buffer's and the skip's).
    c: usize,
    /// A split concatenation's second part: the skip feature's buffer and channels.
    skip: Option<(usize, usize)>,
}

/// Where a layer's output goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A buffer of its own (or, for a residual layer, over its input).
    New,
    /// Decoder block `block`'s concatenation with the skip feature `skip`.
    Concat { block: usize, skip: Value },
    /// The network's output.
    Output,
}

impl Graph {
    /// The pass for `opts`, with concatenations split where the budget needs it.
    pub fn new(opts: &NetOptions) -> Graph {
        let mut split = BTreeSet::new();
        let mut g = Graph::build(opts, &split);
        let budget = ARENA_BUDGET_PER_FRAME * 512;
        let mut peak = ArenaPlan::new(&g, 512, 2).bytes;
        while peak > budget {
            let best = (0..arch::FACE_DECODER_BLOCKS.len())
                .filter(|b| !split.contains(b))
                .map(|b| {
                    let mut c = split.clone();
                    c.insert(b);
                    let g = Graph::build(opts, &c);
                    (ArenaPlan::new(&g, 512, 2).bytes, b, g)
                })
                .min_by_key(|(bytes, b, _)| (*bytes, *b));
            match best {
                Some((bytes, b, better)) if bytes < peak => {
                    split.insert(b);
                    peak = bytes;
                    g = better;
                }
                _ => break,
            }
        }
        g
    }

    /// The pass with the concatenations of the decoder blocks in `split` split.
    pub fn build(opts: &NetOptions, split: &BTreeSet<usize>) -> Graph {
        let mut g = Graph {
            layers: Vec::new(),
            buffers: Vec::new(),
            ops: Vec::new(),
            split: split.clone(),
            inputs: (0, 0),
        };
        use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
        let mel = g.value("input mel", MEL_BINS, MEL_STEPS, opts.input_pad.channels(1));
        let face = g.value(
            "input face",
            FACE_SIZE,
            FACE_SIZE,
            opts.input_pad.channels(FACE_CHANNELS),
        );
        g.inputs = (mel.buf, face.buf);
        g.ops.push(Op::Input {
            face: false,
            dst: mel.buf,
        });
        g.ops.push(Op::Input {
            face: true,
            dst: face.buf,
        });

        let mut x = mel;
        for (i, spec) in arch::AUDIO_ENCODER.iter().enumerate() {
            x = g.layer(opts, &format!("audio_encoder.{i}"), spec, x, Target::New);
        }
        let audio = x;

        let mut feats = Vec::new();
        let mut x = face;
        for (b, block) in arch::FACE_ENCODER_BLOCKS.iter().enumerate() {
            for (l, spec) in block.iter().enumerate() {
                x = g.layer(
                    opts,
                    &format!("face_encoder_blocks.{b}.{l}"),
                    spec,
                    x,
                    Target::New,
                );
            }
            feats.push(x);
        }

        let mut x = audio;
        for (b, block) in arch::FACE_DECODER_BLOCKS.iter().enumerate() {
            for (l, spec) in block.iter().enumerate() {
                let target = if l + 1 == block.len() {
                    let skip = feats.pop().expect("the decoder is as deep as the encoder");
                    Target::Concat { block: b, skip }
                } else {
                    Target::New
                };
                x = g.layer(
                    opts,
                    &format!("face_decoder_blocks.{b}.{l}"),
                    spec,
                    x,
                    target,
                );
            }
        }
        let x = g.layer(
            opts,
            "output_block.0",
            &arch::OUTPUT_BLOCK[0],
            x,
            Target::New,
        );
        g.layer(
            opts,
            "output_block.1",
            &arch::OUTPUT_BLOCK[1],
            x,
            Target::Output,
        );
        g
    }

    fn value(&mut self, name: &str, h: usize, w: usize, c: usize) -> Value {
        self.buffers.push(Buffer {
            name: name.to_string(),
            h,
            w,
            c,
        });
        Value {
            buf: self.buffers.len() - 1,
            h,
            w,
            c,
            skip: None,
        }
    }

    /// Whether a layer with this spec and target can run cuDNN's fused call: its output is a
    /// whole buffer of its own and needs no shuffle.
    pub fn fusable(spec: &LayerSpec, concat: bool, output: bool) -> bool {
        spec.kind == LayerKind::Conv && !upsample::applies(spec) && !concat && !output
    }

    /// Adds a layer reading `x`; returns its output.
    fn layer(
        &mut self,
        opts: &NetOptions,
        path: &str,
        spec: &LayerSpec,
        x: Value,
        target: Target,
    ) -> Value {
        let form = upsample::applies(spec).then(|| opts.form(path));
        let fusable = Graph::fusable(
            spec,
            matches!(target, Target::Concat { .. }),
            matches!(target, Target::Output),
        );
        // A split input is summed over two convolutions: bias and ReLU come after both.
        let fusable = fusable && x.skip.is_none();
        let fused = fusable && opts.fused.contains(path);
        let layer = Layer {
            path: path.to_string(),
            spec: *spec,
            cin: x.c,
            input_hw: (x.h, x.w),
            output_hw: ConvDims::of(spec).output(x.h, x.w),
            form,
            fused,
            fusable,
            input: x.buf,
            skip_input: x.skip,
        };
        let (oh, ow) = layer.output_hw;
        let convs = layer.convs();
        let slices = layer.input_slices();
        let relu = layer.relu();
        let shuffles = layer.shuffles();
        self.layers.push(layer);
        let li = self.layers.len() - 1;
        let cout = spec.cout;

        if fused {
            let y = self.value(path, oh, ow, cout);
            self.ops.push(Op::Conv {
                layer: li,
                part: ConvPart::Layer,
                src: x.buf,
                dst: y.buf,
                slice: (0, x.c),
                accumulate: false,
            });
            return y;
        }
        // The convolution(s) into scratch buffers.
        let mut srcs = Vec::new();
        for (i, d) in convs.iter().enumerate() {
            let (zh, zw) = d.output(x.h, x.w);
            let name = if shuffles {
                format!("{path} scratch {i}")
            } else {
                format!("{path} scratch")
            };
            let z = self.value(&name, zh, zw, d.cout);
            let part = if shuffles {
                ConvPart::Form(i)
            } else {
                ConvPart::Layer
            };
            // Over the input's channels, or a split concatenation's two parts in turn.
            for (k, &slice) in slices.iter().enumerate() {
                let src = match (k, x.skip) {
                    (1, Some((skip, _))) => skip,
                    _ => x.buf,
                };
                self.ops.push(Op::Conv {
                    layer: li,
                    part,
                    src,
                    dst: z.buf,
                    slice,
                    accumulate: k > 0,
                });
            }
            srcs.push(z.buf);
        }
        let residual = spec.residual.then_some(x.buf);
        let act = if relu { Act::Relu } else { Act::None };
        match target {
            Target::Output => {
                self.ops.push(Op::Epilogue(Epilogue {
                    layer: li,
                    srcs,
                    residual,
                    skip: None,
                    dst: Dest::Output,
                    act: Act::Sigmoid,
                }));
                Value {
                    buf: usize::MAX,
                    h: oh,
                    w: ow,
                    c: cout,
                    skip: None,
                }
            }
            Target::New | Target::Concat { .. } => {
                let concat = match target {
                    Target::Concat { block, skip } => Some((block, skip)),
                    _ => None,
                };
                let direct = concat.filter(|(b, _)| !self.split.contains(b));
                if let Some((block, skip)) = direct {
                    let c = self.value(
                        &format!("face_decoder_blocks.{block} concatenation"),
                        oh,
                        ow,
                        cout + skip.c,
                    );
                    self.ops.push(Op::Epilogue(Epilogue {
                        layer: li,
                        srcs,
                        residual,
                        skip: Some(skip.buf),
                        dst: Dest::Buffer {
                            buf: c.buf,
                            offset: 0,
                        },
                        act,
                    }));
                    return c;
                }
                // A residual layer writes over its input: the previous layer's output in its
                // block, which nothing reads after it.
                let y = match residual {
                    Some(_) => Value { skip: None, ..x },
                    None => self.value(path, oh, ow, cout),
                };
                self.ops.push(Op::Epilogue(Epilogue {
                    layer: li,
                    srcs,
                    residual,
                    skip: None,
                    dst: Dest::Buffer {
                        buf: y.buf,
                        offset: 0,
                    },
                    act,
                }));
                match concat {
                    // Split: the output and the skip feature, read in turn by the next layer.
                    Some((_, skip)) => Value {
                        c: cout + skip.c,
                        skip: Some((skip.buf, skip.c)),
                        ..y
                    },
                    None => y,
                }
            }
        }
    }

    /// Each buffer's first and last operation (inclusive).
    pub fn intervals(&self) -> Vec<(usize, usize)> {
        let mut iv = vec![(usize::MAX, 0); self.buffers.len()];
        for (k, op) in self.ops.iter().enumerate() {
            let (reads, writes) = op.uses();
            for b in reads.into_iter().chain(writes) {
                iv[b].0 = iv[b].0.min(k);
                iv[b].1 = iv[b].1.max(k);
            }
        }
        iv
    }

    /// The most values per frame live at once (at any one operation).
    pub fn live_peak(&self) -> usize {
        let iv = self.intervals();
        (0..self.ops.len())
            .map(|k| {
                iv.iter()
                    .zip(&self.buffers)
                    .filter(|((a, b), _)| *a <= k && k <= *b)
                    .map(|(_, buf)| buf.values())
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// The layer at `path`.
    pub fn layer_index(&self, path: &str) -> Option<usize> {
        self.layers.iter().position(|l| l.path == path)
    }

    /// The epilogue of the layer at `path` (none for a layer cuDNN runs fused).
    pub fn epilogue_of(&self, path: &str) -> Option<&Epilogue> {
        let layer = self.layer_index(path)?;
        self.ops.iter().find_map(|op| match op {
            Op::Epilogue(e) if e.layer == layer => Some(e),
            _ => None,
        })
    }

    /// Per layer, the operations that run it (its convolutions and its epilogue), in order:
    /// what a profile times.
    pub fn layer_ops(&self) -> Vec<(usize, Vec<usize>)> {
        let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
        for (k, op) in self.ops.iter().enumerate() {
            let layer = match op {
                Op::Input { .. } => continue,
                Op::Conv { layer, .. } => *layer,
                Op::Epilogue(e) => e.layer,
            };
            match out.last_mut() {
                Some((last, ops)) if *last == layer => ops.push(k),
                _ => out.push((layer, vec![k])),
            }
        }
        out
    }
}

/// Where each buffer of a [`Graph`] lives at batch `n` in a dtype of `elem` bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct ArenaPlan {
    pub n: usize,
    pub elem: usize,
    /// Byte offset of each buffer.
    pub offsets: Vec<usize>,
    /// Byte size of each buffer ([`Buffer::bytes`]).
    pub sizes: Vec<usize>,
    /// The arena's size: the planned peak.
    pub bytes: usize,
}

impl ArenaPlan {
    /// Places every buffer at an offset where it overlaps no buffer whose lifetime overlaps
    /// its own, trying a few orders (largest first; longest-lived first; first written
    /// first) and in each the smallest free gap that holds the buffer; keeps the smallest
    /// arena.
    pub fn new(g: &Graph, n: usize, elem: usize) -> ArenaPlan {
        let iv = g.intervals();
        let sizes: Vec<usize> = g.buffers.iter().map(|b| b.bytes(n, elem)).collect();
        use std::cmp::Reverse;
        type Key = (Reverse<usize>, usize, usize);
        let orders: [&dyn Fn(usize) -> Key; 3] = [
            &|b| (Reverse(sizes[b]), iv[b].0, b),
            &|b| (Reverse(iv[b].1 - iv[b].0), usize::MAX - sizes[b], b),
            &|b| (Reverse(usize::MAX - iv[b].0), usize::MAX - sizes[b], b),
        ];
        orders
            .iter()
            .map(|key| {
                let mut order: Vec<usize> = (0..g.buffers.len()).collect();
                order.sort_by_key(|&b| key(b));
                let (offsets, bytes) = place(&order, &sizes, &iv);
                ArenaPlan {
                    n,
                    elem,
                    offsets,
                    sizes: sizes.clone(),
                    bytes,
                }
            })
            .min_by_key(|p| p.bytes)
            .expect("three orders")
    }

    /// Checks the plan: every buffer inside the arena and aligned, and no two buffers that
    /// are live at the same operation overlapping in memory.
    pub fn check(&self, g: &Graph) -> Result<(), String> {
        let iv = g.intervals();
        for (b, (&o, &s)) in self.offsets.iter().zip(&self.sizes).enumerate() {
            if o % ALIGN != 0 || o + s > self.bytes {
                return Err(format!(
                    "{} at {o} ({s} bytes) is not aligned or outside the arena of {}",
                    g.buffers[b].name, self.bytes
                ));
            }
        }
        for a in 0..iv.len() {
            for b in a + 1..iv.len() {
                let live_together = iv[a].0 <= iv[b].1 && iv[b].0 <= iv[a].1;
                let (oa, sa, ob, sb) = (
                    self.offsets[a],
                    self.sizes[a],
                    self.offsets[b],
                    self.sizes[b],
                );
                if live_together && oa < ob + sb && ob < oa + sa {
                    return Err(format!(
                        "{} and {} are live together and overlap",
                        g.buffers[a].name, g.buffers[b].name
                    ));
                }
            }
        }
        Ok(())
    }

    /// The device address of buffer `b` in an arena at `base`.
    pub fn address(&self, base: u64, b: usize) -> u64 {
        base + self.offsets[b] as u64
    }
}

/// Buffers placed in `order`, each in the smallest gap (between buffers live at the same time,
/// or above them all) that holds it: the offsets and the arena's size.
fn place(order: &[usize], sizes: &[usize], iv: &[(usize, usize)]) -> (Vec<usize>, usize) {
    let mut offsets = vec![0usize; sizes.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for &b in order {
        let mut around: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&p| iv[p].0 <= iv[b].1 && iv[b].0 <= iv[p].1)
            .map(|&p| (offsets[p], offsets[p] + sizes[p]))
            .collect();
        around.sort_unstable();
        // Free gaps between the live buffers, then the space above them.
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut at = 0;
        for (start, end) in around {
            if start >= at + sizes[b] {
                let gap = start - at;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, at));
                }
            }
            at = at.max(end);
        }
        let offset = best.map_or(at, |(_, o)| o);
        offsets[b] = offset;
        bytes = bytes.max(offset + sizes[b]);
        placed.push(b);
    }
    (offsets, bytes)
}

/// The planned peak per batch size, in bytes (`lipsync bench --sections memory`).
pub fn planned_bytes(opts: &NetOptions, n: usize, elem: usize) -> usize {
    ArenaPlan::new(&Graph::new(opts), n, elem).bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pad: InputPad, form: UpForm) -> NetOptions {
        NetOptions::new(pad, form)
    }

    #[test]
    fn every_layer_runs_once_in_forward_order_with_its_shapes() {
        let g = Graph::new(&options(InputPad::Eight, UpForm::Phases));
        let paths: Vec<&str> = g.layers.iter().map(|l| l.path.as_str()).collect();
        let mut want: Vec<String> = arch::layers().into_iter().map(|l| l.0).collect();
        // The pass runs the audio encoder first.
        want.sort_by_key(|p| !p.starts_with("audio_encoder"));
        assert_eq!(paths, want);
        let first = &g.layers[g.layer_index("face_encoder_blocks.0.0").unwrap()];
        assert_eq!((first.cin, first.input_hw), (8, (96, 96)));
        let mel = &g.layers[g.layer_index("audio_encoder.0").unwrap()];
        assert_eq!((mel.cin, mel.input_hw), (8, (80, 16)));
        let up = &g.layers[g.layer_index("face_decoder_blocks.6.0").unwrap()];
        assert_eq!((up.input_hw, up.output_hw), ((48, 48), (96, 96)));
        assert_eq!(up.form, Some(UpForm::Phases));
        assert_eq!(up.convs().len(), 4);
        let out = g.layers.last().unwrap();
        assert_eq!(
            (out.path.as_str(), out.output_hw),
            ("output_block.1", (96, 96))
        );
        // Every buffer is written before it is read.
        let mut written = vec![false; g.buffers.len()];
        for op in &g.ops {
            let (reads, writes) = op.uses();
            for r in reads {
                assert!(written[r], "{} read before written", g.buffers[r].name);
            }
            for w in writes {
                written[w] = true;
            }
        }
        let unpadded = Graph::new(&options(InputPad::None, UpForm::Subpixel));
        let first = &unpadded.layers[0];
        assert_eq!((first.path.as_str(), first.cin), ("audio_encoder.0", 1));
    }

    #[test]
    fn the_plan_is_valid_and_within_budget_at_512_in_f16_for_every_form() {
        for form in UpForm::ALL {
            for pad in [InputPad::Eight, InputPad::None] {
                let g = Graph::new(&options(pad, form));
                for n in [1, 3, 64, 512] {
                    for elem in [2, 4] {
                        let plan = ArenaPlan::new(&g, n, elem);
                        plan.check(&g)
                            .unwrap_or_else(|e| panic!("{form:?} {n}: {e}"));
                        // Never less than what is live at once.
                        assert!(plan.bytes >= g.live_peak() * n * elem);
                    }
                }
                let bytes = ArenaPlan::new(&g, 512, 2).bytes;
                assert!(
                    bytes <= 3 << 29,
                    "{form:?} {pad:?}: {bytes} bytes planned at 512 in f16"
                );
            }
        }
    }

    #[test]
    fn skips_are_split_only_where_the_budget_needs_it() {
        let opts = options(InputPad::Eight, UpForm::Subpixel);
        let direct = Graph::build(&opts, &BTreeSet::new());
        let direct_bytes = ArenaPlan::new(&direct, 512, 2).bytes;
        let g = Graph::new(&opts);
        let bytes = ArenaPlan::new(&g, 512, 2).bytes;
        // Written directly, the 96×96 concatenation passes the budget; split (it goes first,
        // the largest), the plan fits, and nothing else needs splitting.
        assert!(
            direct_bytes > ARENA_BUDGET_PER_FRAME * 512,
            "{direct_bytes}"
        );
        assert_eq!(g.split, BTreeSet::from([6]));
        assert!(bytes < direct_bytes && bytes <= ARENA_BUDGET_PER_FRAME * 512);
        // A split concatenation is never made: its reader runs each convolution over the
        // decoder's channels, then over the skip's, adding to the first.
        for &b in &g.split {
            assert!(!g
                .buffers
                .iter()
                .any(|x| x.name == format!("face_decoder_blocks.{b} concatenation")));
        }
        let reader = g.layer_index("output_block.0").unwrap();
        let l = &g.layers[reader];
        assert_eq!(l.input_slices(), [(0, 64), (64, 16)]);
        let convs: Vec<(usize, bool)> = g
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Conv {
                    layer,
                    src,
                    accumulate,
                    ..
                } if *layer == reader => Some((*src, *accumulate)),
                _ => None,
            })
            .collect();
        assert_eq!(convs, [(l.input, false), (l.skip_input.unwrap().0, true)]);
        // The split reader is never fused (bias and ReLU follow the sum).
        let mut fused = opts.clone();
        fused.fused.insert("output_block.0".into());
        let f = Graph::build(&fused, &BTreeSet::from([6]));
        assert!(!f.layers[f.layer_index("output_block.0").unwrap()].fused);
    }

    #[test]
    fn residual_layers_write_over_their_input_and_fused_layers_need_no_scratch() {
        let mut opts = options(InputPad::Eight, UpForm::Transposed);
        let g = Graph::new(&opts);
        let res = g.layer_index("face_encoder_blocks.1.1").unwrap();
        let e = g.epilogue_of("face_encoder_blocks.1.1").unwrap();
        assert_eq!(
            e.dst,
            Dest::Buffer {
                buf: e.residual.unwrap(),
                offset: 0
            }
        );
        let scratch = g.buffers.len();
        opts.fused.insert("face_encoder_blocks.1.1".into());
        // Not fusable: a concatenation's writer and the output.
        opts.fused.insert("face_decoder_blocks.6.2".into());
        opts.fused.insert("output_block.1".into());
        let f = Graph::new(&opts);
        assert_eq!(
            f.buffers.len(),
            scratch,
            "the fused layer's output replaces its scratch"
        );
        assert!(f.layers[res].fused);
        assert!(!f.layers[f.layer_index("face_decoder_blocks.6.2").unwrap()].fused);
        assert!(!f.layers[f.layer_index("output_block.1").unwrap()].fused);
        let ops: Vec<&Op> = f
            .ops
            .iter()
            .filter(|op| match op {
                Op::Conv { layer, .. } => *layer == res,
                Op::Epilogue(e) => e.layer == res,
                _ => false,
            })
            .collect();
        assert_eq!(ops.len(), 1, "one fused convolution, no epilogue");
        for n in [1, 512] {
            ArenaPlan::new(&f, n, 2).check(&f).unwrap();
        }
    }

    #[test]
    fn skip_features_are_written_once_and_read_by_their_concatenation() {
        // The encoder blocks' outputs are read again by the decoder: no in-place epilogue
        // (a residual layer writing over its input) may write over one after it is made.
        for split in [BTreeSet::new(), BTreeSet::from([2, 6])] {
            let g = Graph::build(&options(InputPad::Eight, UpForm::Phases), &split);
            // Each block's output: its buffer, and the operation that finishes it (the last
            // layer's epilogue, or its fused convolution).
            let feats: Vec<(usize, usize)> = arch::FACE_ENCODER_BLOCKS
                .iter()
                .enumerate()
                .map(|(b, block)| {
                    let last = format!("face_encoder_blocks.{b}.{}", block.len() - 1);
                    let li = g.layer_index(&last).unwrap();
                    g.ops
                        .iter()
                        .enumerate()
                        .rev()
                        .find_map(|(k, op)| match op {
                            Op::Epilogue(e) if e.layer == li => match e.dst {
                                Dest::Buffer { buf, .. } => Some((buf, k)),
                                Dest::Output => None,
                            },
                            Op::Conv { layer, dst, .. } if *layer == li && g.layers[li].fused => {
                                Some((*dst, k))
                            }
                            _ => None,
                        })
                        .unwrap()
                })
                .collect();
            for (i, &(f, made)) in feats.iter().enumerate() {
                let later = |pick: fn(&Op) -> Vec<usize>| -> usize {
                    g.ops[made + 1..]
                        .iter()
                        .filter(|op| pick(op).contains(&f))
                        .count()
                };
                assert_eq!(
                    later(|op| op.uses().1),
                    0,
                    "block {i}'s feature written again after it is made ({split:?})"
                );
                // Read by the next block's first layer and by the decoder.
                let reads = later(|op| op.uses().0);
                assert!(
                    reads >= 2 || i == feats.len() - 1,
                    "block {i}: {reads} reads"
                );
                assert!(reads >= 1, "block {i}: never read");
            }
        }
    }

    #[test]
    fn a_plan_that_overlaps_live_buffers_is_refused() {
        let g = Graph::new(&options(InputPad::Eight, UpForm::Subpixel));
        let mut plan = ArenaPlan::new(&g, 4, 2);
        let (mel, face) = g.inputs;
        // Both inputs are live together (the face is written before the mel is read).
        plan.offsets[face] = plan.offsets[mel];
        assert!(plan.check(&g).unwrap_err().contains("overlap"));
        let mut plan = ArenaPlan::new(&g, 4, 2);
        plan.offsets[0] += 2;
        assert!(plan.check(&g).is_err());
    }

    #[test]
    fn layer_ops_cover_every_convolution_and_epilogue_once() {
        let g = Graph::new(&options(InputPad::Eight, UpForm::Phases));
        let groups = g.layer_ops();
        assert_eq!(groups.len(), g.layers.len());
        let covered: usize = groups.iter().map(|(_, ops)| ops.len()).sum();
        assert_eq!(covered, g.ops.len() - 2, "all but the two inputs");
    }
}
