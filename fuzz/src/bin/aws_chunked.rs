//! AFL++ target: `tensorgate_fuzz::aws_chunked`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::aws_chunked(data));
}
