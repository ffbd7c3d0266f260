//! AFL++ target: `tensorgate_fuzz::fs_listing`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::fs_listing(data));
}
