//! AFL++ target: `tensorgate_fuzz::text_rows`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::text_rows(data));
}
