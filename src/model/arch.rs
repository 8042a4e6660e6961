//! The Wav2Lip generator's layers, as a table (`wav2lip-spec.md` §1.2).
//!
//! Everything that needs the architecture (expected checkpoint keys and shapes, the model's
//! construction, random initialisation) reads it from here.

/// What a layer computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// `models/conv.py: Conv2d`: conv (bias) + BatchNorm, optional residual add, ReLU.
    Conv,
    /// `models/conv.py: Conv2dTranspose`: transposed conv (bias) + BatchNorm, ReLU.
    ConvTranspose,
    /// A bare `nn.Conv2d` (bias, no BatchNorm, no activation): `output_block.1`.
    Plain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub cin: usize,
    pub cout: usize,
    pub kernel: usize,
    /// (height, width); only the audio encoder has unequal strides.
    pub stride: (usize, usize),
    pub padding: usize,
    pub output_padding: usize,
    /// `ReLU(BN(conv(x)) + x)` instead of `ReLU(BN(conv(x)))`.
    pub residual: bool,
}

impl LayerSpec {
    /// Shape of `conv_block.0.weight` (PyTorch layouts: `[cout, cin, k, k]` for convolutions,
    /// `[cin, cout, k, k]` for transposed convolutions).
    pub fn weight_shape(&self) -> Vec<usize> {
        let k = self.kernel;
        match self.kind {
            LayerKind::ConvTranspose => vec![self.cin, self.cout, k, k],
            _ => vec![self.cout, self.cin, k, k],
        }
    }

    pub fn has_batch_norm(&self) -> bool {
        self.kind != LayerKind::Plain
    }

    /// Key prefix of the convolution's weight and bias for a layer at `path`.
    pub fn conv_prefix(&self, path: &str) -> String {
        match self.kind {
            LayerKind::Plain => path.to_string(),
            _ => format!("{path}.conv_block.0"),
        }
    }
}

const fn layer(
    kind: LayerKind,
    cin: usize,
    cout: usize,
    kernel: usize,
    stride: (usize, usize),
    padding: usize,
) -> LayerSpec {
    LayerSpec {
        kind,
        cin,
        cout,
        kernel,
        stride,
        padding,
        output_padding: 0,
        residual: false,
    }
}

const fn conv(cin: usize, cout: usize, k: usize, s: usize, p: usize) -> LayerSpec {
    layer(LayerKind::Conv, cin, cout, k, (s, s), p)
}

/// A convolution with unequal strides (height, width).
const fn conv_hw(cin: usize, cout: usize, stride: (usize, usize)) -> LayerSpec {
    layer(LayerKind::Conv, cin, cout, 3, stride, 1)
}

/// Residual 3×3 block: `c → c`, stride 1, padding 1.
const fn res(c: usize) -> LayerSpec {
    let mut l = layer(LayerKind::Conv, c, c, 3, (1, 1), 1);
    l.residual = true;
    l
}

const fn convt(cin: usize, cout: usize, s: usize, p: usize, op: usize) -> LayerSpec {
    let mut l = layer(LayerKind::ConvTranspose, cin, cout, 3, (s, s), p);
    l.output_padding = op;
    l
}

pub const FACE_ENCODER_BLOCKS: &[&[LayerSpec]] = &[
    &[conv(6, 16, 7, 1, 3)],
    &[conv(16, 32, 3, 2, 1), res(32), res(32)],
    &[conv(32, 64, 3, 2, 1), res(64), res(64), res(64)],
    &[conv(64, 128, 3, 2, 1), res(128), res(128)],
    &[conv(128, 256, 3, 2, 1), res(256), res(256)],
    &[conv(256, 512, 3, 2, 1), res(512)],
    &[conv(512, 512, 3, 1, 0), conv(512, 512, 1, 1, 0)],
];

pub const AUDIO_ENCODER: &[LayerSpec] = &[
    conv(1, 32, 3, 1, 1),
    res(32),
    res(32),
    conv_hw(32, 64, (3, 1)),
    res(64),
    res(64),
    conv(64, 128, 3, 3, 1),
    res(128),
    res(128),
    conv_hw(128, 256, (3, 2)),
    res(256),
    conv(256, 512, 3, 1, 0),
    conv(512, 512, 1, 1, 0),
];

pub const FACE_DECODER_BLOCKS: &[&[LayerSpec]] = &[
    &[conv(512, 512, 1, 1, 0)],
    &[convt(1024, 512, 1, 0, 0), res(512)],
    &[convt(1024, 512, 2, 1, 1), res(512), res(512)],
    &[convt(768, 384, 2, 1, 1), res(384), res(384)],
    &[convt(512, 256, 2, 1, 1), res(256), res(256)],
    &[convt(320, 128, 2, 1, 1), res(128), res(128)],
    &[convt(160, 64, 2, 1, 1), res(64), res(64)],
];

pub const OUTPUT_BLOCK: &[LayerSpec] = &[
    conv(80, 32, 3, 1, 1),
    layer(LayerKind::Plain, 32, 3, 1, (1, 1), 0),
];

/// Input sizes: mel windows are 80 bins × 16 steps, faces 96×96 with 6 channels.
pub const MEL_BINS: usize = 80;
pub const MEL_STEPS: usize = 16;
pub const FACE_SIZE: usize = 96;
pub const FACE_CHANNELS: usize = 6;

/// Every layer with its module path, in state-dict order (face encoder, audio encoder,
/// decoder, output block).
pub fn layers() -> Vec<(String, LayerSpec)> {
    let mut out = Vec::new();
    for (b, block) in FACE_ENCODER_BLOCKS.iter().enumerate() {
        for (l, spec) in block.iter().enumerate() {
            out.push((format!("face_encoder_blocks.{b}.{l}"), *spec));
        }
    }
    for (l, spec) in AUDIO_ENCODER.iter().enumerate() {
        out.push((format!("audio_encoder.{l}"), *spec));
    }
    for (b, block) in FACE_DECODER_BLOCKS.iter().enumerate() {
        for (l, spec) in block.iter().enumerate() {
            out.push((format!("face_decoder_blocks.{b}.{l}"), *spec));
        }
    }
    for (l, spec) in OUTPUT_BLOCK.iter().enumerate() {
        out.push((format!("output_block.{l}"), *spec));
    }
    out
}

/// BatchNorm tensors of a layer: `(suffix, is a trainable parameter)`.
pub const BN_TENSORS: [(&str, bool); 4] = [
    ("weight", true),
    ("bias", true),
    ("running_mean", false),
    ("running_var", false),
];

/// One expected tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub key: String,
    pub shape: Vec<usize>,
    /// Trainable parameter (counts towards the parameter count); BatchNorm running
    /// statistics do not.
    pub parameter: bool,
}

/// The tensors of the generator's state dict (302 unfolded: `num_batches_tracked` excluded),
/// or of a BatchNorm-folded file (102: one weight and bias per convolution).
pub fn tensor_specs(folded: bool) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    for (path, spec) in layers() {
        let conv = spec.conv_prefix(&path);
        out.push(TensorSpec {
            key: format!("{conv}.weight"),
            shape: spec.weight_shape(),
            parameter: true,
        });
        out.push(TensorSpec {
            key: format!("{conv}.bias"),
            shape: vec![spec.cout],
            parameter: true,
        });
        if spec.has_batch_norm() && !folded {
            for (name, parameter) in BN_TENSORS {
                out.push(TensorSpec {
                    key: format!("{path}.conv_block.1.{name}"),
                    shape: vec![spec.cout],
                    parameter,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_dict_has_the_published_size() {
        let specs = tensor_specs(false);
        assert_eq!(specs.len(), 302);
        let params: usize = specs
            .iter()
            .filter(|s| s.parameter)
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert_eq!(params, 36_298_035);
        let stats: usize = specs
            .iter()
            .filter(|s| !s.parameter)
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert_eq!(stats, 22_752);
        assert_eq!(tensor_specs(true).len(), 102);
    }

    #[test]
    fn key_names_and_shapes_match_the_published_layout() {
        let specs = tensor_specs(false);
        let find = |k: &str| specs.iter().find(|s| s.key == k).map(|s| s.shape.clone());
        // From checkpoint-layout.txt.
        assert_eq!(
            find("face_encoder_blocks.0.0.conv_block.0.weight"),
            Some(vec![16, 6, 7, 7])
        );
        assert_eq!(
            find("face_decoder_blocks.1.0.conv_block.0.weight"),
            Some(vec![1024, 512, 3, 3])
        );
        assert_eq!(
            find("face_decoder_blocks.3.0.conv_block.0.bias"),
            Some(vec![384])
        );
        assert_eq!(
            find("audio_encoder.12.conv_block.1.running_var"),
            Some(vec![512])
        );
        assert_eq!(find("output_block.1.weight"), Some(vec![3, 32, 1, 1]));
        assert_eq!(
            specs.first().unwrap().key,
            "face_encoder_blocks.0.0.conv_block.0.weight"
        );
        assert_eq!(specs.last().unwrap().key, "output_block.1.bias");
    }

    #[test]
    fn decoder_channels_follow_the_skip_concatenations() {
        // Each decoder block's input = previous block's output + the matching encoder
        // feature map (spec §1.3).
        let enc_out: Vec<usize> = FACE_ENCODER_BLOCKS
            .iter()
            .map(|b| b.last().unwrap().cout)
            .collect();
        let mut channels = AUDIO_ENCODER.last().unwrap().cout;
        for (i, block) in FACE_DECODER_BLOCKS.iter().enumerate() {
            assert_eq!(block[0].cin, channels, "decoder block {i}");
            channels = block.last().unwrap().cout + enc_out[enc_out.len() - 1 - i];
        }
        assert_eq!(OUTPUT_BLOCK[0].cin, channels);
    }
}
