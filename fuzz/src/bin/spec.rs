//! AFL++ target: `tensorgate_fuzz::pushdown_spec`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::pushdown_spec(data));
}
