//! AFL++ target: `tensorgate_fuzz::webdataset_shard`.
fn main() {
    afl::fuzz!(|data: &[u8]| tensorgate_fuzz::webdataset_shard(data));
}
