//! AFL++ target: `tensorgate_fuzz::image_preprocess`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::image_preprocess(data));
}
