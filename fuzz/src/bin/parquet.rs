//! AFL++ target: `tensorgate_fuzz::parquet_table`. Without AFL's panic hook: the gateway catches
//! the parquet crate's panics on damaged files (`pushdown/table/`, `guarded`) and answers them `400`, so
//! only a panic that escapes that is a crash.
fn main() {
    afl::fuzz_nohook!(|data: &[u8]| tensorgate_fuzz::parquet_table(data));
}
