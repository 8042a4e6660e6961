//! Five facial landmarks, in image pixels: the eye on the image's left, the eye on its right,
//! the nose tip, the mouth corner on the left and the one on the right (RetinaFace's order, and
//! the FFHQ template's). Face restoration aligns the face to a template from them.
//!
//! An avatar's landmarks come from the client (`landmarks`, ten numbers) or else from its face
//! box by fixed proportions ([`Landmarks::from_box`]).

use std::fmt;
use std::str::FromStr;

use super::FaceBox;
use crate::media::Error;

/// Where an avatar's landmarks came from (the avatar JSON's `landmarks_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LandmarkSource {
    /// Given by the client with the upload.
    Client,
    /// Found by RetinaFace around the face box.
    RetinaFace,
    /// Placed in the face box by fixed proportions.
    Box,
}

impl LandmarkSource {
    pub fn as_str(self) -> &'static str {
        match self {
            LandmarkSource::Client => "client",
            LandmarkSource::RetinaFace => "retinaface",
            LandmarkSource::Box => "box",
        }
    }
}

/// Where the five points sit in a face box, as fractions of its width and height: the box as
/// the service uses it (brows to chin, Wav2Lip's default 10-pixel pad below the chin included).
/// Measured by hand on the two test photos (`tests/media/README.md`), as the detector's
/// calibration was, and made left-right symmetric: the eyes 0.14 of the height below the
/// top, the nose tip 0.44, the mouth corners 0.61; the eyes 0.237 of the width either side of
/// the centre, the mouth corners 0.22.
const BOX_PROPORTIONS: [[f64; 2]; 5] = [
    [0.263, 0.14],
    [0.737, 0.14],
    [0.5, 0.443],
    [0.28, 0.613],
    [0.72, 0.613],
];

/// Closest two eyes may be, in pixels: below this a similarity fit is meaningless.
const MIN_EYE_DISTANCE: f64 = 2.0;

/// Five points `[x, y]` in pixels (see the module's order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Landmarks(pub [[f64; 2]; 5]);

impl Landmarks {
    /// The five points placed in `b` by [`BOX_PROPORTIONS`], to 1/100 of a pixel.
    pub fn from_box(b: FaceBox) -> Landmarks {
        let (w, h) = (f64::from(b.width()), f64::from(b.height()));
        let at = |v: f64| (v * 100.0).round() / 100.0;
        Landmarks(
            BOX_PROPORTIONS
                .map(|[fx, fy]| [at(f64::from(b.x1) + fx * w), at(f64::from(b.y1) + fy * h)]),
        )
    }

    /// The ten numbers `x1, y1, …, x5, y5`.
    pub fn to_array(&self) -> [f64; 10] {
        let mut out = [0.0; 10];
        for (i, [x, y]) in self.0.iter().enumerate() {
            out[2 * i] = *x;
            out[2 * i + 1] = *y;
        }
        out
    }

    /// Refuses points outside a `width × height` image (`0 ≤ x ≤ width`, `0 ≤ y ≤ height`), or
    /// eyes closer than two pixels, which leave the alignment undefined.
    pub fn check(&self, width: u32, height: u32) -> Result<(), Error> {
        let (w, h) = (f64::from(width), f64::from(height));
        if let Some((i, [x, y])) = self
            .0
            .iter()
            .enumerate()
            .find(|(_, [x, y])| !(0.0..=w).contains(x) || !(0.0..=h).contains(y))
        {
            return Err(Error::BadLandmarks(format!(
                "landmark {} ({x},{y}) is outside the {width}x{height} image",
                i + 1
            )));
        }
        let [[lx, ly], [rx, ry], ..] = self.0;
        if (rx - lx).hypot(ry - ly) < MIN_EYE_DISTANCE {
            return Err(Error::BadLandmarks(format!(
                "the eyes ({lx},{ly}) and ({rx},{ry}) are less than {MIN_EYE_DISTANCE} pixels \
                 apart"
            )));
        }
        Ok(())
    }

    /// The points of an image of size `from` mapped into the same image resized to `to`.
    pub fn scale(&self, from: (u32, u32), to: (u32, u32)) -> Landmarks {
        if from == to {
            return *self;
        }
        let sx = f64::from(to.0) / f64::from(from.0);
        let sy = f64::from(to.1) / f64::from(from.1);
        Landmarks(self.0.map(|[x, y]| [x * sx, y * sy]))
    }
}

impl fmt::Display for Landmarks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.to_array();
        for (i, v) in a.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

impl FromStr for Landmarks {
    type Err = Error;

    /// Ten comma-separated numbers (pixels, fractions allowed), or the same as a JSON array:
    /// `x1,y1,…,x5,y5` for the left eye, right eye, nose tip, left and right mouth corner.
    /// Whether they fit an image is checked by [`Landmarks::check`].
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || {
            Error::BadLandmarks(format!(
                "{s:?} is not ten numbers x1,y1,...,x5,y5 (left eye, right eye, nose tip, \
                 left and right mouth corner, in pixels)"
            ))
        };
        let t = s.trim();
        let t = t
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or(t);
        let values: Vec<f64> = t
            .split(',')
            .map(|p| p.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        if values.len() != 10 || values.iter().any(|v| !v.is_finite()) {
            return Err(bad());
        }
        let mut points = [[0.0; 2]; 5];
        for (i, p) in points.iter_mut().enumerate() {
            *p = [values[2 * i], values[2 * i + 1]];
        }
        Ok(Landmarks(points))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_takes_ten_numbers_plain_or_as_a_json_array_and_round_trips() {
        let l: Landmarks = "201.5,100,245,101, 224,128,204,141,245,141"
            .parse()
            .unwrap();
        assert_eq!(l.0[0], [201.5, 100.0]);
        assert_eq!(l.0[4], [245.0, 141.0]);
        let j: Landmarks = "[201.5, 100, 245, 101, 224, 128, 204, 141, 245, 141]"
            .parse()
            .unwrap();
        assert_eq!(l, j);
        assert_eq!(l.to_string().parse::<Landmarks>().unwrap(), l);
        for bad in [
            "",
            "1,2,3",
            "1,2,3,4,5,6,7,8,9",
            "1,2,3,4,5,6,7,8,9,x",
            "1,2,3,4,5,6,7,8,9,NaN",
        ] {
            let e = bad.parse::<Landmarks>().unwrap_err();
            assert_eq!(e.kind(), "bad_landmarks", "{bad}");
        }
    }

    #[test]
    fn check_refuses_points_outside_the_image_and_eyes_on_one_spot() {
        let l: Landmarks = "10,10,30,10,20,20,12,30,28,30".parse().unwrap();
        assert!(l.check(40, 40).is_ok());
        assert!(l.check(40, 40).is_ok());
        let e = l.check(25, 40).unwrap_err().to_string();
        assert!(
            e.contains("landmark 2 (30,10) is outside the 25x40 image"),
            "{e}"
        );
        let same: Landmarks = "10,10,11,10,20,20,12,30,28,30".parse().unwrap();
        assert!(same
            .check(40, 40)
            .unwrap_err()
            .to_string()
            .contains("apart"));
    }

    #[test]
    fn points_from_a_box_follow_its_proportions_and_scale_with_it() {
        let b = FaceBox {
            x1: 100,
            y1: 50,
            x2: 200,
            y2: 150,
        };
        let l = Landmarks::from_box(b);
        // Eyes above the nose above the mouth, symmetric about the box's centre line.
        assert!(l.0[0][1] < l.0[2][1] && l.0[2][1] < l.0[3][1]);
        assert!((l.0[0][0] + l.0[1][0] - 300.0).abs() < 1e-3);
        assert!((l.0[3][0] + l.0[4][0] - 300.0).abs() < 1e-3);
        assert_eq!(l.0[2], [150.0, 50.0 + 44.3]);
        let half = l.scale((400, 300), (200, 150));
        let b2 = FaceBox {
            x1: 50,
            y1: 25,
            x2: 100,
            y2: 75,
        };
        let direct = Landmarks::from_box(b2);
        for (p, q) in half.0.iter().zip(direct.0.iter()) {
            assert!((p[0] - q[0]).abs() < 1e-3 && (p[1] - q[1]).abs() < 1e-3);
        }
    }
}
