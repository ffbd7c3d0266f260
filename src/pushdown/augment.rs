//! Random augmentation owned by the client (ADR 0032): a pushdown request may name torchvision's
//! `RandomResizedCrop` and `RandomHorizontalFlip` and a seed; each sample's draws come from the
//! seed and the sample's key by a counter-based generator, so the client (`tensorgate.augment`)
//! computes the same boxes and flips on its side, in any worker, rank or resumed epoch.
//!
//! Pure: the request field's grammar, the generator and torchvision's box placement. Applying a
//! box to pixels is [`super::preprocess`]'s job.
//!
//! The field (`x-tensorgate-augment` or `tensorgate-augment`) lists the transforms in the order
//! they apply, separated by `;`, each with optional arguments:
//! `RandomResizedCrop(scale=0.08:1,ratio=0.75:1.3333333333333333);RandomHorizontalFlip(p=0.5)`.
//! Omitted arguments take torchvision's defaults. `size` (`224` or `<h>:<w>`), when given, must be
//! the model's input size: the prefix takes no other.
//!
//! The generator, restated in `clients/python/tensorgate/augment.py`:
//! - a sample's stream is the first 8 bytes (big-endian) of
//!   SHA-256(`tensorgate-augment-v1` NUL seed-in-decimal NUL key);
//! - draw `n` is SplitMix64's output function of `stream + (n + 1) * 0x9E3779B97F4A7C15` (mod 2^64);
//! - a uniform number in [0, 1) is a draw's top 53 bits times 2^-53, and a whole number in
//!   [0, m) is `(draw * m) >> 64`;
//! - `RandomResizedCrop`'s try `t` (0 to 9) uses draws `2t` (scale) and `2t + 1` (log ratio), its
//!   box's top and left draws 20 and 21; the flip uses draw 63, so the flip never depends on how
//!   many tries the crop took.

use sha2::{Digest, Sha256};

/// Largest crop side a request may name: the model's input is at most this (a larger `size` is
/// refused before the model is even looked up).
pub(crate) const MAX_SIZE: u32 = 8192;

/// Bounds on an aspect ratio: `ratio` outside them is refused (torchvision takes any positive
/// pair, but a ratio of 1e-9 places only degenerate boxes).
const MIN_RATIO: f64 = 1e-3;
const MAX_RATIO: f64 = 1e3;

/// torchvision's tries before its centre-crop fallback.
const TRIES: u64 = 10;
const TOP_DRAW: u64 = 20;
const LEFT_DRAW: u64 = 21;
const FLIP_DRAW: u64 = 63;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const DOMAIN: &[u8] = b"tensorgate-augment-v1";

/// `RandomResizedCrop`'s parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResizedCrop {
    /// The output size `[height, width]` the request named, if it did.
    pub size: Option<[u32; 2]>,
    pub scale: (f64, f64),
    pub ratio: (f64, f64),
}

/// The transforms a request names, in the order they apply (a crop, then a flip).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Augment {
    pub crop: Option<ResizedCrop>,
    /// `RandomHorizontalFlip`'s probability.
    pub flip: Option<f64>,
    pub seed: u64,
}

// Parameters are finite and checked on parse: equality is total.
impl Eq for Augment {}

impl std::hash::Hash for Augment {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.to_string().hash(state);
        self.seed.hash(state);
    }
}

/// A crop box in the decoded image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    pub top: u32,
    pub left: u32,
    pub height: u32,
    pub width: u32,
}

/// What one sample drew: its crop box (with a crop) and whether it is flipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drawn {
    pub crop: Option<CropBox>,
    pub flip: bool,
}

impl std::fmt::Display for Drawn {
    /// `top,left,height,width,flip` (the box empty without a crop): the response's
    /// `x-tensorgate-augmented`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(b) = self.crop {
            write!(f, "{},{},{},{},", b.top, b.left, b.height, b.width)?;
        } else {
            f.write_str(",,,,")?;
        }
        write!(f, "{}", u8::from(self.flip))
    }
}

impl Augment {
    /// Reads the `augment` and `seed` fields (both or neither).
    ///
    /// # Errors
    /// The field and what is wrong with it.
    pub(crate) fn parse(augment: Option<&str>, seed: Option<&str>) -> Result<Option<Self>, (&'static str, String)> {
        let (augment, seed) = match (augment, seed) {
            (None, None) => return Ok(None),
            (Some(_), None) => {
                return Err(("seed", "is required with augment: a whole number from 0 to 2^64-1".into()));
            }
            (None, Some(_)) => return Err(("augment", "is required with seed".into())),
            (Some(a), Some(s)) => (a, s),
        };
        let seed =
            seed.parse::<u64>().map_err(|_| ("seed", format!("{seed:?} is not a whole number from 0 to 2^64-1")))?;
        let (mut crop, mut flip) = (None, None);
        // Spaces around transforms and arguments are allowed (`A; B(p = 0.5)`).
        for op in augment.split(';').map(str::trim) {
            let (name, args) = match op.split_once('(') {
                Some((name, rest)) => {
                    let args = rest.strip_suffix(')').ok_or_else(|| ("augment", format!("{op:?} lacks its ')'")))?;
                    (name.trim(), args)
                }
                None => (op, ""),
            };
            match name {
                "RandomResizedCrop" if crop.is_none() && flip.is_none() => crop = Some(ResizedCrop::parse(args)?),
                "RandomHorizontalFlip" if flip.is_none() => flip = Some(flip_p(args)?),
                "RandomResizedCrop" | "RandomHorizontalFlip" => {
                    return Err(("augment", format!("{name} is given twice or out of order (a crop, then a flip)")));
                }
                _ => {
                    return Err((
                        "augment",
                        format!("{name:?} is not a transform here (RandomResizedCrop, RandomHorizontalFlip)"),
                    ));
                }
            }
        }
        Ok(Some(Self { crop, flip, seed }))
    }

    /// What sample `key` of an image `width` x `height` draws.
    #[must_use]
    pub fn draw(&self, key: &str, width: u32, height: u32) -> Drawn {
        let draws = Draws::new(self.seed, key);
        Drawn {
            crop: self.crop.map(|c| c.place(&draws, width, height)),
            flip: self.flip.is_some_and(|p| draws.uniform(FLIP_DRAW) < p),
        }
    }
}

impl std::fmt::Display for Augment {
    /// The canonical `augment` field (the seed is its own field): what the cache key and a
    /// forwarded request carry.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut sep = "";
        if let Some(c) = self.crop {
            write!(f, "RandomResizedCrop(")?;
            if let Some([h, w]) = c.size {
                write!(f, "size={h}:{w},")?;
            }
            write!(f, "scale={}:{},ratio={}:{})", c.scale.0, c.scale.1, c.ratio.0, c.ratio.1)?;
            sep = ";";
        }
        if let Some(p) = self.flip {
            write!(f, "{sep}RandomHorizontalFlip(p={p})")?;
        }
        Ok(())
    }
}

fn args(args: &str) -> impl Iterator<Item = Result<(&str, &str), (&'static str, String)>> {
    args.split(',').map(str::trim).filter(|a| !a.is_empty()).map(|a| {
        a.split_once('=')
            .map(|(k, v)| (k.trim(), v.trim()))
            .ok_or_else(|| ("augment", format!("{a:?} is not name=value")))
    })
}

fn number(name: &str, v: &str) -> Result<f64, (&'static str, String)> {
    v.parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| ("augment", format!("{name}={v:?} is not a number")))
}

fn range(name: &str, v: &str) -> Result<(f64, f64), (&'static str, String)> {
    let (a, b) = v.split_once(':').ok_or_else(|| ("augment", format!("{name}={v:?} is not <low>:<high>")))?;
    Ok((number(name, a.trim())?, number(name, b.trim())?))
}

fn flip_p(a: &str) -> Result<f64, (&'static str, String)> {
    let mut p = 0.5;
    for arg in args(a) {
        match arg? {
            ("p", v) => p = number("p", v)?,
            (k, _) => return Err(("augment", format!("RandomHorizontalFlip has no argument {k:?} (p)"))),
        }
    }
    if !(0.0..=1.0).contains(&p) {
        return Err(("augment", format!("RandomHorizontalFlip p={p} is not a probability (0 to 1)")));
    }
    Ok(p)
}

impl ResizedCrop {
    fn parse(a: &str) -> Result<Self, (&'static str, String)> {
        let mut c = Self { size: None, scale: (0.08, 1.0), ratio: (3.0 / 4.0, 4.0 / 3.0) };
        for arg in args(a) {
            match arg? {
                ("size", v) => c.size = Some(size(v)?),
                ("scale", v) => c.scale = range("scale", v)?,
                ("ratio", v) => c.ratio = range("ratio", v)?,
                (k, _) => {
                    return Err(("augment", format!("RandomResizedCrop has no argument {k:?} (size, scale, ratio)")));
                }
            }
        }
        let (s0, s1) = c.scale;
        if !(s0 > 0.0 && s0 <= s1 && s1 <= 1.0) {
            return Err(("augment", format!("RandomResizedCrop scale={s0}:{s1} is not 0 < low <= high <= 1")));
        }
        let (r0, r1) = c.ratio;
        if !(MIN_RATIO <= r0 && r0 <= r1 && r1 <= MAX_RATIO) {
            return Err((
                "augment",
                format!("RandomResizedCrop ratio={r0}:{r1} is not {MIN_RATIO} <= low <= high <= {MAX_RATIO}"),
            ));
        }
        Ok(c)
    }

    /// torchvision's `RandomResizedCrop.get_params` on an image `width` x `height`, with this
    /// module's draws: ten tries of a random area and aspect ratio, then the centre crop of the
    /// largest box within `ratio`.
    fn place(&self, draws: &Draws, width: u32, height: u32) -> CropBox {
        let (w_img, h_img) = (f64::from(width), f64::from(height));
        let area = w_img * h_img;
        let (log0, log1) = (self.ratio.0.ln(), self.ratio.1.ln());
        for t in 0..TRIES {
            let target = area * draws.uniform_in(2 * t, self.scale);
            let aspect = draws.uniform_in(2 * t + 1, (log0, log1)).exp();
            let w = (target * aspect).sqrt().round_ties_even();
            let h = (target / aspect).sqrt().round_ties_even();
            if 0.0 < w && w <= w_img && 0.0 < h && h <= h_img {
                let (w, h) = (w as u32, h as u32);
                let top = draws.below(TOP_DRAW, u64::from(height - h) + 1) as u32;
                let left = draws.below(LEFT_DRAW, u64::from(width - w) + 1) as u32;
                return CropBox { top, left, height: h, width: w };
            }
        }
        let in_ratio = w_img / h_img;
        let (w, h) = if in_ratio < self.ratio.0 {
            (width, ((w_img / self.ratio.0).round_ties_even() as u32).min(height))
        } else if in_ratio > self.ratio.1 {
            (((h_img * self.ratio.1).round_ties_even() as u32).min(width), height)
        } else {
            (width, height)
        };
        CropBox { top: (height - h) / 2, left: (width - w) / 2, height: h, width: w }
    }
}

fn size(v: &str) -> Result<[u32; 2], (&'static str, String)> {
    let side = |s: &str| s.trim().parse::<u32>().ok().filter(|n| (1..=MAX_SIZE).contains(n));
    let got = match v.split_once(':') {
        Some((h, w)) => side(h).zip(side(w)).map(|(h, w)| [h, w]),
        None => side(v).map(|s| [s, s]),
    };
    got.ok_or_else(|| {
        ("augment", format!("RandomResizedCrop size={v:?} is not <side> or <h>:<w>, each 1 to {MAX_SIZE}"))
    })
}

/// One sample's counter-based stream of draws.
struct Draws(u64);

impl Draws {
    fn new(seed: u64, key: &str) -> Self {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        h.update([0]);
        h.update(seed.to_string().as_bytes());
        h.update([0]);
        h.update(key.as_bytes());
        let digest = h.finalize();
        Self(u64::from_be_bytes(digest[..8].try_into().expect("8 bytes")))
    }

    fn draw(&self, n: u64) -> u64 {
        let mut z = self.0.wrapping_add((n + 1).wrapping_mul(GOLDEN));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&self, n: u64) -> f64 {
        (self.draw(n) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn uniform_in(&self, n: u64, (low, high): (f64, f64)) -> f64 {
        low + (high - low) * self.uniform(n)
    }

    fn below(&self, n: u64, m: u64) -> u64 {
        ((u128::from(self.draw(n)) * u128::from(m)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aug(a: &str, seed: u64) -> Augment {
        Augment::parse(Some(a), Some(&seed.to_string())).expect("valid").expect("some")
    }

    #[test]
    fn defaults_are_torchvisions_and_the_canonical_form_reads_back() {
        let a = aug("RandomResizedCrop;RandomHorizontalFlip", 7);
        let c = a.crop.expect("a crop");
        assert_eq!((c.size, c.scale, c.ratio, a.flip), (None, (0.08, 1.0), (0.75, 4.0 / 3.0), Some(0.5)));
        let again = aug(&a.to_string(), 7);
        assert_eq!(again, a);
        assert_eq!(aug(" RandomResizedCrop ( scale = 0.08 : 1 ) ;  RandomHorizontalFlip( p = 0.5 )", 7), a);
        let sized = aug("RandomResizedCrop(size=224:192,scale=0.5:1)", 1);
        assert_eq!(aug(&sized.to_string(), 1), sized);
        assert_eq!(aug("RandomHorizontalFlip(p=1)", 0).to_string(), "RandomHorizontalFlip(p=1)");
    }

    #[test]
    fn hostile_values_are_refused_naming_the_field() {
        for (a, s, field) in [
            ("RandomResizedCrop(scale=0:1)", "1", "augment"),
            ("RandomResizedCrop(scale=0.5:1.5)", "1", "augment"),
            ("RandomResizedCrop(scale=0.9:0.1)", "1", "augment"),
            ("RandomResizedCrop(ratio=0:1)", "1", "augment"),
            ("RandomResizedCrop(ratio=nan:1)", "1", "augment"),
            ("RandomResizedCrop(size=100000)", "1", "augment"),
            ("RandomResizedCrop(colour=1)", "1", "augment"),
            ("RandomHorizontalFlip(p=2)", "1", "augment"),
            ("RandomHorizontalFlip;RandomResizedCrop", "1", "augment"),
            ("RandomHorizontalFlip;RandomHorizontalFlip", "1", "augment"),
            ("ColorJitter", "1", "augment"),
            ("RandomResizedCrop(scale=0.1:1", "1", "augment"),
            ("RandomResizedCrop", "abc", "seed"),
            ("RandomResizedCrop", "-1", "seed"),
            ("RandomResizedCrop", "1.5", "seed"),
            ("RandomResizedCrop", "18446744073709551616", "seed"),
        ] {
            match Augment::parse(Some(a), Some(s)) {
                Err((f, _)) => assert_eq!(f, field, "{a} {s}"),
                Ok(got) => panic!("{a} {s}: {got:?}"),
            }
        }
        assert_eq!(Augment::parse(Some("RandomResizedCrop"), None).map_err(|e| e.0), Err("seed"));
        assert_eq!(Augment::parse(None, Some("1")).map_err(|e| e.0), Err("augment"));
        assert_eq!(Augment::parse(None, None), Ok(None));
    }

    #[test]
    fn boxes_lie_in_the_image_and_follow_the_seed_and_key() {
        let a = aug("RandomResizedCrop;RandomHorizontalFlip", 42);
        let mut flips = 0;
        for (i, (w, h)) in
            [(1, 1), (64, 2000), (2000, 64), (500, 375), (3, 1000)].into_iter().cycle().take(500).enumerate()
        {
            let key = format!("img/{i}.jpg");
            let d = a.draw(&key, w, h);
            let b = d.crop.expect("a box");
            assert!(
                b.width >= 1 && b.height >= 1 && b.left + b.width <= w && b.top + b.height <= h,
                "{b:?} in {w}x{h}"
            );
            assert_eq!(a.draw(&key, w, h), d, "the same seed and key draw the same");
            flips += usize::from(d.flip);
        }
        assert!((200..300).contains(&flips), "p=0.5 flips about half: {flips}");
        let other = aug("RandomResizedCrop;RandomHorizontalFlip", 43);
        let differ = (0..50).filter(|i| other.draw(&format!("k{i}"), 500, 375) != a.draw(&format!("k{i}"), 500, 375));
        assert!(differ.count() > 40);
    }

    #[test]
    fn an_extreme_image_falls_back_to_torchvisions_centre_crop() {
        // A 1 x 1000 strip admits no box of ratio 3/4 to 4/3 in ten tries: the fallback is the
        // centre crop of width 1 and height round(1 / (3/4)) = 1.
        let a = aug("RandomResizedCrop", 5);
        assert_eq!(a.draw("k", 1, 1000).crop, Some(CropBox { top: 499, left: 0, height: 1, width: 1 }));
        assert_eq!(a.draw("k", 1000, 1).crop, Some(CropBox { top: 0, left: 499, height: 1, width: 1 }));
    }

    #[test]
    fn the_generator_matches_its_restatement() {
        // The same values as the Python client's (`clients/python/tests/test_augment.py`).
        let d = Draws::new(0, "k");
        assert_eq!(
            (0..3).map(|n| d.draw(n)).collect::<Vec<_>>(),
            [0x142b_ed63_64d6_dee5, 0x55ce_b35f_f5aa_4bda, 0xf3eb_a217_4538_6b34]
        );
        let a = aug("RandomResizedCrop;RandomHorizontalFlip", 42);
        let b = |top, left, height, width| Some(CropBox { top, left, height, width });
        assert_eq!(a.draw("img/0.jpg", 500, 375), Drawn { crop: b(166, 253, 179, 218), flip: true });
        assert_eq!(a.draw("a", 64, 2000), Drawn { crop: b(957, 0, 85, 64), flip: false });
        assert_eq!(a.draw("b", 2000, 64), Drawn { crop: b(0, 957, 64, 85), flip: false });
        assert_eq!(a.draw("img/0.jpg", 500, 375).to_string(), "166,253,179,218,1");
        assert_eq!(aug("RandomHorizontalFlip", 42).draw("k", 5, 5).to_string(), ",,,,1");
    }
}
