//! Replays every committed seed (`corpus/<target>/`) and every crash found so far
//! (`regressions/<target>/`) through its target, without AFL: what a campaign found stays fixed.

use std::path::Path;

#[test]
fn corpora_and_regressions_replay_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut replayed = 0;
    for (name, target) in tensorgate_fuzz::TARGETS {
        let mut seeds = 0;
        for dir in ["corpus", "regressions"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else { continue };
            for entry in entries {
                let path = entry.expect("entry").path();
                let data = std::fs::read(&path).expect("read");
                let outcome = std::panic::catch_unwind(|| target(&data));
                assert!(outcome.is_ok(), "{name}: {} panics", path.display());
                seeds += 1;
            }
        }
        assert!(seeds > 0, "{name} has no seed corpus");
        replayed += seeds;
    }
    println!("replayed {replayed} inputs");
}
