//! Image preprocessing per manifest: decode (JPEG, PNG), resize the shorter side, center-crop,
//! scale, normalize with mean/std, reorder channels, lay out as NCHW or NHWC. Pure and CPU-bound:
//! callers run it on blocking threads, never on tokio workers.
//!
//! The conventions follow torchvision's `Resize(int)` + `CenterCrop`, which the independent
//! reference (PIL + numpy, `tests/python/test_pushdown.py`) mirrors:
//! - the shorter side becomes `resize_shorter`, the longer `floor(resize_shorter * long / short)`;
//! - the resize filter is bilinear *with antialiasing*: a triangle kernel stretched by the scale
//!   factor when shrinking, applied horizontally then vertically, in fixed point with 22-bit
//!   coefficients and rounding to 8 bits after each pass. That is exactly PIL's `Image.BILINEAR`
//!   (Pillow's `Resample.c`), reproduced in [`resize_bilinear`] so that outputs equal the PIL
//!   reference bit for bit. `fast_image_resize` was measured first: it uses 15-bit coefficients
//!   (for SIMD), which moves a share of pixels by one level and put the ResNet-50-thin features
//!   1.5e-2 (relative L2) away from the reference, above the 1e-3 contract;
//! - the crop offset is `round((size - crop) / 2)` with ties to even (Python's `round`).
//!
//! - decoding to RGB, as PIL's `convert("RGB")` does for every mode, is [`decode`]'s job. JPEG is
//!   decoded by libjpeg-turbo's decoder (through `mozjpeg`, islow IDCT, fancy chroma upsampling),
//!   the decoder PIL uses; `zune-jpeg` (the `image` crate's) was measured first and differs from it
//!   by 2e-3 (4:4:4) to 1.6e-2 (4:2:0) relative L2 after normalization.
//!
//! Images whose header declares more than `max_pixels`, or whose resized copy would be larger,
//! are refused before any pixel is decoded.
//!
//! A sample with random augmentation ([`super::augment`]) is cropped to its drawn box and that
//! box resized to the model's input size, as torchvision's `resized_crop` does on a PIL image
//! (`Image.crop`, then `Image.resize` with `BILINEAR`), instead of the shorter-side resize and
//! centre crop; a drawn flip mirrors the result (`hflip`).

use super::augment::{CropBox, Drawn};
use super::decode;
use super::error::PushdownError;
use super::manifest::{Channels, Layout, Preprocess};

/// Largest image (in pixels, from its header) decoded by default: 40 MP covers the largest
/// camera images in common datasets while keeping one decode under ~160 MiB of RGBA.
pub(crate) const DEFAULT_MAX_PIXELS: u64 = 40_000_000;

/// Most pixels one request decodes and resamples, all its images together: 4 G pixels is a
/// 10,000-sample shard of ImageNet-size photos (500 x 375, resized to 341 x 256) with room to
/// spare, and about half a minute of one core; a shard of tiny files that each claim 40 M pixels
/// would otherwise buy minutes of CPU with a 64 MiB object.
pub(crate) const DEFAULT_MAX_REQUEST_PIXELS: u64 = 4 << 30;

/// Whether the bytes start like a JPEG or PNG file.
#[must_use]
pub(crate) fn is_image(bytes: &[u8]) -> bool {
    decode::sniff(bytes).is_some()
}

fn bad(msg: impl Into<String>) -> PushdownError {
    PushdownError::BadInput(msg.into())
}

/// What preprocessing an image will cost, from its header alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Pixels decoded and resized (the image and its resized copy): the CPU it buys.
    pub(crate) pixels: u64,
    /// Transient bytes held at the peak (the decoder's buffer, the RGB image, the resampler's
    /// horizontal pass and the resized copy): what the memory governor reserves per image sample.
    pub scratch_bytes: u64,
}

/// The [`Cost`] of preprocessing `bytes`; zero if the header is unreadable or the image or its
/// resized copy is larger than `max_pixels` (preprocessing then fails cheaply, with its own error,
/// before any buffer is allocated).
#[must_use]
pub fn cost(bytes: &[u8], resize_shorter: Option<u32>, max_pixels: u64) -> Cost {
    decode::header(bytes).map(|head| head_cost(&head, resize_shorter, None, max_pixels)).unwrap_or_default()
}

/// [`cost`] from a read header, for a sample that drew `drawn` ([`super::augment`]): a drawn
/// crop box is copied out and resized to `[height, width]`.
pub(crate) fn head_cost(
    head: &decode::Header,
    resize_shorter: Option<u32>,
    drawn: Option<(CropBox, [u32; 2])>,
    max_pixels: u64,
) -> Cost {
    let cost = || -> Result<Cost, PushdownError> {
        if let Some((b, [ch, cw])) = drawn {
            checked_sizes(head, None, max_pixels)?;
            let (bw, bh, cw, ch) = (u64::from(b.width), u64::from(b.height), u64::from(cw), u64::from(ch));
            return Ok(Cost {
                pixels: head.pixels() + bw * bh + cw * ch,
                scratch_bytes: head.decode_bytes() + 3 * bw * bh + 3 * cw * (bh + ch),
            });
        }
        let resized = checked_sizes(head, resize_shorter, max_pixels)?;
        let (nw, nh) = resized.map_or((0, 0), |(w, h)| (u64::from(w), u64::from(h)));
        Ok(Cost {
            pixels: head.pixels() + nw * nh,
            scratch_bytes: head.decode_bytes() + 3 * nw * (u64::from(head.height) + nh),
        })
    };
    cost().unwrap_or_default()
}

/// Checks the image and its resized copy against `max_pixels`; the resized size, if any.
fn checked_sizes(
    head: &decode::Header,
    resize_shorter: Option<u32>,
    max_pixels: u64,
) -> Result<Option<(u32, u32)>, PushdownError> {
    let (w, h) = (head.width, head.height);
    if head.pixels() > max_pixels {
        return Err(bad(format!(
            "image is {w}x{h}, more than the limit of {max_pixels} pixels (pushdown.max_image_pixels)"
        )));
    }
    let Some(s) = resize_shorter else { return Ok(None) };
    let (nw, nh) = resized_size(w, h, s);
    // A thin image resized by its shorter side grows by its aspect ratio: 1 x 65,535 at 256
    // is 4.3 G pixels. The resized copy obeys the same bound as the decoded image.
    if u64::from(nw) * u64::from(nh) > max_pixels {
        return Err(bad(format!(
            "image is {w}x{h}; resized to {nw}x{nh} it would exceed the limit of {max_pixels} pixels \
             (pushdown.max_image_pixels)"
        )));
    }
    Ok(Some((nw, nh)))
}

/// The output size of the shorter-side resize (torchvision's rule).
#[must_use]
pub fn resized_size(width: u32, height: u32, shorter: u32) -> (u32, u32) {
    if width <= height {
        (shorter, (u64::from(shorter) * u64::from(height) / u64::from(width.max(1))) as u32)
    } else {
        ((u64::from(shorter) * u64::from(width) / u64::from(height.max(1))) as u32, shorter)
    }
}

/// Most bytes of buffers kept between images and batches, all of a [`ScratchPool`]'s together.
/// Buffers above 128 KiB are fresh mappings (glibc's threshold, ADR 0005), and every image's
/// (decoded 563 kB for a 500 x 375 photo, resized across 335 kB, resized 200 kB, the model's
/// input 602 kB) and every batch's (16 such inputs: 9.6 MB) were mapped, faulted in page by page
/// and unmapped each time: with PP-LCNet at `pool` they took 90% of the gateway's page faults
/// (ADR 0023). 32 MiB keeps a batch of 16 and its inputs besides the decode buffers of two
/// cores. It is not part of `pushdown.memory_budget` (a buffer in use is, as its sample's
/// decoded input and batch copy, or its image's decode scratch) but of the process's fixed
/// overhead (the chart's `memoryOverheadBytes`); a buffer that would take the pool past it is
/// freed instead.
pub(crate) const SCRATCH_POOL_BYTES: usize = 32 << 20;

/// One image's decode and resize buffers and its input's, reused by the next image that takes
/// them.
#[derive(Debug, Default)]
pub struct Scratch {
    decoded: Vec<u8>,
    /// A drawn crop box's pixels, copied out of `decoded` ([`super::augment`]).
    cropped: Vec<u8>,
    across: Vec<u8>,
    resized: Vec<u8>,
    /// Becomes the image's input ([`image_to_input_with`] returns it); the engine gives it back
    /// after copying it into its batch ([`ScratchPool::give_floats`]).
    input: Vec<f32>,
}

impl Scratch {
    fn bytes(&self) -> usize {
        self.decoded.capacity()
            + self.cropped.capacity()
            + self.across.capacity()
            + self.resized.capacity()
            + floats_bytes(&self.input)
    }
}

fn floats_bytes(v: &Vec<f32>) -> usize {
    v.capacity() * std::mem::size_of::<f32>()
}

/// Buffers kept between images and batches, at most [`SCRATCH_POOL_BYTES`] in all. A
/// preprocessing thread takes a set for one image and gives it back after; an engine takes its
/// batch buffer and gives it back after the run, with the inputs it copied. The lock is held only
/// to take or give, never while an image is decoded or a batch runs.
#[derive(Debug, Default)]
pub struct ScratchPool {
    kept: std::sync::Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    sets: Vec<Scratch>,
    floats: Vec<Vec<f32>>,
    bytes: usize,
}

impl ScratchPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A set of buffers for one image: the largest kept set (or new empty buffers), with a kept
    /// input buffer.
    #[must_use]
    pub fn take(&self) -> Scratch {
        let mut kept = self.lock();
        let largest = (0..kept.sets.len()).max_by_key(|&i| kept.sets[i].bytes());
        let mut set = largest.map(|i| kept.sets.swap_remove(i)).unwrap_or_default();
        // The smallest kept floats: batch buffers are larger than any one input.
        let smallest = (0..kept.floats.len()).min_by_key(|&i| kept.floats[i].capacity());
        if let (0, Some(i)) = (set.input.capacity(), smallest) {
            set.input = kept.floats.swap_remove(i);
        }
        kept.bytes -= set.bytes();
        set
    }

    /// Keeps `scratch` for a later image if the pool stays within [`SCRATCH_POOL_BYTES`].
    pub fn give(&self, scratch: Scratch) {
        let mut kept = self.lock();
        if kept.bytes + scratch.bytes() <= SCRATCH_POOL_BYTES {
            kept.bytes += scratch.bytes();
            kept.sets.push(scratch);
        }
    }

    /// An empty buffer for at least `len` values: a kept one that holds them, or a new one.
    #[must_use]
    pub(crate) fn take_floats(&self, len: usize) -> Vec<f32> {
        let mut kept = self.lock();
        match kept.floats.iter().position(|v| v.capacity() >= len) {
            Some(i) => {
                let v = kept.floats.swap_remove(i);
                kept.bytes -= floats_bytes(&v);
                v
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `v`'s memory (emptied) if the pool stays within [`SCRATCH_POOL_BYTES`].
    pub fn give_floats(&self, mut v: Vec<f32>) {
        let mut kept = self.lock();
        if v.capacity() > 0 && kept.bytes + floats_bytes(&v) <= SCRATCH_POOL_BYTES {
            v.clear();
            kept.bytes += floats_bytes(&v);
            kept.floats.push(v);
        }
    }

    /// Bytes kept now.
    #[must_use]
    pub(crate) fn kept_bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// Decodes and preprocesses one image into the model's input layout.
///
/// # Errors
/// Corrupt, truncated, oversized or too-small images.
pub fn image_to_input(
    bytes: &[u8],
    p: &Preprocess,
    layout: Layout,
    max_pixels: u64,
) -> Result<Vec<f32>, PushdownError> {
    image_to_input_with(bytes, p, layout, max_pixels, None, &mut Scratch::default())
}

/// [`image_to_input`] with its decode and resize buffers in `scratch` (kept there for the next
/// image: [`ScratchPool`]), and what the sample drew if it is augmented ([`super::augment`]).
///
/// # Errors
/// As [`image_to_input`], and a drawn box outside the image.
pub fn image_to_input_with(
    bytes: &[u8],
    p: &Preprocess,
    layout: Layout,
    max_pixels: u64,
    drawn: Option<Drawn>,
    scratch: &mut Scratch,
) -> Result<Vec<f32>, PushdownError> {
    // Every size is checked from the header, before a pixel is decoded or resampled.
    let head = decode::header(bytes)?;
    let boxed = drawn.and_then(|d| d.crop);
    if let Some(b) = boxed
        && (b.width == 0 || b.height == 0 || b.left + b.width > head.width || b.top + b.height > head.height)
    {
        return Err(bad(format!("crop box {b:?} is not inside the {}x{} image", head.width, head.height)));
    }
    let resized = match boxed {
        Some(_) => checked_sizes(&head, None, max_pixels)?.or(Some((p.crop[1], p.crop[0]))),
        None => checked_sizes(&head, p.resize_shorter, max_pixels)?,
    };
    decode::decode_rgb_into(bytes, &head, &mut scratch.decoded)?;
    let (mut cur_w, mut cur_h) = (head.width, head.height);
    let mut pixels = scratch.decoded.as_slice();
    if let Some(b) = boxed {
        let (row, start, width) = (cur_w as usize * 3, b.left as usize * 3, b.width as usize * 3);
        scratch.cropped.clear();
        for y in b.top as usize..(b.top + b.height) as usize {
            scratch.cropped.extend_from_slice(&pixels[y * row + start..y * row + start + width]);
        }
        pixels = &scratch.cropped;
        (cur_w, cur_h) = (b.width, b.height);
    }
    if let Some((nw, nh)) = resized {
        let (w, h, nw, nh) = (cur_w as usize, cur_h as usize, nw as usize, nh as usize);
        resize_bilinear_into(pixels, (w, h, nw, nh), &mut scratch.across, &mut scratch.resized);
        pixels = match (nw == w, nh == h) {
            (true, true) => pixels,
            (false, true) => &scratch.across,
            (_, false) => &scratch.resized,
        };
        (cur_w, cur_h) = (nw as u32, nh as u32);
    }
    let [ch, cw] = p.crop;
    if cur_w < cw || cur_h < ch {
        return Err(bad(format!("image is {cur_w}x{cur_h} after resizing, smaller than the {cw}x{ch} crop")));
    }
    let top = (f64::from(cur_h - ch) / 2.0).round_ties_even() as usize;
    let left = (f64::from(cur_w - cw) / 2.0).round_ties_even() as usize;
    let (ch, cw, row) = (ch as usize, cw as usize, cur_w as usize);
    let flip = drawn.is_some_and(|d| d.flip);
    let order: [usize; 3] = match p.channels {
        Channels::Rgb => [0, 1, 2],
        Channels::Bgr => [2, 1, 0],
    };
    // Every value is written below; a kept buffer's old values are only overwritten.
    let mut out = std::mem::take(&mut scratch.input);
    out.clear();
    out.resize(3 * ch * cw, 0.0);
    for y in 0..ch {
        for x in 0..cw {
            let sx = if flip { cw - 1 - x } else { x };
            let px = ((top + y) * row + left + sx) * 3;
            for (c, &src_c) in order.iter().enumerate() {
                let v = (f32::from(pixels[px + src_c]) * p.scale - p.mean[c]) / p.std[c];
                let i = match layout {
                    Layout::Nchw => c * ch * cw + y * cw + x,
                    Layout::Nhwc => (y * cw + x) * 3 + c,
                };
                out[i] = v;
            }
        }
    }
    Ok(out)
}

/// Fixed-point precision of resampling coefficients (Pillow's `PRECISION_BITS`).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Per output position: first source index, and the fixed-point weights of the sources from there.
fn coefficients(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    // The triangle (bilinear) filter has support 1, stretched by the downscaling factor.
    let support = filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let weights: Vec<f64> =
                (xmin..xmax).map(|x| (1.0 - ((x as f64 - center + 0.5) / filterscale).abs()).max(0.0)).collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|w| {
                    let k = if total == 0.0 { *w } else { w / total } * f64::from(1u32 << PRECISION_BITS);
                    (if k < 0.0 { k - 0.5 } else { k + 0.5 }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

/// Rounding offset of every accumulator (Pillow starts each sum at half of the last bit).
const HALF: i32 = 1 << (PRECISION_BITS - 1);

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// PIL-exact antialiased bilinear resize of packed RGB8 (horizontal pass, then vertical, each
/// rounded to 8 bits as Pillow does).
///
/// The sums are Pillow's own `i32`s, and they cannot overflow: the triangle filter's weights are
/// never negative, so a sum is at most `HALF + 255 x (2^22 + taps / 2)`, under 2^31 for any
/// number of taps below four million. The vertical pass runs row by row over contiguous `i32`
/// accumulators, which the compiler turns into vector instructions; the horizontal pass keeps a
/// pixel's three channels in registers. [`reference_resize_bilinear`] is the same arithmetic in
/// its plain form: the tests' oracle and `benches/resize.rs`' baseline.
#[must_use]
pub fn resize_bilinear(src: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    let (mut across, mut out) = (Vec::new(), Vec::new());
    resize_bilinear_into(src, (w, h, nw, nh), &mut across, &mut out);
    match (nw == w, nh == h) {
        (true, true) => src.to_vec(),
        (false, true) => across,
        (_, false) => out,
    }
}

/// [`resize_bilinear`] into kept buffers: the horizontal pass (when the width changes) into
/// `across`, the vertical pass (when the height changes) into `out`. The result is in `out` when
/// the height changed, else in `across` when the width did, else it is `src`.
fn resize_bilinear_into(
    src: &[u8],
    (w, h, nw, nh): (usize, usize, usize, usize),
    across: &mut Vec<u8>,
    out: &mut Vec<u8>,
) {
    if nw != w {
        horizontal_pass(src, w, nw, across);
    }
    if nh != h {
        vertical_pass(if nw == w { src } else { across }, nw * 3, h, nh, out);
    }
}

/// `buf` resized to `len` bytes for a pass to write every one of (only its growth is zeroed).
fn sized(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    } else {
        buf.truncate(len);
    }
    buf
}

fn horizontal_pass(src: &[u8], w: usize, nw: usize, out: &mut Vec<u8>) {
    let coeffs = coefficients(w, nw);
    let out = sized(out, src.len() / w * nw);
    // A fixed number of taps lets the compiler unroll the loop over them; the photo downscales
    // of the bundled models need at most 7 (a factor of 3).
    match coeffs.iter().map(|(_, k)| k.len()).max().unwrap_or(0) {
        1 => horizontal_fixed::<1>(src, w, &coeffs, out),
        2 => horizontal_fixed::<2>(src, w, &coeffs, out),
        3 => horizontal_fixed::<3>(src, w, &coeffs, out),
        4 => horizontal_fixed::<4>(src, w, &coeffs, out),
        5 => horizontal_fixed::<5>(src, w, &coeffs, out),
        6 => horizontal_fixed::<6>(src, w, &coeffs, out),
        7 => horizontal_fixed::<7>(src, w, &coeffs, out),
        8 => horizontal_fixed::<8>(src, w, &coeffs, out),
        _ => horizontal_any(src, w, &coeffs, out),
    }
}

/// The horizontal pass with every output's taps padded with zero weights to `N` (a zero weight
/// adds exactly nothing), the window moved left where it would pass the row's end.
fn horizontal_fixed<const N: usize>(src: &[u8], w: usize, coeffs: &[(usize, Vec<i32>)], out: &mut [u8]) {
    let table: Vec<(usize, [i32; N])> = coeffs
        .iter()
        .map(|(xmin, k)| {
            let start = (*xmin).min(w - N);
            let mut padded = [0i32; N];
            padded[xmin - start..xmin - start + k.len()].copy_from_slice(k);
            (start, padded)
        })
        .collect();
    let nw = coeffs.len();
    for (row, out_row) in src.chunks_exact(w * 3).zip(out.chunks_exact_mut(nw * 3)) {
        for ((start, k), pixel) in table.iter().zip(out_row.chunks_exact_mut(3)) {
            let taps = &row[start * 3..(start + N) * 3];
            let (mut r, mut g, mut b) = (HALF, HALF, HALF);
            for i in 0..N {
                r += i32::from(taps[3 * i]) * k[i];
                g += i32::from(taps[3 * i + 1]) * k[i];
                b += i32::from(taps[3 * i + 2]) * k[i];
            }
            pixel.copy_from_slice(&[clip8(r), clip8(g), clip8(b)]);
        }
    }
}

/// The horizontal pass for any number of taps.
fn horizontal_any(src: &[u8], w: usize, coeffs: &[(usize, Vec<i32>)], out: &mut [u8]) {
    let nw = coeffs.len();
    for (row, out_row) in src.chunks_exact(w * 3).zip(out.chunks_exact_mut(nw * 3)) {
        for ((xmin, k), pixel) in coeffs.iter().zip(out_row.chunks_exact_mut(3)) {
            let taps = &row[xmin * 3..(xmin + k.len()) * 3];
            let (mut r, mut g, mut b) = (HALF, HALF, HALF);
            for (&kv, p) in k.iter().zip(taps.chunks_exact(3)) {
                r += i32::from(p[0]) * kv;
                g += i32::from(p[1]) * kv;
                b += i32::from(p[2]) * kv;
            }
            pixel.copy_from_slice(&[clip8(r), clip8(g), clip8(b)]);
        }
    }
}

fn vertical_pass(src: &[u8], stride: usize, h: usize, nh: usize, out: &mut Vec<u8>) {
    let coeffs = coefficients(h, nh);
    let out = sized(out, stride * nh);
    let mut acc = vec![0i32; stride];
    for ((ymin, k), out_row) in coeffs.iter().zip(out.chunks_exact_mut(stride)) {
        acc.fill(HALF);
        for (&kv, row) in k.iter().zip(src[ymin * stride..].chunks_exact(stride)) {
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += i32::from(p) * kv;
            }
        }
        for (o, &a) in out_row.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
}

/// [`resize_bilinear`]'s arithmetic in its plain form (one output byte at a time, `i64` sums):
/// the oracle the tests hold the fast form to, and the baseline of `benches/resize.rs`.
#[doc(hidden)]
#[must_use]
pub fn reference_resize_bilinear(src: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    let clip = |acc: i64| (acc >> PRECISION_BITS).clamp(0, 255) as u8;
    let half = i64::from(HALF);
    let horizontal = if nw == w {
        src.to_vec()
    } else {
        let coeffs = coefficients(w, nw);
        let mut out = vec![0u8; nw * h * 3];
        for y in 0..h {
            for (xx, (xmin, k)) in coeffs.iter().enumerate() {
                for c in 0..3 {
                    let acc = k
                        .iter()
                        .enumerate()
                        .fold(half, |acc, (i, &kv)| acc + i64::from(src[(y * w + xmin + i) * 3 + c]) * i64::from(kv));
                    out[(y * nw + xx) * 3 + c] = clip(acc);
                }
            }
        }
        out
    };
    if nh == h {
        return horizontal;
    }
    let coeffs = coefficients(h, nh);
    let mut out = vec![0u8; nw * nh * 3];
    for (yy, (ymin, k)) in coeffs.iter().enumerate() {
        for x in 0..nw * 3 {
            let acc = k
                .iter()
                .enumerate()
                .fold(half, |acc, (i, &kv)| acc + i64::from(horizontal[(ymin + i) * nw * 3 + x]) * i64::from(kv));
            out[yy * nw * 3 + x] = clip(acc);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let rgb: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8]))
            .collect();
        crate::demo::png_rgb8(w, h, &rgb).expect("encode")
    }

    fn plain(crop: u32) -> Preprocess {
        Preprocess {
            resize_shorter: None,
            crop: [crop, crop],
            scale: 1.0,
            mean: [0.0; 3],
            std: [1.0; 3],
            channels: Channels::Rgb,
        }
    }

    #[test]
    fn thin_images_are_refused_before_their_resized_copy_exists() {
        let p = Preprocess { resize_shorter: Some(256), ..plain(224) };
        // 1 x 65,535 (decodes to 64 K pixels) would resize to 256 x 16,776,960.
        let thin = png(1, 65_535);
        // Reaching the resampler would abort the process on the 12.9 GB allocation.
        let e = image_to_input(&thin, &p, Layout::Nchw, DEFAULT_MAX_PIXELS).expect_err("refused");
        assert!(e.to_string().contains("256x16776960"), "{e}");
        assert_eq!(cost(&thin, Some(256), DEFAULT_MAX_PIXELS).scratch_bytes, 0);
        // An ordinary image counts its decoded and resized copies.
        // An ordinary image counts the decoder's buffer (an RGBA bound for a PNG), its RGB copy, the
        // horizontal pass (512 x 32) and the resized copy (512 x 256).
        assert_eq!(
            cost(&png(64, 32), Some(256), DEFAULT_MAX_PIXELS).scratch_bytes,
            4 * 64 * 32 + 3 * 64 * 32 + 3 * 512 * 32 + 3 * 512 * 256
        );
    }

    fn jpeg(w: usize, h: usize) -> Vec<u8> {
        let rgb: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8]))
            .collect();
        let mut c = mozjpeg::Compress::new(mozjpeg::ColorSpace::JCS_RGB);
        c.set_size(w, h);
        let mut started = c.start_compress(Vec::new()).expect("start");
        started.write_scanlines(&rgb).expect("rows");
        started.finish().expect("finish")
    }

    #[test]
    fn kept_buffers_give_what_fresh_ones_give() {
        let p = Preprocess { resize_shorter: Some(32), ..plain(24) };
        let pool = ScratchPool::default();
        // The largest first, so that later images write into longer buffers than they fill; both
        // sides resized, neither (already 32 on the shorter side), and a PNG.
        let images = [jpeg(96, 64), jpeg(48, 40), jpeg(32, 80), png(40, 36), jpeg(80, 32), jpeg(96, 64)];
        for (i, image) in images.iter().enumerate() {
            let mut scratch = pool.take();
            let kept =
                image_to_input_with(image, &p, Layout::Nchw, DEFAULT_MAX_PIXELS, None, &mut scratch).expect("kept");
            pool.give(scratch);
            let fresh = image_to_input(image, &p, Layout::Nchw, DEFAULT_MAX_PIXELS).expect("fresh");
            assert_eq!(kept, fresh, "image {i}");
        }
        assert!(pool.kept_bytes() >= 3 * 96 * 64, "the buffers were kept: {}", pool.kept_bytes());
    }

    #[test]
    fn the_pool_keeps_at_most_its_bound() {
        let pool = ScratchPool::default();
        let big = || Scratch { decoded: Vec::with_capacity(SCRATCH_POOL_BYTES / 2), ..Scratch::default() };
        for _ in 0..3 {
            pool.give(big());
        }
        assert_eq!(pool.kept_bytes(), SCRATCH_POOL_BYTES, "two kept, the third freed");
        let mut taken = pool.take();
        assert_eq!(taken.bytes(), SCRATCH_POOL_BYTES / 2);
        taken.decoded.reserve(SCRATCH_POOL_BYTES);
        pool.give(taken);
        assert_eq!(pool.kept_bytes(), SCRATCH_POOL_BYTES / 2, "a set that grew past the bound is freed");
    }

    #[test]
    fn resize_matches_pil() {
        // 6x1 -> 3x1 and 1x6 -> 1x3 of the ramp [0, 50, 100, 150, 200, 250]: Pillow 11.3 gives
        // [36, 125, 214] (`Image.resize((3, 1), Image.BILINEAR)`; the stretched triangle reaches
        // into the neighbours of each output's two central sources).
        let src: Vec<u8> = [0u8, 50, 100, 150, 200, 250].iter().flat_map(|&v| [v, v, v]).collect();
        let out = resize_bilinear(&src, 6, 1, 3, 1);
        assert_eq!(out.iter().step_by(3).copied().collect::<Vec<_>>(), vec![36, 125, 214]);
        let col = resize_bilinear(&src, 1, 6, 1, 3);
        assert_eq!(col.iter().step_by(3).copied().collect::<Vec<_>>(), vec![36, 125, 214]);
        assert_eq!(resize_bilinear(&src, 6, 1, 6, 1), src, "same size is the identity");
    }

    #[test]
    fn the_fast_resampler_is_the_reference_arithmetic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        let sizes =
            [(500, 375, 341, 256), (375, 500, 256, 341), (7, 5, 3, 2), (3, 2, 7, 5), (1, 9, 1, 4), (640, 1, 2, 1)];
        let random: Vec<_> = (0..40)
            .map(|_| {
                let (w, h) = (rng.random_range(1..90), rng.random_range(1..90));
                (w, h, rng.random_range(1..2 * w), rng.random_range(1..2 * h))
            })
            .collect();
        for (w, h, nw, nh) in sizes.into_iter().chain(random) {
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.random()).collect();
            let fast = resize_bilinear(&src, w, h, nw, nh);
            assert_eq!(fast, reference_resize_bilinear(&src, w, h, nw, nh), "{w}x{h} -> {nw}x{nh}");
        }
        // The largest sums: all white, a 4000-tap downscale stays white (no i32 overflow).
        let white = vec![255u8; 4000 * 3];
        assert!(resize_bilinear(&white, 4000, 1, 1, 1).iter().all(|&v| v == 255));
        assert!(resize_bilinear(&white, 1, 4000, 1, 1).iter().all(|&v| v == 255));
    }

    #[test]
    fn sizes_follow_torchvision() {
        assert_eq!(resized_size(500, 375, 256), (341, 256));
        assert_eq!(resized_size(375, 500, 256), (256, 341));
        assert_eq!(resized_size(100, 100, 36), (36, 36));
    }

    #[test]
    fn crop_layout_and_channel_order() {
        let bytes = png(8, 6);
        assert!(is_image(&bytes));
        let nchw = image_to_input(&bytes, &plain(4), Layout::Nchw, 1_000).expect("nchw");
        // Crop of 4x4 from 8x6: top 1, left 2. Pixel (0,0) of the crop is source (2,1).
        assert_eq!(&nchw[..1], &[14.0]);
        assert_eq!(nchw[16], 5.0, "G channel plane starts at 16");
        let nhwc = image_to_input(&bytes, &plain(4), Layout::Nhwc, 1_000).expect("nhwc");
        assert_eq!(&nhwc[..3], &[14.0, 5.0, 9.0]);
        let bgr = Preprocess { channels: Channels::Bgr, ..plain(4) };
        assert_eq!(&image_to_input(&bytes, &bgr, Layout::Nhwc, 1_000).expect("bgr")[..3], &[9.0, 5.0, 14.0]);
    }

    #[test]
    fn bad_images_are_refused_before_decoding() {
        let bytes = png(100, 100);
        let e = image_to_input(&bytes, &plain(4), Layout::Nchw, 9_999).expect_err("too many pixels");
        assert!(e.to_string().contains("100x100"), "{e}");
        assert!(image_to_input(&bytes[..bytes.len() / 2], &plain(4), Layout::Nchw, 1_000_000).is_err(), "truncated");
        assert!(image_to_input(b"\xFF\xD8\xFFgarbage", &plain(4), Layout::Nchw, 1_000_000).is_err(), "truncated JPEG");
        assert!(
            image_to_input(b"\xFF\xD8\xFFgarbage\xFF\xD9", &plain(4), Layout::Nchw, 1_000_000).is_err(),
            "corrupt JPEG"
        );
        assert!(image_to_input(&png(3, 3), &plain(4), Layout::Nchw, 1_000).is_err(), "smaller than the crop");
    }
}
