//! The planned pass on the GPU (`--conv-epilogue own|auto`, NHWC): the graph of
//! [`crate::model::netplan`] run by [`crate::model::netexec`] with cuDNN's convolutions and
//! lipsync's own kernels (`src/model/kernels`), every activation at its planned offset in
//! one arena per instance (`--conv-arena on`) or allocated one by one (`off`).
//!
//! During warm-up (the engine still searching), the first pass at a batch size also times,
//! on each layer's real input, what `auto` leaves open: every upsampling form of each
//! stride-2 layer (its convolutions and its epilogue into a buffer of its own), and with
//! `--conv-epilogue auto` cuDNN's fused call against the convolution and the own epilogue.
//! The choices go to the process's autotune store (and its cache file); later passes build
//! their graph from them. A fused call cuDNN refuses is finished by the own epilogue and not
//! fused again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CustomOp2, DType, Layout, Shape, Tensor};
use half::{bf16, f16};

use super::engine::{lift, CudnnEngine, Mode, FUSE_TIMING_RUNS};
use super::plan::{FuseTiming, PlanKey};
use super::Epilogue;
use crate::model::arch;
use crate::model::kernels::{self, LsEpilogue, LsInput, LsMaxAbs, ACT_NONE, ACT_RELU};
use crate::model::netexec::{self, Addresses, Backend};
use crate::model::netplan::{ArenaPlan, ConvPart, Graph, Layer, NetOptions, ALIGN};
use crate::model::upsample::UpForm;
use crate::model::wav2lip::{ConvBlock, LayerProfile, LayerTime, Wav2Lip};
use crate::model::{Error, Result};

/// Threads per block of the own kernels (grid-stride loops).
const THREADS: u32 = 256;
/// The most blocks one launch uses (enough to fill an H200 many times over).
const MAX_BLOCKS: u64 = 16384;

/// The kernels of one dtype.
struct Kernels {
    epilogue_v1: CudaFunction,
    epilogue_wide: CudaFunction,
    input: CudaFunction,
    max_abs: CudaFunction,
    /// Channels per work item of `epilogue_wide` (16 bytes).
    wide: i32,
}

/// The planned pass of one model instance.
pub struct PlannedNet {
    engine: Arc<CudnnEngine>,
    kernels: Kernels,
    /// The graph with the default choices: the layers' shapes.
    base: Graph,
    state: Mutex<State>,
}

impl std::fmt::Debug for PlannedNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannedNet")
            .field("settings", self.engine.settings())
            .finish()
    }
}

#[derive(Default)]
struct State {
    graphs: HashMap<NetOptions, Arc<Graph>>,
    /// After warm-up, the graph each batch size runs (its choices no longer change but for
    /// a refused fused call, which clears this).
    settled: HashMap<usize, Arc<Graph>>,
    /// `--conv-arena on`: grown to the largest plan run.
    arena: Option<CudaSlice<u8>>,
    /// Layers whose fused call cuDNN refused.
    refused: HashSet<String>,
    /// Layers whose choices could not be timed for lack of memory (not tried again).
    untimed: HashSet<String>,
}

/// What one planned pass did, for the caller.
pub struct PassOutput {
    pub faces: Tensor,
    /// The checked layers' largest |values|, in the order asked (f32 on the device).
    pub maxima: Option<Tensor>,
    pub profile: Option<LayerProfile>,
}

impl PlannedNet {
    /// The planned pass over `engine` (its settings: input padding, upsampling, epilogue,
    /// arena).
    pub fn new(engine: Arc<CudnnEngine>) -> Result<Self> {
        let dev = engine.device().clone();
        let (name, wide) = match engine.dtype() {
            DType::F16 => ("f16", 8),
            DType::BF16 => ("bf16", 8),
            DType::F32 => ("f32", 4),
            other => return Err(Error::Device(format!("no own kernels for {other:?}"))),
        };
        let load = |function: String| -> Result<CudaFunction> {
            Ok(dev
                .get_or_load_custom_func(&function, "lipsync_kernels", kernels::PTX)?
                .into_cuda_function())
        };
        let kernels = Kernels {
            epilogue_v1: load(format!("lipsync_epilogue_{name}_v1"))?,
            epilogue_wide: load(format!("lipsync_epilogue_{name}_wide"))?,
            input: load(format!("lipsync_input_{name}"))?,
            max_abs: load(format!("lipsync_max_abs_{name}"))?,
            wide,
        };
        let settings = engine.settings();
        let base = Graph::new(&NetOptions::new(
            settings.input_pad,
            settings
                .upsampling
                .form()
                .unwrap_or(CudnnEngine::FALLBACK_FORM),
        ));
        Ok(PlannedNet {
            engine,
            kernels,
            base,
            state: Mutex::new(State::default()),
        })
    }

    pub fn engine(&self) -> &Arc<CudnnEngine> {
        &self.engine
    }

    /// Ends the warm-up: the arena is freed, so the next pass allocates what the final
    /// choices need, not what the warm-up's first passes did.
    pub fn finish_warm_up(&self) {
        self.state.lock().unwrap().arena = None;
    }

    /// The logical input shape of `layer` at batch `n`.
    fn input_shape(layer: &Layer, n: usize) -> [usize; 4] {
        [n, layer.cin, layer.input_hw.0, layer.input_hw.1]
    }

    /// The choices known now for batch `n`, and whether any is still to be timed.
    fn options(&self, model: &Wav2Lip, n: usize) -> Result<(NetOptions, bool)> {
        let settings = self.engine.settings();
        let mut opts = NetOptions::new(
            settings.input_pad,
            settings
                .upsampling
                .form()
                .unwrap_or(CudnnEngine::FALLBACK_FORM),
        );
        let mut pending = false;
        let refused = self.state.lock().unwrap().refused.clone();
        for layer in &self.base.layers {
            let block = model_block(model, &layer.path)?;
            let input = Self::input_shape(layer, n);
            if layer.form.is_some() {
                match self.engine.known_form(block, input, true) {
                    Some(f) => {
                        opts.forms.insert(layer.path.clone(), f);
                    }
                    None => pending = true,
                }
            }
            if settings.epilogue == Epilogue::Auto
                && layer.fusable
                && !refused.contains(&layer.path)
            {
                let block = self.engine.padded_block(block, layer.cin)?;
                match self.engine.own_fusion(&block, input) {
                    Some(t) if t.fused_ms < t.unfused_ms => {
                        opts.fused.insert(layer.path.clone());
                    }
                    Some(_) => {}
                    None => pending = true,
                }
            }
        }
        Ok((opts, pending && self.engine.searching()))
    }

    /// The graph for `opts` (built once).
    fn graph(&self, opts: &NetOptions) -> Arc<Graph> {
        let mut state = self.state.lock().unwrap();
        state
            .graphs
            .entry(opts.clone())
            .or_insert_with(|| Arc::new(Graph::new(opts)))
            .clone()
    }

    /// The graph batch `n` runs now (for reports and the memory estimate).
    pub fn graph_for(&self, model: &Wav2Lip, n: usize) -> Result<Arc<Graph>> {
        Ok(self.graph_at(model, n)?.0)
    }

    /// The graph batch `n` runs now and whether choices are still to be timed in this pass:
    /// after warm-up, looked up once per batch size instead of gathered from the autotune
    /// store before every batch.
    fn graph_at(&self, model: &Wav2Lip, n: usize) -> Result<(Arc<Graph>, bool)> {
        let settled = !self.engine.searching();
        if settled {
            if let Some(g) = self.state.lock().unwrap().settled.get(&n) {
                return Ok((g.clone(), false));
            }
        }
        let (opts, pending) = self.options(model, n)?;
        let graph = self.graph(&opts);
        if settled {
            self.state.lock().unwrap().settled.insert(n, graph.clone());
        }
        Ok((graph, pending))
    }

    /// One planned pass: the faces (NCHW, in the model's dtype), the largest |value| of each
    /// layer in `checked` (in forward order of the graph), and with `profile` each layer's
    /// time (CUDA events).
    pub fn forward(
        &self,
        model: &Wav2Lip,
        mel: &Tensor,
        face: &Tensor,
        checked: &HashSet<String>,
        profile: bool,
    ) -> Result<PassOutput> {
        let dev = model.device();
        let dtype = self.engine.dtype();
        let prep =
            |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(dev)?.to_dtype(dtype)?.contiguous()?) };
        let (mel, face) = (prep(mel)?, prep(face)?);
        let n = mel.dim(0)?;
        let (graph, pending) = self.graph_at(model, n)?;
        let checked_layers: Vec<usize> = graph
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| checked.contains(&l.path))
            .map(|(i, _)| i)
            .collect();
        let maxima = if checked_layers.is_empty() {
            None
        } else {
            Some(Tensor::zeros(checked_layers.len(), DType::F32, dev)?)
        };
        let op = PassOp {
            net: self,
            model,
            graph: &graph,
            n,
            pending,
            checked: &checked_layers,
            maxima: maxima.as_ref(),
            profile: std::cell::RefCell::new(profile.then(Vec::new)),
        };
        let faces = mel.apply_op2_no_bwd(&face, &op).map_err(lift)?;
        let profile = match op.profile.into_inner() {
            Some(marks) => Some(profile_of(&graph, n, marks)?),
            None => None,
        };
        Ok(PassOutput {
            faces,
            maxima,
            profile,
        })
    }

    fn launch<A: DeviceRepr>(
        &self,
        f: &CudaFunction,
        args: &A,
        items: Option<u64>,
        work: u64,
    ) -> candle_core::Result<()> {
        if work == 0 {
            return Ok(());
        }
        let blocks = work.div_ceil(u64::from(THREADS)).min(MAX_BLOCKS) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.engine.stream();
        let count = items.map(|i| i as i64);
        let mut b = stream.launch_builder(f);
        b.arg(args);
        if let Some(c) = &count {
            b.arg(c);
        }
        // SAFETY: the arguments match the kernel's signature (kernels.cu) and every address
        // in them points at a live buffer of the size the arguments describe.
        unsafe { b.launch(cfg) }.map_err(candle_core::Error::from)?;
        Ok(())
    }

    fn epilogue(&self, a: &LsEpilogue) -> candle_core::Result<()> {
        let f = if a.vec == 1 {
            &self.kernels.epilogue_v1
        } else {
            &self.kernels.epilogue_wide
        };
        let items = a.items();
        self.launch(f, a, Some(items), items)
    }
}

/// The model's layer at `path`.
fn model_block<'a>(model: &'a Wav2Lip, path: &str) -> Result<&'a ConvBlock> {
    model
        .layer(path)
        .ok_or_else(|| Error::BadInput(format!("the model has no layer {path}")))
}

/// A model error as a candle error (inside candle's custom operation).
fn lower(e: Error) -> candle_core::Error {
    match e {
        Error::Candle(e) => e,
        Error::Cudnn(c) => c.into(),
        other => candle_core::Error::Msg(other.to_string()),
    }
}

/// Per layer its start and end events; the pass's first and last.
type Marks = Vec<(Option<usize>, CudaEvent)>;

fn profile_of(graph: &Graph, n: usize, marks: Marks) -> Result<LayerProfile> {
    let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f32> {
        Ok(a.elapsed_ms(b).map_err(candle_core::Error::from)?)
    };
    let (Some(first), Some(last)) = (marks.first(), marks.last()) else {
        return Err(Error::BadInput("no profile marks".into()));
    };
    let total_ms = ms(&first.1, &last.1)?;
    let mut layers = Vec::new();
    let mut open: Option<(usize, &CudaEvent)> = None;
    for (layer, event) in &marks {
        let Some(l) = layer else { continue };
        match open.take() {
            Some((o, start)) if o == *l => {
                let layer = &graph.layers[o];
                layers.push(LayerTime {
                    path: layer.path.clone(),
                    input: [n, layer.cin, layer.input_hw.0, layer.input_hw.1],
                    ms: ms(start, event)?,
                });
            }
            _ => open = Some((*l, event)),
        }
    }
    Ok(LayerProfile { layers, total_ms })
}

/// The whole pass as one candle operation on (mel, faces): candle allocates nothing but the
/// output; everything else is the arena's.
struct PassOp<'a> {
    net: &'a PlannedNet,
    model: &'a Wav2Lip,
    graph: &'a Graph,
    n: usize,
    /// Choices still to be timed in this pass.
    pending: bool,
    /// The checked layers, in the order of the maxima.
    checked: &'a [usize],
    maxima: Option<&'a Tensor>,
    profile: std::cell::RefCell<Option<Marks>>,
}

impl CustomOp2 for PassOp<'_> {
    fn name(&self) -> &'static str {
        "lipsync-planned-pass"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the planned pass runs on CUDA tensors only")
    }

    fn cuda_fwd(
        &self,
        mel: &CudaStorage,
        mel_l: &Layout,
        face: &CudaStorage,
        face_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.net.engine.dtype() {
            DType::F16 => self.run::<f16>(mel, mel_l, face, face_l),
            DType::BF16 => self.run::<bf16>(mel, mel_l, face, face_l),
            DType::F32 => self.run::<f32>(mel, mel_l, face, face_l),
            other => candle_core::bail!("no planned pass for {other:?}"),
        }
    }
}

impl PassOp<'_> {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        mel: &CudaStorage,
        mel_l: &Layout,
        face: &CudaStorage,
        face_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let net = self.net;
        let engine = &net.engine;
        let stream = engine.stream().clone();
        let (g, n) = (self.graph, self.n);
        let elem = std::mem::size_of::<T>();
        let at = |s: &CudaStorage, l: &Layout| -> candle_core::Result<u64> {
            let (ptr, _) = s.as_cuda_slice::<T>()?.device_ptr(&stream);
            Ok(ptr + (l.start_offset() * elem) as u64)
        };
        let (mel_ptr, face_ptr) = (at(mel, mel_l)?, at(face, face_l)?);
        let out_len = n * 3 * arch::FACE_SIZE * arch::FACE_SIZE;
        // SAFETY: the output layer's epilogue writes every element.
        let mut out = unsafe { engine.device().alloc::<T>(out_len)? };
        let out_ptr = out.device_ptr_mut(&stream).0;

        let mut biases = Vec::with_capacity(g.layers.len());
        for layer in &g.layers {
            let block = model_block(self.model, &layer.path).map_err(lower)?;
            biases.push(engine.address(block.bias())?);
        }
        let mut amax = vec![0u64; g.layers.len()];
        if let Some(m) = self.maxima {
            let base = engine.address(m)?;
            for (slot, &layer) in self.checked.iter().enumerate() {
                amax[layer] = base + 4 * slot as u64;
            }
        }
        let arena = net.engine.settings().arena == super::Arena::On;
        let mut state = net.state.lock().unwrap();
        let buffers = if arena {
            let plan = ArenaPlan::new(g, n, elem);
            if state.arena.as_ref().is_none_or(|a| a.len() < plan.bytes) {
                state.arena = None;
                // SAFETY: every buffer is written before it is read (the graph's order).
                state.arena = Some(unsafe { stream.alloc::<u8>(plan.bytes.max(1))? });
            }
            let base = state
                .arena
                .as_mut()
                .expect("allocated above")
                .device_ptr_mut(&stream)
                .0;
            (0..g.buffers.len())
                .map(|b| plan.address(base, b))
                .collect()
        } else {
            vec![0; g.buffers.len()]
        };
        let mut addr = Addresses {
            buffers,
            biases,
            amax,
            mel: mel_ptr,
            face: face_ptr,
            output: out_ptr,
        };
        let mut backend = GpuBackend {
            pass: self,
            state: &mut state,
            intervals: (!arena).then(|| g.intervals()),
            owned: (0..g.buffers.len()).map(|_| None).collect(),
        };
        if let Some(marks) = self.profile.borrow_mut().as_mut() {
            marks.push((None, engine.mark().map_err(lower)?));
        }
        netexec::run(g, n, &mut addr, net.kernels.wide, &mut backend).map_err(lower)?;
        if let Some(marks) = self.profile.borrow_mut().as_mut() {
            marks.push((None, engine.mark().map_err(lower)?));
        }
        drop(backend);
        drop(state);
        Ok((
            CudaStorage::wrap_cuda_slice(out, engine.device().clone()),
            Shape::from((n, 3, arch::FACE_SIZE, arch::FACE_SIZE)),
        ))
    }
}

/// Runs the operations of one pass on the device.
struct GpuBackend<'a, 'b> {
    pass: &'a PassOp<'b>,
    state: &'a mut State,
    /// `--conv-arena off`: each buffer's lifetime, and the buffers allocated so far.
    intervals: Option<Vec<(usize, usize)>>,
    owned: Vec<Option<CudaSlice<u8>>>,
}

impl<'b> GpuBackend<'_, 'b> {
    fn net(&self) -> &'b PlannedNet {
        self.pass.net
    }

    /// The block a convolution of `layer` runs, over the input channels `slice`.
    fn block(&self, layer: &Layer, part: ConvPart, slice: (usize, usize)) -> Result<ConvBlock> {
        let engine = &self.net().engine;
        let block = model_block(self.pass.model, &layer.path)?;
        let whole = match part {
            ConvPart::Layer => engine.padded_block(block, layer.cin)?,
            ConvPart::Form(i) => {
                let form = layer.form.expect("a form convolution has a form");
                engine.form_blocks(block, form)?[i].clone()
            }
        };
        engine.slice_block(&whole, slice.0, slice.1)
    }

    /// A scratch buffer for a timing (freed in stream order when dropped).
    fn scratch(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: written before it is read (the convolution, then its epilogue).
        Ok(
            unsafe { self.net().engine.stream().alloc::<u8>(bytes.max(1)) }
                .map_err(candle_core::Error::from)?,
        )
    }

    /// Times every upsampling form of `layer` on its input at `x` (and, for a split
    /// concatenation, its skip part at `skip`): the form's convolutions into scratch buffers
    /// and its epilogue (bias, ReLU, the shuffle) into an output of its own. Records the
    /// fastest.
    fn time_forms(&mut self, li: usize, x: u64, skip: Option<u64>) -> Result<()> {
        let net = self.net();
        let engine = &net.engine;
        let g = self.pass.graph;
        let n = self.pass.n;
        let layer = &g.layers[li];
        let block = model_block(self.pass.model, &layer.path)?;
        let input = PlannedNet::input_shape(layer, n);
        let elem = engine.dtype().size_in_bytes();
        let (oh, ow) = layer.output_hw;
        let cout = layer.spec.cout;
        let out = self.scratch(n * oh * ow * cout * elem)?;
        let out_ptr = out.device_ptr(engine.stream()).0;
        let bias = engine.address(block.bias())?;
        // One scratch buffer for every form's convolution outputs (the runs follow each other
        // on the stream), at 256-byte aligned offsets.
        let offsets: HashMap<UpForm, Vec<usize>> = UpForm::ALL
            .iter()
            .map(|&form| {
                let probe = Layer {
                    form: Some(form),
                    ..layer.clone()
                };
                // Each convolution's offset, then the end.
                let mut offs = vec![0];
                for d in probe.convs() {
                    let (zh, zw) = d.output(layer.input_hw.0, layer.input_hw.1);
                    let end = offs[offs.len() - 1]
                        + (n * zh * zw * d.cout * elem).next_multiple_of(ALIGN);
                    offs.push(end);
                }
                (form, offs)
            })
            .collect();
        let need = offsets
            .values()
            .filter_map(|o| o.last())
            .max()
            .copied()
            .unwrap_or(0);
        let scratch = self.scratch(need)?;
        let base = scratch.device_ptr(engine.stream()).0;
        let ms = engine.time_forms(&UpForm::ALL, |form| {
            let probe = Layer {
                form: Some(form),
                ..layer.clone()
            };
            let offs = &offsets[&form];
            let zs: Vec<u64> = offs[..offs.len() - 1]
                .iter()
                .map(|&o| base + o as u64)
                .collect();
            let parts: Vec<ConvBlock> = if form == UpForm::Transposed {
                vec![block.clone()]
            } else {
                engine.form_blocks(block, form)?
            };
            for ((part, d), &z) in parts.iter().zip(probe.convs()).zip(&zs) {
                let (zh, zw) = d.output(layer.input_hw.0, layer.input_hw.1);
                let bytes = n * zh * zw * d.cout * elem;
                // Over all input channels, or a split concatenation's two parts in turn.
                for (k, &(first, count)) in layer.input_slices().iter().enumerate() {
                    let sliced = engine.slice_block(part, first, count)?;
                    let at = [input[0], count, input[2], input[3]];
                    let key = PlanKey::of_dims(sliced.path(), sliced.dims(), at);
                    let (src, mode) = match (k, skip) {
                        (1, Some(s)) => (s, Mode::Accumulate),
                        _ => (x, Mode::Unfused),
                    };
                    engine.call(&sliced, &key, (src, z), bytes, mode)?;
                }
            }
            let mut a = LsEpilogue {
                bias,
                dst: out_ptr,
                dst_c: cout as i32,
                act: ACT_RELU,
                ..Default::default()
            };
            netexec::layer_sources(&probe, n, &zs, &mut a);
            a.choose_vec(net.kernels.wide);
            net.epilogue(&a)?;
            Ok(())
        })?;
        drop((scratch, out));
        let choice = super::engine::FormChoice::fastest(ms)
            .ok_or_else(|| Error::Settings(format!("no upsampling form runs {}", layer.path)))?;
        tracing::info!(
            "{} at batch {n}: upsampling {} ({})",
            layer.path,
            choice.form.name(),
            choice
                .ms
                .iter()
                .map(|(f, ms)| format!("{} {ms:.3} ms", f.name()))
                .collect::<Vec<_>>()
                .join(", ")
        );
        engine.record_form(block, input, true, choice);
        Ok(())
    }

    /// Times cuDNN's fused call against the convolution and the own epilogue for `layer` on
    /// its input at `x`, into scratch buffers; records the timing (or, when cuDNN refuses the
    /// fused call, that the layer is not fused).
    fn time_fusion(&mut self, li: usize, x: u64) -> Result<()> {
        let net = self.net();
        let engine = net.engine.clone();
        let g = self.pass.graph;
        let n = self.pass.n;
        let layer = &g.layers[li];
        let block = self.block(layer, ConvPart::Layer, (0, layer.cin))?;
        let input = PlannedNet::input_shape(layer, n);
        let key = PlanKey::of_dims(block.path(), block.dims(), input);
        let elem = engine.dtype().size_in_bytes();
        let (oh, ow) = layer.output_hw;
        let bytes = n * oh * ow * layer.spec.cout * elem;
        let (y, z) = (self.scratch(bytes)?, self.scratch(bytes)?);
        let (y_ptr, z_ptr) = (
            y.device_ptr(engine.stream()).0,
            z.device_ptr(engine.stream()).0,
        );
        let mut a = LsEpilogue {
            bias: engine.address(block.bias())?,
            residual: if layer.spec.residual { x } else { 0 },
            dst: y_ptr,
            dst_c: layer.spec.cout as i32,
            act: ACT_RELU,
            ..Default::default()
        };
        netexec::layer_sources(layer, n, &[z_ptr], &mut a);
        a.choose_vec(net.kernels.wide);
        let fused = || -> Result<bool> {
            Ok(engine
                .call(&block, &key, (x, y_ptr), bytes, Mode::Fused)?
                .fused)
        };
        let own = || -> Result<()> {
            engine.call(&block, &key, (x, z_ptr), bytes, Mode::Unfused)?;
            net.epilogue(&a)?;
            Ok(())
        };
        if !fused()? {
            self.state.refused.insert(layer.path.clone());
            self.state.settled.clear();
            return Ok(());
        }
        own()?;
        // All runs queued with their events, read afterwards (reading waits for the device).
        let mut marks = Vec::with_capacity(FUSE_TIMING_RUNS);
        for _ in 0..FUSE_TIMING_RUNS {
            let a0 = engine.mark()?;
            fused()?;
            let a1 = engine.mark()?;
            own()?;
            marks.push((a0, a1, engine.mark()?));
        }
        let ms = |p: &CudaEvent, q: &CudaEvent| -> Result<f32> {
            Ok(p.elapsed_ms(q).map_err(candle_core::Error::from)?)
        };
        let mut timing = FuseTiming {
            fused_ms: f32::INFINITY,
            unfused_ms: f32::INFINITY,
        };
        for (a0, a1, a2) in &marks {
            timing.fused_ms = timing.fused_ms.min(ms(a0, a1)?);
            timing.unfused_ms = timing.unfused_ms.min(ms(a1, a2)?);
        }
        drop((y, z));
        engine.record_own_fusion(&block, input, timing);
        Ok(())
    }
    /// The warm-up's first pass at this batch: times what is still open for `layer`, on its
    /// real input, before the layer runs. Running out of memory for the timing's scratch
    /// leaves the choice untimed (the fallback) instead of failing the pass.
    fn time_open_choices(&mut self, layer: usize, addr: &Addresses) -> Result<()> {
        let g = self.pass.graph;
        let l = &g.layers[layer];
        if self.state.untimed.contains(&l.path) {
            return Ok(());
        }
        // One timing at a time in the process, so instances warming up together do not time
        // each other's kernels (as the algorithm searches do).
        static TIMING: Mutex<()> = Mutex::new(());
        let _one = TIMING.lock().unwrap_or_else(|p| p.into_inner());
        let x = addr.buffers[l.input];
        let skip = l.skip_input.map(|(b, _)| addr.buffers[b]);
        let net = self.net();
        let block = model_block(self.pass.model, &l.path)?;
        let input = PlannedNet::input_shape(l, self.pass.n);
        let mut timed = Ok(());
        if l.form.is_some() && net.engine.known_form(block, input, true).is_none() {
            timed = self.time_forms(layer, x, skip);
        }
        if timed.is_ok()
            && net.engine.settings().epilogue == Epilogue::Auto
            && l.fusable
            && !self.state.refused.contains(&l.path)
        {
            let padded = net.engine.padded_block(block, l.cin)?;
            if net.engine.own_fusion(&padded, input).is_none() {
                timed = self.time_fusion(layer, x);
            }
        }
        match timed {
            Err(e) if e.is_out_of_memory() => {
                tracing::warn!(
                    "{} at batch {}: no memory to time its choices ({e}); running the untimed \
                     ones",
                    l.path,
                    self.pass.n
                );
                self.state.untimed.insert(l.path.clone());
                Ok(())
            }
            other => other,
        }
    }
}

impl Backend for GpuBackend<'_, '_> {
    type Error = Error;

    fn input(&mut self, a: &LsInput) -> Result<()> {
        let net = self.net();
        let items = a.items();
        net.launch(&net.kernels.input, a, Some(items), items)?;
        Ok(())
    }

    fn conv(
        &mut self,
        layer: &Layer,
        part: ConvPart,
        dims: &crate::model::cudnn::ConvDims,
        input: [usize; 4],
        (x, y): (u64, u64),
        slice: (usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let net = self.net();
        let engine = net.engine.clone();
        let block = self.block(layer, part, slice)?;
        let key = PlanKey::of_dims(block.path(), block.dims(), input);
        let (oh, ow) = dims.output(input[2], input[3]);
        let elem = engine.dtype().size_in_bytes();
        let bytes = input[0] * oh * ow * dims.cout * elem;
        if !layer.fused {
            let mode = if accumulate {
                Mode::Accumulate
            } else {
                Mode::Unfused
            };
            engine.call(&block, &key, (x, y), bytes, mode)?;
            return Ok(());
        }
        let ran = engine.call(&block, &key, (x, y), bytes, Mode::Fused)?;
        if !ran.fused {
            // cuDNN refused the fused call (the plan ran the convolution alone): bias,
            // residual and ReLU in place by the own epilogue; not fused from now on.
            self.state.refused.insert(layer.path.clone());
            self.state.settled.clear();
            let mut a = LsEpilogue {
                bias: engine.address(block.bias())?,
                residual: if layer.spec.residual { x } else { 0 },
                dst: y,
                dst_c: layer.spec.cout as i32,
                act: if layer.relu() { ACT_RELU } else { ACT_NONE },
                ..Default::default()
            };
            netexec::layer_sources(layer, input[0], &[y], &mut a);
            a.choose_vec(net.kernels.wide);
            net.epilogue(&a)?;
        }
        Ok(())
    }

    fn epilogue(&mut self, a: &LsEpilogue) -> Result<()> {
        self.net().epilogue(a)?;
        Ok(())
    }

    fn max_abs(&mut self, a: &LsMaxAbs) -> Result<()> {
        let net = self.net();
        let count = a.count as u64;
        net.launch(&net.kernels.max_abs, a, None, count)?;
        Ok(())
    }

    fn layer_boundary(&mut self, layer: usize, end: bool, addr: &Addresses) -> Result<()> {
        if !end && self.pass.pending {
            self.time_open_choices(layer, addr)?;
        }
        if let Some(marks) = self.pass.profile.borrow_mut().as_mut() {
            marks.push((Some(layer), self.net().engine.mark()?));
        }
        Ok(())
    }

    fn before_op(&mut self, k: usize, addr: &mut Addresses) -> Result<()> {
        let g = self.pass.graph;
        if let Some(iv) = &self.intervals {
            let elem = self.net().engine.dtype().size_in_bytes();
            for (b, &(first, _)) in iv.iter().enumerate() {
                if first == k {
                    let mut buf = self.scratch(g.buffers[b].bytes(self.pass.n, elem))?;
                    addr.buffers[b] = buf.device_ptr_mut(self.net().engine.stream()).0;
                    self.owned[b] = Some(buf);
                }
            }
        }
        Ok(())
    }

    fn after_op(&mut self, k: usize) -> Result<()> {
        if let Some(iv) = &self.intervals {
            for (b, &(_, last)) in iv.iter().enumerate() {
                if last == k {
                    // Freed in stream order, after the operations issued so far.
                    self.owned[b] = None;
                }
            }
        }
        Ok(())
    }
}
