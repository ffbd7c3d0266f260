//! AFL++ target: `tensorgate_fuzz::alias_listing`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::alias_listing(data));
}
