//! WebDataset shards: a tar archive whose members are grouped into samples by key (the member path
//! up to the first `.` of its file name), e.g. `n01440764/0001.jpg` + `n01440764/0001.cls`.
//! Pure: works on the archive in memory, slicing members without copying.
//!
//! Per-sample policy (documented in docs/pushdown.md):
//! - the input is the sample's `.jpg`/`.jpeg`/`.png` image or `.npy` tensor; a sample with two
//!   inputs is an error naming its key;
//! - `.cls` holds the integer label; labels are returned when every sample has one, and a shard
//!   where only some samples have one is an error;
//! - members with other extensions (`.json`, `.txt`, ...) are not model inputs: they are kept, with
//!   `.cls`, as the sample's other members (what `format=tar` writes back beside the features);
//!   non-file entries are ignored, and samples with no input at all are skipped;
//! - a shard with no samples, or an input that fails to decode later, fails the whole request
//!   with a 4xx naming the key: silently dropping training samples is worse than failing loudly.

use bytes::Bytes;

use super::error::PushdownError;

/// Most samples per shard (WebDataset shards usually hold 64 to 10 000).
pub const MAX_SAMPLES: usize = 10_000;

/// A sample's model input, still encoded.
#[derive(Debug, Clone)]
pub(crate) enum SampleInput {
    Image(Bytes),
    Npy(Bytes),
}

/// One sample of a shard.
#[derive(Debug, Clone)]
pub struct Sample {
    pub key: String,
    pub(crate) input: SampleInput,
    pub label: Option<i64>,
    /// The sample's members other than its input, in archive order: the extension as spelled in
    /// the member name (after the first `.` of the file name) and the bytes.
    pub others: Vec<(String, Bytes)>,
}

/// Whether the bytes look like a tar archive (POSIX ustar or GNU magic at offset 257).
#[must_use]
pub(crate) fn is_tar(bytes: &[u8]) -> bool {
    bytes.len() >= 512 && &bytes[257..262] == b"ustar"
}

fn bad(msg: impl Into<String>) -> PushdownError {
    PushdownError::BadInput(msg.into())
}

/// Splits a shard into samples, in order of first appearance.
///
/// # Errors
/// A malformed archive, or a sample that breaks the policy above.
pub fn read(archive: &Bytes) -> Result<Vec<Sample>, PushdownError> {
    struct Partial {
        key: String,
        input: Option<SampleInput>,
        label: Option<i64>,
        others: Vec<(String, Bytes)>,
    }
    let mut samples: Vec<Partial> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut tar = tar::Archive::new(std::io::Cursor::new(archive.as_ref()));
    for entry in tar.entries().map_err(|e| bad(format!("not a readable tar archive: {e}")))? {
        let entry = entry.map_err(|e| bad(format!("corrupt tar archive: {e}")))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry.path().map_err(|e| bad(format!("bad member name: {e}")))?.to_string_lossy().into_owned();
        let (dir, file) = path.rsplit_once('/').map_or(("", path.as_str()), |(d, f)| (d, f));
        let Some((stem, ext)) = file.split_once('.') else { continue };
        let key = if dir.is_empty() { stem.to_owned() } else { format!("{dir}/{stem}") };
        let start = usize::try_from(entry.raw_file_position()).map_err(|_| bad("member offset out of range"))?;
        let size = usize::try_from(entry.size()).map_err(|_| bad("member size out of range"))?;
        let end = start
            .checked_add(size)
            .filter(|&e| e <= archive.len())
            .ok_or_else(|| bad(format!("member {path} runs past the end of the archive")))?;
        let data = archive.slice(start..end);
        let input = match ext.to_ascii_lowercase().as_str() {
            "jpg" | "jpeg" | "png" => Some(SampleInput::Image(data.clone())),
            "npy" => Some(SampleInput::Npy(data.clone())),
            _ => None,
        };
        let i = match index.get(&key) {
            Some(&i) => i,
            None => {
                if samples.len() >= MAX_SAMPLES {
                    return Err(bad(format!("shard has more than {MAX_SAMPLES} samples")));
                }
                index.insert(key.clone(), samples.len());
                samples.push(Partial { key: key.clone(), input: None, label: None, others: Vec::new() });
                samples.len() - 1
            }
        };
        let s = &mut samples[i];
        match input {
            Some(inp) => {
                if s.input.replace(inp).is_some() {
                    return Err(bad(format!("sample {key:?} has more than one input member")));
                }
            }
            None => {
                if ext.eq_ignore_ascii_case("cls") {
                    let text =
                        std::str::from_utf8(&data).map_err(|_| bad(format!("sample {key:?}: .cls is not text")))?;
                    s.label =
                        Some(text.trim().parse().map_err(|_| bad(format!("sample {key:?}: .cls is not an integer")))?);
                }
                if s.others.iter().any(|(e, _)| e == ext) {
                    return Err(bad(format!("sample {key:?} has two .{ext} members")));
                }
                s.others.push((ext.to_owned(), data));
            }
        }
    }
    let samples: Vec<Sample> = samples
        .into_iter()
        .filter_map(|p| p.input.map(|input| Sample { key: p.key, input, label: p.label, others: p.others }))
        .collect();
    if samples.is_empty() {
        return Err(bad("the shard has no samples (no .jpg, .png or .npy members)"));
    }
    let labelled = samples.iter().filter(|s| s.label.is_some()).count();
    if labelled != 0 && labelled != samples.len() {
        let missing = samples.iter().find(|s| s.label.is_none()).map(|s| s.key.clone()).unwrap_or_default();
        return Err(bad(format!("sample {missing:?} has no .cls label while other samples do")));
    }
    Ok(samples)
}

/// Bytes a shard written by [`write`] adds around its members' data: one 512-byte header and up to
/// 511 bytes of padding per member, a GNU long-name record (header + one block, or more for names
/// over 512 bytes) when the name is over 100 bytes, and the two zero blocks at the end.
#[must_use]
pub(crate) fn framing_bytes(members: usize, longest_name: usize) -> usize {
    let long_name = if longest_name > 100 { 512 + (longest_name + 1).div_ceil(512) * 512 } else { 0 };
    members * (1024 + long_name) + 1024
}

/// A WebDataset shard: per sample, in order, `{key}.npy` (the sample's features, already encoded)
/// and then its other members as they were, so that a WebDataset reader groups them under the same
/// keys. Names are written byte for byte as read (`./a/0001` stays so; a name over 100 bytes gets a
/// GNU long-name record). Deterministic: every header has mode 0644, owner 0 and time 0, so equal
/// inputs give equal bytes (and ETags). The samples' [`write_sample`]s, then [`END`].
///
/// # Errors
/// Only if writing to memory fails (a bug).
pub fn write<'a>(
    samples: impl Iterator<Item = (&'a str, Vec<u8>, &'a [(String, Bytes)])>,
    capacity: usize,
) -> Result<Vec<u8>, PushdownError> {
    let mut out = Vec::with_capacity(capacity);
    for (key, features, others) in samples {
        out.extend_from_slice(&write_sample(key, &features, others)?);
    }
    out.extend_from_slice(&END);
    Ok(out)
}

/// The end of a tar archive: two zero blocks.
pub(crate) const END: [u8; 1024] = [0; 1024];

/// One sample's members of a shard [`write`] makes: `{key}.npy` holding `features`, then its
/// other members; no end blocks, so that samples written apart concatenate into the archive.
///
/// # Errors
/// Only if writing to memory fails (a bug).
pub(crate) fn write_sample(key: &str, features: &[u8], others: &[(String, Bytes)]) -> Result<Vec<u8>, PushdownError> {
    let capacity = member_bytes(key.len() + 4, features.len())
        + others.iter().map(|(e, d)| member_bytes(key.len() + 1 + e.len(), d.len())).sum::<usize>();
    let mut tar = tar::Builder::new(Vec::with_capacity(capacity));
    let mut append = |name: &str, data: &[u8]| {
        append_exact(&mut tar, name.as_bytes(), data)
            .map_err(|e| PushdownError::Internal(format!("tar member {name:?}: {e}")))
    };
    append(&format!("{key}.npy"), features)?;
    for (ext, data) in others {
        append(&format!("{key}.{ext}"), data)?;
    }
    // Taken before the builder's drop writes the end blocks (into the emptied buffer).
    Ok(std::mem::take(tar.get_mut()))
}

/// The bytes [`write_sample`] gives a member of `size` bytes named by `name_len` bytes: a
/// GNU long-name record over 100 bytes (its header and the name, NUL-ended, in whole blocks),
/// the member's header, its data in whole blocks.
#[must_use]
pub(crate) fn member_bytes(name_len: usize, size: usize) -> usize {
    let long_name = if name_len > 100 { 512 + (name_len + 1).next_multiple_of(512) } else { 0 };
    long_name + 512 + size.next_multiple_of(512)
}

/// One regular member named exactly `name` (the `tar` crate's own path setter normalises `./`
/// and `//` away, which would change the keys).
fn append_exact(tar: &mut tar::Builder<Vec<u8>>, name: &[u8], data: &[u8]) -> std::io::Result<()> {
    fn header(kind: tar::EntryType, name: &[u8], size: usize) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        let field = &mut h.as_old_mut().name;
        let n = name.len().min(field.len());
        field[..n].copy_from_slice(&name[..n]);
        h.set_size(size as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(kind);
        h.set_cksum();
        h
    }
    if name.len() > 100 {
        let mut long = name.to_vec();
        long.push(0);
        tar.append(&header(tar::EntryType::GNULongName, b"././@LongLink", long.len()), long.as_slice())?;
    }
    tar.append(&header(tar::EntryType::Regular, name, data.len()), data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(members: &[(&str, &[u8])]) -> Bytes {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, *data).expect("append");
        }
        Bytes::from(b.into_inner().expect("finish"))
    }

    #[test]
    fn groups_members_into_labelled_samples() {
        let s = shard(&[
            ("a/0001.jpg", b"img1"),
            ("a/0001.cls", b"3\n"),
            ("a/0001.json", b"{}"),
            ("a/0002.npy", b"npy2"),
            ("a/0002.cls", b"7"),
        ]);
        assert!(is_tar(&s));
        let samples = read(&s).expect("read");
        assert_eq!(samples.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), ["a/0001", "a/0002"]);
        assert_eq!(samples.iter().map(|s| s.label).collect::<Vec<_>>(), [Some(3), Some(7)]);
        assert!(matches!(&samples[0].input, SampleInput::Image(b) if b.as_ref() == b"img1"));
        let others: Vec<&str> = samples[0].others.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(others, ["cls", "json"]);
    }

    #[test]
    fn written_shards_keep_keys_order_and_other_members() {
        let long = format!("./{}//0003", "d".repeat(150));
        let others =
            [("cls".to_owned(), Bytes::from_static(b"3")), ("Meta.JSON".to_owned(), Bytes::from_static(b"{}"))];
        let rows = [("./a/0001", b"f1".to_vec(), &others[..]), (long.as_str(), b"f3".to_vec(), &others[..1])];
        let bytes = write(rows.iter().map(|(k, f, o)| (*k, f.clone(), *o)), 0).expect("write");
        assert_eq!(bytes, write(rows.iter().map(|(k, f, o)| (*k, f.clone(), *o)), 0).expect("again"));
        assert!(bytes.len() <= 2 + 1 + 2 + 2 + 2 + framing_bytes(5, long.len() + 4));
        let sizes = [(8 + 4, 2), (8 + 4, 1), (8 + 10, 2), (long.len() + 4, 2), (long.len() + 4, 1)];
        assert_eq!(bytes.len(), sizes.iter().map(|&(n, s)| member_bytes(n, s)).sum::<usize>() + END.len());
        let mut names = Vec::new();
        let mut tar = tar::Archive::new(bytes.as_slice());
        for e in tar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut data).expect("data");
            names.push((e.path().expect("path").to_string_lossy().into_owned(), data));
        }
        let want: Vec<(String, Vec<u8>)> = vec![
            ("./a/0001.npy".into(), b"f1".to_vec()),
            ("./a/0001.cls".into(), b"3".to_vec()),
            ("./a/0001.Meta.JSON".into(), b"{}".to_vec()),
            (format!("{long}.npy"), b"f3".to_vec()),
            (format!("{long}.cls"), b"3".to_vec()),
        ];
        assert_eq!(names, want);
    }

    #[test]
    fn policy_violations_name_the_sample() {
        let two = shard(&[("x.jpg", b"1"), ("x.png", b"2")]);
        assert!(read(&two).expect_err("two inputs").to_string().contains("\"x\""));
        let partial = shard(&[("x.jpg", b"1"), ("x.cls", b"1"), ("y.jpg", b"2")]);
        assert!(read(&partial).expect_err("partial labels").to_string().contains("\"y\""));
        let bad_label = shard(&[("x.jpg", b"1"), ("x.cls", b"cat")]);
        assert!(read(&bad_label).is_err());
        let twice = shard(&[("x.jpg", b"1"), ("x.txt", b"a"), ("x.txt", b"b")]);
        assert!(read(&twice).expect_err("two .txt").to_string().contains(".txt"));
        let empty = shard(&[("readme.txt", b"hello")]);
        assert!(read(&empty).expect_err("empty").to_string().contains("no samples"));
        assert!(!is_tar(b"not a tar"));
    }
}
