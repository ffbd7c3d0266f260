//! AFL++ target: `tensorgate_fuzz::parquet_table`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::parquet_table(data));
}
