//! AFL++ target: `tensorgate_fuzz::onnx_prefix`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::onnx_prefix(data));
}
