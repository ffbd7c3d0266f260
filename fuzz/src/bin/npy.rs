//! AFL++ target: `tensorgate_fuzz::npy_round_trip`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::npy_round_trip(data));
}
