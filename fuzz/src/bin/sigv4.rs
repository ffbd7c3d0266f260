//! AFL++ target: `tensorgate_fuzz::sigv4_request`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::sigv4_request(data));
}
