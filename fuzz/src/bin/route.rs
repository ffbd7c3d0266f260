//! AFL++ target: `tensorgate_fuzz::route_request`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::route_request(data));
}
