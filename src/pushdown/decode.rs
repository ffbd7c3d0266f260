//! Image bytes to 8-bit RGB, as `PIL.Image.open(f).convert("RGB")` gives them (what torchvision's
//! default loader feeds a model in training). Pure and CPU-bound.
//!
//! The format is sniffed from the bytes, never from a name: a PNG stored as `x.jpg` decodes.
//! Every mode PIL opens is converted the way PIL converts it (Pillow 11.3, checked per mode in
//! `tests/python/test_pushdown.py::test_image_modes_match_pil`):
//! - JPEG (libjpeg-turbo, the decoder PIL uses): baseline and progressive; grayscale replicated;
//!   four-channel JPEGs (CMYK, and YCCK, which libjpeg turns into CMYK) read with Adobe's inverted
//!   polarity whether or not an Adobe marker says so (PIL always assumes it), then
//!   `R = (255 - K) - (C * (255 - K)) / 255`, rounded like Pillow's `MULDIV255`, and likewise G, B.
//! - PNG: palette expanded; alpha dropped (no compositing); grayscale replicated, 1-, 2- and 4-bit
//!   grey scaled to 8 bits; 16-bit RGB, RGBA and grey+alpha keep the high byte of each sample;
//!   16-bit grey (PIL's mode `I;16`) is *clamped* to 255, as PIL's `I;16` to `RGB` conversion does
//!   (most such images become white: the model saw the same in training).
//! - EXIF orientation is not applied (PIL's `open` and torchvision's loader do not either).
//!
//! [`header`] reads the size and the decoder's own buffer size from the header alone, so that
//! every buffer is bounded and reserved before a pixel is decoded.

use std::io::Cursor;

use super::error::{PushdownError, guarded};

/// The image formats pushdown decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ImageFormat {
    Jpeg,
    Png,
}

/// What the header says, before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) format: ImageFormat,
    pub(crate) width: u32,
    pub(crate) height: u32,
    /// Bytes of the decoder's output before conversion to RGB: 0 when the decoder writes RGB
    /// itself (most JPEGs), else an upper bound (e.g. 8 per pixel for 16-bit RGBA PNGs).
    pub(crate) native_bytes: u64,
}

impl Header {
    #[must_use]
    pub(crate) fn pixels(&self) -> u64 {
        u64::from(self.width) * u64::from(self.height)
    }

    /// Every byte decoding holds at its peak: the native buffer and the RGB image.
    #[must_use]
    pub(crate) fn decode_bytes(&self) -> u64 {
        self.native_bytes + 3 * self.pixels()
    }
}

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";
const JPEG_MAGIC: &[u8] = &[0xFF, 0xD8, 0xFF];

/// The format the bytes start like, if any.
#[must_use]
pub(crate) fn sniff(bytes: &[u8]) -> Option<ImageFormat> {
    if bytes.starts_with(JPEG_MAGIC) {
        Some(ImageFormat::Jpeg)
    } else if bytes.starts_with(PNG_MAGIC) {
        Some(ImageFormat::Png)
    } else {
        None
    }
}

fn bad(msg: impl Into<String>) -> PushdownError {
    PushdownError::BadInput(msg.into())
}

/// PNG colour types (the IHDR byte).
mod png_color {
    pub(crate) const GRAY: u8 = 0;
    pub(crate) const RGB: u8 = 2;
    pub(crate) const PALETTE: u8 = 3;
    pub(crate) const GRAY_ALPHA: u8 = 4;
    pub(crate) const RGBA: u8 = 6;
}

/// Bit depth and colour type from a PNG's IHDR, which the format requires to be the first chunk.
fn png_ihdr(bytes: &[u8]) -> Result<(u8, u8), PushdownError> {
    match bytes.get(12..26) {
        Some(ihdr) if &ihdr[..4] == b"IHDR" => Ok((ihdr[12], ihdr[13])),
        _ => Err(bad("cannot read image header: the PNG does not start with an IHDR chunk")),
    }
}

/// Checks the PNG chunks before the image data for what the `png` crate (0.18.1) would panic on: a
/// palette whose length is not a whole number of RGB entries (image-rs/image-png#694, found by
/// this project's fuzzer too). Walks chunk headers only: linear in the chunk count.
fn png_chunks_check(bytes: &[u8]) -> Result<(), PushdownError> {
    let mut i = PNG_MAGIC.len();
    while let Some(head) = bytes.get(i..i + 8) {
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        match &head[4..8] {
            b"IDAT" | b"IEND" => break,
            b"PLTE" if len == 0 || !len.is_multiple_of(3) || len > 3 * 256 => {
                return Err(bad(format!(
                    "cannot decode image: the PNG palette has {len} bytes, not 1 to 256 RGB entries"
                )));
            }
            _ => {}
        }
        i = i.saturating_add(12).saturating_add(len);
    }
    Ok(())
}

/// Most scans a JPEG may have. Every scan of a progressive JPEG passes over the whole image's
/// coefficients, and libjpeg only warns about a progression that repeats itself: a few bytes per
/// repeated scan would buy unbounded CPU (minutes for a small file). Encoders write 1 (baseline) to
/// about 10 (libjpeg's default progression; `jpegtran -optimize` variants stay under 20).
pub(crate) const MAX_JPEG_SCANS: usize = 64;

/// Counts the start-of-scan markers of a JPEG, walking its marker segments and skipping each scan's
/// entropy-coded data (in which `0xFF` is always followed by a stuffed `0x00` or a restart marker).
/// Stops counting past `limit`. Linear in the bytes and allocation-free.
#[must_use]
pub(crate) fn jpeg_scans(bytes: &[u8], limit: usize) -> usize {
    let mut scans = 0;
    let mut i = 2; // after SOI
    while scans <= limit {
        // Next marker: 0xFF (fill bytes allowed) then a marker code.
        while bytes.get(i) == Some(&0xFF) && bytes.get(i + 1) == Some(&0xFF) {
            i += 1;
        }
        let (Some(&0xFF), Some(&code)) = (bytes.get(i), bytes.get(i + 1)) else { break };
        i += 2;
        match code {
            0xD9 => break,                  // EOI
            0x01 | 0xD0..=0xD7 => continue, // TEM, stray RSTn: no length
            _ => {}
        }
        let Some(len) = bytes.get(i..i + 2).map(|b| usize::from(u16::from_be_bytes([b[0], b[1]]))) else { break };
        i += len;
        if code == 0xDA {
            scans += 1;
            // Entropy-coded data up to the next marker that is not a stuffed byte or a restart.
            while let Some(p) = bytes.get(i..).and_then(|rest| rest.iter().position(|&b| b == 0xFF)) {
                i += p;
                match bytes.get(i + 1) {
                    Some(0x00 | 0xD0..=0xD7) => i += 2,
                    _ => break,
                }
            }
        }
    }
    scans
}

fn is_cmyk(space: mozjpeg::ColorSpace) -> bool {
    matches!(space, mozjpeg::ColorSpace::JCS_CMYK | mozjpeg::ColorSpace::JCS_YCCK)
}

/// The image's header.
///
/// # Errors
/// Not a JPEG or PNG, or an unreadable header.
pub(crate) fn header(bytes: &[u8]) -> Result<Header, PushdownError> {
    match sniff(bytes) {
        Some(ImageFormat::Jpeg) => guarded("cannot decode image", || {
            let scans = jpeg_scans(bytes, MAX_JPEG_SCANS);
            if scans > MAX_JPEG_SCANS {
                return Err(bad(format!(
                    "the JPEG has more than {MAX_JPEG_SCANS} scans (each one a pass over the whole image); \
                     encoders write at most about 20"
                )));
            }
            let d = mozjpeg::Decompress::new_mem(bytes).map_err(|e| bad(format!("cannot read image header: {e}")))?;
            let (w, h) = d.size();
            let (width, height) = (dim(w)?, dim(h)?);
            let px = u64::from(width) * u64::from(height);
            let native_bytes = if is_cmyk(d.color_space()) { 4 * px } else { 0 };
            Ok(Header { format: ImageFormat::Jpeg, width, height, native_bytes })
        }),
        Some(ImageFormat::Png) => {
            let (depth, color) = png_ihdr(bytes)?;
            png_chunks_check(bytes)?;
            let (width, height) = guarded("cannot read image header", || {
                let mut d = png::Decoder::new(Cursor::new(bytes));
                let info = d.read_header_info().map_err(|e| bad(format!("cannot read image header: {e}")))?;
                Ok((info.width, info.height))
            })?;
            // After expansion (palette to RGB, tRNS to alpha) at most 2 or 4 channels.
            let channels: u64 = match color {
                png_color::GRAY | png_color::GRAY_ALPHA => 2,
                png_color::RGB | png_color::PALETTE | png_color::RGBA => 4,
                _ => return Err(bad(format!("cannot read image header: PNG colour type {color} does not exist"))),
            };
            // The PNG specification's bound; beyond it `width * height * 8` overflows a u64.
            if width > PNG_MAX_DIMENSION || height > PNG_MAX_DIMENSION {
                return Err(bad(format!(
                    "cannot read image header: a PNG dimension above {PNG_MAX_DIMENSION} ({width}x{height})"
                )));
            }
            let sample = if depth == 16 { 2 } else { 1 };
            let native_bytes = u64::from(width) * u64::from(height) * channels * sample;
            Ok(Header { format: ImageFormat::Png, width, height, native_bytes })
        }
        None => Err(bad("not a JPEG or PNG image")),
    }
}

/// The largest width or height the PNG specification allows (2^31 - 1).
const PNG_MAX_DIMENSION: u32 = i32::MAX as u32;

fn dim(v: usize) -> Result<u32, PushdownError> {
    u32::try_from(v).map_err(|_| bad("cannot read image header: dimension out of range"))
}

/// Decodes an image to packed RGB8, `head` being its [`header`] (the caller has checked its size).
///
/// # Errors
/// Corrupt, truncated or undecodable images.
#[cfg(test)]
pub(crate) fn decode_rgb(bytes: &[u8], head: &Header) -> Result<Vec<u8>, PushdownError> {
    let mut out = Vec::new();
    decode_rgb_into(bytes, head, &mut out)?;
    Ok(out)
}

/// [`decode_rgb`] into `out` (its contents replaced): a JPEG in RGB, the common case, is decoded
/// straight into `out`'s memory, so a buffer kept between images is not mapped and faulted in
/// again for each ([`super::preprocess::ScratchPool`]).
///
/// # Errors
/// As [`decode_rgb`].
pub(crate) fn decode_rgb_into(bytes: &[u8], head: &Header, out: &mut Vec<u8>) -> Result<(), PushdownError> {
    match head.format {
        ImageFormat::Jpeg => decode_jpeg(bytes, out),
        ImageFormat::Png => decode_png(bytes, head).map(|v| *out = v),
    }
}

/// How far from the end a JPEG's end-of-image marker must be. libjpeg pads a truncated stream
/// with grey and only warns; PIL refuses it ("image file is truncated"), and so do we.
const JPEG_EOI_WINDOW: usize = 64;

fn decode_jpeg(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), PushdownError> {
    let tail = &bytes[bytes.len().saturating_sub(JPEG_EOI_WINDOW)..];
    if !tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
        return Err(bad("cannot decode image: the JPEG data is truncated (no end-of-image marker)"));
    }
    let failed = |e: std::io::Error| bad(format!("cannot decode image: {e}"));
    guarded("cannot decode image", || {
        let d = mozjpeg::Decompress::new_mem(bytes).map_err(|e| bad(format!("cannot read image header: {e}")))?;
        if is_cmyk(d.color_space()) {
            let mut started = d.to_colorspace(mozjpeg::ColorSpace::JCS_CMYK).map_err(failed)?;
            let cmyk: Vec<u8> = started.read_scanlines().map_err(failed)?;
            started.finish().map_err(failed)?;
            *out = inverted_cmyk_to_rgb(&cmyk);
        } else {
            let mut started = d.rgb().map_err(failed)?;
            let len = started.width() * started.height() * 3;
            // A kept buffer is written over, not zeroed first: only its growth is.
            if out.len() < len {
                out.resize(len, 0);
            } else {
                out.truncate(len);
            }
            let filled = started.read_scanlines_into(out.as_mut_slice()).map_err(failed)?.len();
            out.truncate(filled);
            started.finish().map_err(failed)?;
        }
        Ok(())
    })
}

/// `round(a * b / 255)` in integers, as Pillow computes it.
fn muldiv255(a: u32, b: u32) -> u32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}

/// Adobe-polarity CMYK (stored inverted) to RGB, PIL's way (module docs).
fn inverted_cmyk_to_rgb(stored: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(stored.len() / 4 * 3);
    for px in stored.chunks_exact(4) {
        let nk = u32::from(px[3]); // 255 - K, with K = 255 - stored
        for &s in &px[..3] {
            let c = 255 - u32::from(s);
            out.push(nk.saturating_sub(muldiv255(c, nk)) as u8);
        }
    }
    out
}

fn decode_png(bytes: &[u8], head: &Header) -> Result<Vec<u8>, PushdownError> {
    let (depth, color) = png_ihdr(bytes)?;
    let failed = |e: png::DecodingError| bad(format!("cannot decode image: {e}"));
    let (buf, colour, bits) = guarded("cannot decode image", || {
        // The decoder's own buffers (rows, the inflate window, chunks) within the header's bound.
        let limit = usize::try_from(head.native_bytes.max(1)).unwrap_or(usize::MAX);
        let mut decoder = png::Decoder::new_with_limits(Cursor::new(bytes), png::Limits { bytes: limit });
        // Palette to RGB, tRNS to alpha, 1-, 2- and 4-bit grey to 8 bits; 16-bit samples kept.
        decoder.set_transformations(png::Transformations::EXPAND);
        let mut reader = decoder.read_info().map_err(failed)?;
        let size = reader.output_buffer_size().filter(|&n| n as u64 <= head.native_bytes);
        let Some(size) = size else {
            return Err(bad("cannot decode image: its pixels exceed what its header allows"));
        };
        let mut buf = vec![0; size];
        let out = reader.next_frame(&mut buf).map_err(failed)?;
        buf.truncate(out.buffer_size());
        Ok((buf, out.color_type, out.bit_depth))
    })?;
    // 16-bit samples are big-endian: the high byte comes first. 16-bit grey is PIL's `I;16`,
    // clamped to 8 bits; tRNS may have given it an alpha channel here.
    let clamp_gray16 = depth == 16 && color == png_color::GRAY;
    let gray16 = |p: &[u8]| if clamp_gray16 { u16::from_be_bytes([p[0], p[1]]).min(255) as u8 } else { p[0] };
    use png::{BitDepth::Eight, BitDepth::Sixteen, ColorType::*};
    Ok(match (colour, bits) {
        (Rgb, Eight) => buf,
        (Rgba, Eight) => buf.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        (Grayscale, Eight) => buf.iter().flat_map(|&v| [v; 3]).collect(),
        (GrayscaleAlpha, Eight) => buf.chunks_exact(2).flat_map(|p| [p[0]; 3]).collect(),
        (Grayscale, Sixteen) => buf.chunks_exact(2).flat_map(|p| [gray16(p); 3]).collect(),
        (GrayscaleAlpha, Sixteen) => buf.chunks_exact(4).flat_map(|p| [gray16(p); 3]).collect(),
        (Rgb, Sixteen) => buf.chunks_exact(2).map(|p| p[0]).collect(),
        (Rgba, Sixteen) => buf.chunks_exact(8).flat_map(|p| [p[0], p[2], p[4]]).collect(),
        other => return Err(bad(format!("cannot decode image: unsupported PNG pixel type {other:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmyk_conversion_follows_pil() {
        // Stored (inverted) bytes: 255 is no ink. No ink at all is white; full K is black.
        assert_eq!(inverted_cmyk_to_rgb(&[255, 255, 255, 255]), vec![255, 255, 255]);
        assert_eq!(inverted_cmyk_to_rgb(&[255, 255, 255, 0]), vec![0, 0, 0]);
        // Full cyan, no K: red channel gone. Values from Pillow 11.3 (`Image.fromarray(...,
        // "CMYK").convert("RGB")` of C=255, M=0, Y=128, K=64): (0, 191, 95).
        assert_eq!(inverted_cmyk_to_rgb(&[0, 255, 127, 191]), vec![0, 191, 95]);
    }

    /// A progressive-looking JPEG: SOI, a table segment, then `n` scans of a few data bytes each
    /// (one with a stuffed byte and a restart marker), then EOI.
    fn scans(n: usize) -> Vec<u8> {
        let mut j = vec![0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x04, 0x01, 0x02];
        for _ in 0..n {
            j.extend_from_slice(&[0xFF, 0xDA, 0x00, 0x03, 0x00, 0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56]);
        }
        j.extend_from_slice(&[0xFF, 0xD9]);
        j
    }

    #[test]
    fn scans_are_counted_through_their_entropy_data() {
        assert_eq!(jpeg_scans(&scans(0), 64), 0);
        assert_eq!(jpeg_scans(&scans(3), 64), 3);
        assert_eq!(jpeg_scans(&scans(1000), 64), 65, "stops counting past the limit");
        assert_eq!(jpeg_scans(&scans(5)[..20], 64), 1, "truncated");
        let e = header(&scans(MAX_JPEG_SCANS + 1)).expect_err("refused");
        assert!(e.to_string().contains("more than 64 scans"), "{e}");
    }

    #[test]
    fn a_palette_of_partial_entries_is_refused_not_panicked_on() {
        // Found by the image fuzz target: the png crate panics on a PLTE of 49 bytes.
        let found = include_bytes!("../../fuzz/regressions/image/png-plte-not-rgb-triples-1.png");
        let e = header(found).expect_err("refused");
        assert!(e.to_string().contains("palette has 49 bytes"), "{e}");
        // Whatever a decoder panics on is a 400 of its own.
        let e = guarded::<()>("cannot decode image", || panic!("decoder bug")).expect_err("caught");
        assert!(e.to_string().contains("decoder bug"), "{e}");
    }

    #[test]
    fn dimensions_beyond_the_png_bound_are_refused_not_overflowed() {
        // Found by the image fuzz target (whose build skips PNG CRCs; these carry valid ones):
        // 3782150275 x 3291152396 overflowed the native buffer's size.
        for found in [
            &include_bytes!("../../fuzz/regressions/image/png-dimensions-overflow-1.png")[..],
            &include_bytes!("../../fuzz/regressions/image/png-dimensions-overflow-2.png")[..],
        ] {
            let e = header(found).expect_err("refused");
            assert!(e.to_string().contains("PNG dimension above"), "{e}");
        }
    }

    #[test]
    fn headers_bound_the_native_buffer() {
        let rgba16 = {
            let mut out = Vec::new();
            let mut e = png::Encoder::new(&mut out, 10, 4);
            e.set_color(png::ColorType::Rgba);
            e.set_depth(png::BitDepth::Sixteen);
            let mut w = e.write_header().expect("header");
            let px: Vec<u8> = [1u16, 2, 3, 4].iter().flat_map(|v| v.to_be_bytes()).collect();
            w.write_image_data(&px.repeat(10 * 4)).expect("encode");
            w.finish().expect("finish");
            out
        };
        let h = header(&rgba16).expect("header");
        assert_eq!((h.format, h.width, h.height, h.native_bytes), (ImageFormat::Png, 10, 4, 10 * 4 * 8));
        let rgb = decode_rgb(&rgba16, &h).expect("decode");
        assert_eq!(&rgb[..3], &[0, 0, 0], "high bytes of 1, 2, 3");
        assert!(header(b"GIF89a").is_err());
        assert!(header(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDX").is_err());
    }
}
