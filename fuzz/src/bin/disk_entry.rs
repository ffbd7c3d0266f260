//! AFL++ target: `tensorgate_fuzz::disk_entry`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::disk_entry(data));
}
