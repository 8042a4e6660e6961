//! Image input and the model's face crop, against images made by the reference scripts.

mod common;

use common::media;

use lipsync::media::face::{self, FaceBox};
use lipsync::media::image::{self as img, ImageLimits};
use lipsync::media::Error;

#[test]
fn png_jpeg_webp_decode_with_orientation_and_without_alpha() {
    let limits = ImageLimits::default();
    let png = img::load(&media("astronaut.png"), &limits).unwrap();
    assert_eq!((png.width, png.height), (512, 512));
    let jpg = img::load(&media("grace_hopper.jpg"), &limits).unwrap();
    assert_eq!((jpg.width, jpg.height), (512, 600));
    // Stored 64x32 with EXIF orientation 6: displayed rotated, 32x64.
    let rotated = img::load(&media("exif_rotated.jpg"), &limits).unwrap();
    assert_eq!((rotated.width, rotated.height), (32, 64));
    let webp = img::load(&media("small.webp"), &limits).unwrap();
    assert_eq!((webp.width, webp.height), (64, 32));
    // The RGBA PNG's colour channels are used as stored (no compositing over a background),
    // so it equals the lossless WebP of the same picture.
    let rgba = img::load(&media("rgba.png"), &limits).unwrap();
    assert_eq!(rgba.rgb, webp.rgb);
    // The rotation moved the top-left pixel of the stored image to the top-right.
    let stored = ::image::load_from_memory(&media("exif_rotated.jpg"))
        .unwrap()
        .to_rgb8();
    let p = stored.get_pixel(0, 0);
    let q = &rotated.rgb[(31 * 3)..(31 * 3 + 3)];
    assert!(
        p.0.iter().zip(q).all(|(a, b)| a.abs_diff(*b) <= 2),
        "{p:?} {q:?}"
    );
}

#[test]
fn decompression_bombs_are_refused_before_decoding() {
    // A PNG whose header claims 100000 x 100000 pixels (10 G) over a few bytes of data.
    let mut png = media("rgba.png");
    png[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    png[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    match img::load(&png, &ImageLimits::default()) {
        Err(Error::TooManyPixels { width, height, .. }) => {
            assert_eq!((width, height), (100_000, 100_000))
        }
        other => panic!("{:?}", other.map(|f| (f.width, f.height))),
    }
    let small = ImageLimits {
        max_pixels: 1000,
        ..Default::default()
    };
    assert!(matches!(
        img::load(&media("astronaut.png"), &small),
        Err(Error::TooManyPixels { .. })
    ));
}

/// CRC-32 (IEEE) of a PNG chunk's type and data.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn unreadable_images_get_typed_errors() {
    let l = ImageLimits::default();
    let kind = |b: &[u8]| img::load(b, &l).err().map(|e| e.kind());
    assert_eq!(kind(b""), Some("empty_image"));
    assert_eq!(kind(&media("arctic_a0007.wav")), Some("not_an_image"));
    assert_eq!(kind(b"GIF89a\x01\x00\x01\x00"), Some("unsupported_image"));
    let png = media("astronaut.png");
    assert_eq!(kind(&png[..png.len() / 2]), Some("corrupt_image"));
    let mut garbled = png.clone();
    for b in garbled[200..400].iter_mut() {
        *b ^= 0x5a;
    }
    // Damage inside compressed pixel data would decode to garbage (the PNG decoder does not
    // verify zlib checksums), but the chunk's CRC gives it away.
    assert_eq!(kind(&garbled), Some("corrupt_image"));
}

/// The photo with its last `cut` bytes missing, as an interrupted upload leaves it.
fn cut_short(name: &str, cut: usize) -> Vec<u8> {
    let mut b = media(name);
    b.truncate(b.len() - cut);
    b
}

#[test]
fn images_cut_short_are_refused_as_damaged() {
    let l = ImageLimits::default();
    for name in [
        "astronaut.png",
        "rgba.png",
        "grace_hopper.jpg",
        "exif_rotated.jpg",
        "small.webp",
    ] {
        let len = media(name).len();
        // From the last byte (a PNG's IEND CRC, a JPEG's end-of-image marker) to half the
        // file; the decoders accept many of these and fill in the missing pixels.
        for cut in [1, 2, 8, 100, len / 4, len / 2] {
            let err = img::load(&cut_short(name, cut), &l)
                .map(|f| (f.width, f.height))
                .expect_err(&format!("{name} without its last {cut} bytes was accepted"));
            assert_eq!(err.kind(), "corrupt_image", "{name} cut by {cut}: {err}");
            assert!(
                err.to_string().contains("damaged"),
                "{name} cut by {cut}: {err}"
            );
        }
    }
}

#[test]
fn damaged_structure_is_refused_but_appended_bytes_are_not() {
    let l = ImageLimits::default();
    let kind = |b: &[u8]| img::load(b, &l).err().map(|e| e.kind());
    // A JPEG whose segment lengths no longer fit (a header byte overwritten).
    let mut jpg = media("grace_hopper.jpg");
    let sos = jpg
        .windows(2)
        .position(|w| w == [0xff, 0xda])
        .expect("a start-of-scan marker");
    jpg[sos + 2] = 0xff;
    assert_eq!(kind(&jpg), Some("corrupt_image"));
    // A WebP whose RIFF size claims more than the file holds.
    let mut webp = media("small.webp");
    let claimed = u32::from_le_bytes(webp[4..8].try_into().unwrap()) + 64;
    webp[4..8].copy_from_slice(&claimed.to_le_bytes());
    assert_eq!(kind(&webp), Some("corrupt_image"));
    // Bytes after the end of the image (some cameras and tools append data) are not damage.
    for name in ["astronaut.png", "grace_hopper.jpg", "small.webp"] {
        let mut b = media(name);
        b.extend_from_slice(b"appended by some tool");
        assert_eq!(kind(&b), None, "{name}");
    }
}

#[test]
fn large_photos_are_downscaled_for_the_video() {
    let l = ImageLimits {
        max_side: 200,
        ..Default::default()
    };
    let f = img::load(&media("grace_hopper.jpg"), &l).unwrap();
    assert_eq!((f.width, f.height), (171, 200));
}

#[test]
fn face_crop_matches_opencv_resize() {
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("render/reference.json")).unwrap(),
    )
    .unwrap();
    let b: Vec<u32> = meta["box"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let frame = img::load(&media("astronaut.png"), &ImageLimits::default()).unwrap();
    let crop = face::crop_bgr(
        &frame,
        &FaceBox {
            x1: b[0],
            y1: b[1],
            x2: b[2],
            y2: b[3],
        },
    );
    let mut reference = ::image::open(common::fixture("render/crop.png"))
        .unwrap()
        .to_rgb8()
        .into_raw();
    face::swap_red_blue(&mut reference);
    let diffs: Vec<u8> = crop
        .iter()
        .zip(&reference)
        .map(|(a, b)| a.abs_diff(*b))
        .collect();
    let differing = diffs.iter().filter(|&&d| d > 0).count();
    let max = diffs.iter().copied().max().unwrap();
    eprintln!(
        "crop vs cv2.resize: {differing} of {} values differ, by at most {max}",
        diffs.len()
    );
    assert!(max <= 1, "max {max}");
    assert!(differing * 100 < diffs.len(), "{differing} values differ");
}

/// Grey canvas of the warp back (the reference's border there).
const CANVAS: [u8; 3] = [128, 128, 128];

#[test]
fn face_alignment_matches_numpy_and_opencv_warp_affine() {
    // The similarity to the FFHQ 512 template against numpy's least squares, the aligned face
    // against cv2.warpAffine (bilinear, facexlib's border colour) and the warp back into the
    // photo with the inverted map against cv2.invertAffineTransform + cv2.warpAffine
    // (tests/reference/align_reference.py). Cases: landmarks read off the astronaut by hand,
    // the ones placed in its detected box, and a tilted, small face that leaves the photo's
    // edge (border pixels mixed with the photo's).
    use face::align::{self, Affine};
    let Some(python) = common::torch_python() else {
        return;
    };
    let photo_path = common::media_path("astronaut.png");
    let photo = img::load(&media("astronaut.png"), &ImageLimits::default()).unwrap();
    let boxed =
        face::Landmarks::from_box(face::locate(&photo, None, face::Pads::default()).unwrap());
    let cases: Vec<face::Landmarks> = [
        "202.8,101.7,245.3,103.3,225,128.3,203.7,140,245.3,141.7".to_string(),
        boxed.to_string(),
        "3.5,40,30,22,20,45,14,62,40,50".to_string(),
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/align_reference.py"
    ))
    .arg("--photo")
    .arg(&photo_path)
    .arg("--out")
    .arg(dir.path());
    for l in &cases {
        cmd.arg("--landmarks").arg(l.to_string());
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", common::text(&o.stderr));
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("result.json")).unwrap())
            .unwrap();
    let matrix = |v: &serde_json::Value| {
        let m: [[f64; 3]; 2] = serde_json::from_value(v.clone()).unwrap();
        Affine(m)
    };
    let rgb = |name: String| {
        ::image::open(dir.path().join(name))
            .unwrap()
            .to_rgb8()
            .into_raw()
    };
    for (i, l) in cases.iter().enumerate() {
        let case = &result["cases"][i];
        let fit = align::to_ffhq_512(l).unwrap();
        let (theirs, theirs_inv) = (matrix(&case["matrix"]), matrix(&case["inverse"]));
        for (a, b) in fit.0.iter().flatten().zip(theirs.0.iter().flatten()) {
            assert!(
                (a - b).abs() < 1e-9,
                "case {i}: {fit:?} vs numpy {theirs:?}"
            );
        }
        let inv = fit.invert().unwrap();
        for (a, b) in inv.0.iter().flatten().zip(theirs_inv.0.iter().flatten()) {
            assert!(
                (a - b).abs() < 1e-9,
                "case {i}: {inv:?} vs OpenCV {theirs_inv:?}"
            );
        }
        // The reference's own matrices into the warp: the images compare the warp alone.
        let aligned = align::warp_affine(&photo, &theirs, 512, 512, align::FFHQ_BORDER).unwrap();
        let back =
            align::warp_affine(&aligned, &theirs_inv, photo.width, photo.height, CANVAS).unwrap();
        for (what, ours, theirs) in [
            ("aligned", &aligned.rgb, rgb(format!("aligned_{i}.png"))),
            ("back", &back.rgb, rgb(format!("back_{i}.png"))),
        ] {
            let differing = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
            let max = ours
                .iter()
                .zip(&theirs)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap();
            eprintln!(
                "case {i} {what}: {differing} of {} values differ from OpenCV, by at most {max}",
                ours.len()
            );
            assert_eq!(ours.len(), theirs.len());
            assert_eq!(max, 0, "case {i} {what}");
        }
        // The restored face put back through the lower-face mask (the reference's stand-in
        // restored face: the aligned face's negative), made once per avatar frame, against
        // the same steps in numpy and OpenCV; outside the mask's region nothing changes.
        let mask = face::restore::RestoreMask::new(l, photo.width, photo.height).unwrap();
        assert_eq!(mask.aligned(&photo).rgb, aligned.rgb, "case {i}");
        let restored = ::image::open(dir.path().join(format!("restored_{i}.png")))
            .unwrap()
            .to_rgb8();
        let restored = img::Frame::new(512, 512, restored.into_raw());
        let mut blended = photo.clone();
        mask.blend_back(&mut blended, &restored);
        let theirs = rgb(format!("blended_{i}.png"));
        let max = blended
            .rgb
            .iter()
            .zip(&theirs)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        let changed = blended
            .rgb
            .iter()
            .zip(&photo.rgb)
            .filter(|(a, b)| a != b)
            .count();
        eprintln!("case {i} blended: max {max} from the reference, {changed} values changed");
        assert!(max <= 1, "case {i} blended: {max}");
        assert!(changed > 1000, "case {i}: the restored face does not show");
        // The aligned face is the photo's: most of the 512x512 is not the border colour.
        let border = aligned
            .rgb
            .chunks(3)
            .filter(|p| *p == align::FFHQ_BORDER)
            .count();
        assert!(
            border < 512 * 512 / 2 || i == 2,
            "case {i}: {border} border pixels"
        );
    }
}
