//! AFL++ target: `tensorgate_fuzz::post_form`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::post_form(data));
}
