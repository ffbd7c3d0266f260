//! The embedded default's demo content: when the `fs` backend starts on a directory that does not
//! exist yet, it is created with a `demo` bucket holding a few generated sample images, so that a
//! first pushdown works with one command (README) and no data of one's own.

use std::io::Cursor;
use std::path::Path;

/// Bucket the samples go into.
pub const DEMO_BUCKET: &str = "demo";
/// How many sample images.
const SAMPLES: u32 = 3;

/// Writes `root/demo/sample-N.png` (320x240, synthetic scenes).
///
/// # Errors
/// Filesystem or encoding failures.
pub fn seed(root: &Path) -> std::io::Result<()> {
    let dir = root.join(DEMO_BUCKET);
    std::fs::create_dir_all(&dir)?;
    for n in 0..SAMPLES {
        let img = image::RgbImage::from_fn(320, 240, |x, y| {
            // Gradients plus a disc whose place and colour vary per sample.
            let (cx, cy) = (80 + 60 * n, 90 + 20 * n);
            let d2 = (x as i64 - i64::from(cx)).pow(2) + (y as i64 - i64::from(cy)).pow(2);
            if d2 < 50 * 50 {
                image::Rgb([(200 - 60 * n) as u8, (60 + 70 * n) as u8, 90])
            } else {
                image::Rgb([(x * 255 / 320) as u8, (y * 255 / 240) as u8, ((x + y + 40 * n) % 256) as u8])
            }
        });
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(format!("sample-{n}.png")), out.into_inner())?;
    }
    Ok(())
}
