//! The PIL-exact resampler (ADR 0003) against the plain form of the same arithmetic, on the sizes
//! the bundled models resize from: a 500x375 photo (the synthetic bench set's size) and a 1024x768
//! one to a shorter side of 256, and a 256x256 thumbnail up to 341; each as the horizontal pass
//! alone, the vertical pass alone and both. Both outputs are compared byte for byte before timing.
//! Run: `cargo bench --bench resize` (pin it with `taskset -c 1`).

use std::hint::black_box;
use std::time::Instant;

use tensorgate::pushdown::preprocess::{reference_resize_bilinear, resize_bilinear, resized_size};

/// Timed calls per case and form (bounded: a few seconds in all).
const ROUNDS: usize = 60;

fn ms_per_call(f: impl Fn() -> Vec<u8>) -> f64 {
    black_box(f());
    let t = Instant::now();
    for _ in 0..ROUNDS {
        black_box(f());
    }
    t.elapsed().as_secs_f64() * 1e3 / ROUNDS as f64
}

fn main() {
    println!("| from | to | reference ms | fast ms | reference / fast |");
    println!("|---|---|---|---|---|");
    for (w, h, shorter) in [(500usize, 375usize, 256u32), (1024, 768, 256), (256, 256, 341)] {
        let (nw, nh) = resized_size(w as u32, h as u32, shorter);
        let (nw, nh) = (nw as usize, nh as usize);
        for (nw, nh) in [(nw, h), (w, nh), (nw, nh)] {
            // A deterministic, non-constant image (constant inputs would hide rounding differences).
            let src: Vec<u8> = (0..w * h * 3).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            assert_eq!(resize_bilinear(&src, w, h, nw, nh), reference_resize_bilinear(&src, w, h, nw, nh));
            let reference = ms_per_call(|| reference_resize_bilinear(black_box(&src), w, h, nw, nh));
            let fast = ms_per_call(|| resize_bilinear(black_box(&src), w, h, nw, nh));
            println!("| {w}x{h} | {nw}x{nh} | {reference:.2} | {fast:.2} | {:.2} |", reference / fast);
        }
    }
}
