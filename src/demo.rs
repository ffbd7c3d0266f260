//! The embedded default's demo content: when the `fs` backend starts on a directory that does not
//! exist yet, it is created with a `demo` bucket holding a few generated sample images, so that a
//! first pushdown works with one command (README) and no data of one's own.

use std::path::Path;

/// Bucket the samples go into.
pub(crate) const DEMO_BUCKET: &str = "demo";
/// How many sample images.
const SAMPLES: u32 = 3;

/// Writes `root/demo/sample-N.png` (320x240, synthetic scenes).
///
/// # Errors
/// Filesystem or encoding failures.
pub(crate) fn seed(root: &Path) -> std::io::Result<()> {
    let dir = root.join(DEMO_BUCKET);
    std::fs::create_dir_all(&dir)?;
    for n in 0..SAMPLES {
        let (width, height) = (320, 240);
        // Gradients plus a disc whose place and colour vary per sample.
        let (cx, cy) = (80 + 60 * n, 90 + 20 * n);
        let mut rgb = Vec::with_capacity(3 * width as usize * height as usize);
        for y in 0..height {
            for x in 0..width {
                let d2 = (i64::from(x) - i64::from(cx)).pow(2) + (i64::from(y) - i64::from(cy)).pow(2);
                rgb.extend(if d2 < 50 * 50 {
                    [(200 - 60 * n) as u8, (60 + 70 * n) as u8, 90]
                } else {
                    [(x * 255 / 320) as u8, (y * 255 / 240) as u8, ((x + y + 40 * n) % 256) as u8]
                });
            }
        }
        std::fs::write(dir.join(format!("sample-{n}.png")), png_rgb8(width, height, &rgb)?)?;
    }
    Ok(())
}

/// `rgb` (packed 8-bit RGB, `width` x `height`) as a PNG file.
///
/// # Errors
/// A buffer that does not hold `width` x `height` pixels.
pub(crate) fn png_rgb8(width: u32, height: u32, rgb: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(std::io::Error::other)?;
    writer.write_image_data(rgb).map_err(std::io::Error::other)?;
    writer.finish().map_err(std::io::Error::other)?;
    Ok(out)
}
