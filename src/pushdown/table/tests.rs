use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use bytes::Bytes;
use parquet::basic::Compression;
use parquet::column::page::{Page, PageMetadata, PageReader};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

use super::super::error::PushdownError;
use super::super::shard::MAX_SAMPLES;
use super::super::spec::Dtype;
#[allow(clippy::wildcard_imports)]
use super::{decode::*, footer::*, layout::*, outline::*, source::*, write::*};
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, BinaryArray, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Fields};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

fn string_at(array: &dyn Array, i: usize) -> Option<String> {
    (!array.is_null(i)).then(|| array.as_string::<i32>().value(i).to_owned())
}

use crate::pushdown::spec::RowGroups;

fn read(object: &Bytes, column: Option<&str>, max_decoded: u64, keep: bool) -> Result<Footer, PushdownError> {
    Footer::read(&Source::whole(object.clone()), Reading { column, max_decoded, keep, ..Reading::default() })
}

/// A file of `columns`, `per_group` rows to a row group, Snappy pages.
fn file(columns: Vec<(&str, ArrayRef)>, per_group: usize) -> Bytes {
    let batch = RecordBatch::try_from_iter(columns).expect("batch");
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(per_group))
        .set_compression(Compression::SNAPPY)
        .build();
    let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).expect("writer");
    w.write(&batch).expect("write");
    Bytes::from(w.into_inner().expect("close"))
}

fn images(paths: &[Option<&str>], data: &[&[u8]]) -> ArrayRef {
    let fields =
        Fields::from(vec![Field::new("bytes", DataType::Binary, true), Field::new("path", DataType::Utf8, true)]);
    let bytes: ArrayRef = Arc::new(BinaryArray::from(data.to_vec()));
    let paths: ArrayRef = Arc::new(StringArray::from(paths.to_vec()));
    Arc::new(StructArray::new(fields, vec![bytes, paths], None))
}

#[test]
fn rows_carry_their_image_key_and_label_in_file_order_whatever_the_column_order() {
    let object = file(
        vec![
            ("label", Arc::new(Int64Array::from(vec![3, 1, 4])) as ArrayRef),
            ("image", images(&[Some("a.jpg"), None, Some("c.png")], &[b"A", b"BB", b"CCC"])),
        ],
        2,
    );
    assert!(is_parquet(&object));
    let footer = read(&object, None, 1 << 20, false).expect("footer");
    assert_eq!(footer.row_count(), 3);
    assert!(footer.decoded_bytes() > 0);
    let (rows, _) = footer.rows(&Source::whole(object)).expect("rows");
    let got: Vec<(&str, &[u8], Option<i64>)> = rows.iter().map(|r| (r.key.as_str(), &r.input[..], r.label)).collect();
    assert_eq!(got, [("a.jpg", &b"A"[..], Some(3)), ("1", &b"BB"[..], Some(1)), ("c.png", &b"CCC"[..], Some(4))]);
}

#[test]
fn a_parquet_output_keeps_the_other_columns_and_row_groups_and_adds_the_features() {
    let hf = r#"{"info": {"features": {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ["a"]}, "caption": {"dtype": "string", "_type": "Value"}}}}"#;
    let captions: ArrayRef =
        Arc::new(StringArray::from(vec![Some("one"), None, Some("three"), Some("four"), Some("five")]));
    let batch = RecordBatch::try_from_iter(vec![
        ("caption", captions.clone()),
        ("image", images(&[Some("a"), Some("b"), Some("c"), Some("d"), Some("e")], &[b"A", b"B", b"C", b"D", b"E"])),
        ("label", Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])) as ArrayRef),
    ])
    .expect("batch");
    // As pyarrow writes `datasets`' entry: a key-value entry of the file (and, here, an
    // uncompressed caption beside Snappy columns: the kept chunks are copied as they are).
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(2))
        .set_key_value_metadata(Some(vec![KeyValue::new("huggingface".to_owned(), hf.to_owned())]))
        .set_column_compression(ColumnPath::from("caption"), Compression::UNCOMPRESSED)
        .build();
    let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).expect("writer");
    w.write(&batch).expect("write");
    let object = Bytes::from(w.into_inner().expect("close"));

    let footer = read(&object, None, 1 << 20, true).expect("footer");
    assert!(footer.output_bytes() > OUTPUT_FOOTER_BYTES);
    let (rows, kept) = footer.rows(&Source::whole(object)).expect("rows");
    assert_eq!(rows.len(), 5);
    let features: Vec<f32> = (0..10).map(|v| v as f32 / 4.0).collect();
    let out = write(&kept.expect("kept"), &features, &[5, 2, 1], Dtype::F16, ("m", "pool")).expect("write");

    let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(out)).expect("output");
    let groups: Vec<i64> = reader.metadata().row_groups().iter().map(|g| g.num_rows()).collect();
    assert_eq!(groups, [2, 2, 1]);
    let meta = reader.schema().metadata().clone();
    let names: Vec<String> = reader.schema().fields().iter().map(|f| f.name().clone()).collect();
    assert_eq!(names, ["caption", "label", "features"]);
    let (mut texts, mut values) = (Vec::new(), Vec::new());
    for batch in reader.build().expect("reader") {
        let batch = batch.expect("batch");
        texts.extend((0..batch.num_rows()).map(|i| string_at(batch.column(0).as_ref(), i)));
        // A list per row, as long as a row's features.
        let list = batch.column(2).as_list::<i32>();
        assert!(list.value_offsets().windows(2).all(|w| w[1] - w[0] == 2));
        let half = list.values().as_primitive::<arrow_array::types::Float16Type>();
        values.extend(half.values().iter().map(|v| v.to_f32()));
    }
    let expected: Vec<Option<String>> = (0..5).map(|i| string_at(captions.as_ref(), i)).collect();
    assert_eq!(texts, expected);
    assert_eq!(values, features);
    let hf: serde_json::Value = serde_json::from_str(&meta["huggingface"]).expect("json");
    let described: Vec<&String> = hf["info"]["features"].as_object().expect("features").keys().collect();
    assert_eq!(described, ["caption", "features", "label"]);
    assert_eq!(hf["info"]["features"]["features"]["feature"]["dtype"], "float16");
    let provenance: serde_json::Value = serde_json::from_str(&meta["tensorgate"]).expect("json");
    assert_eq!(provenance["shape"], serde_json::json!([2, 1]));
    assert_eq!(provenance["column"], "image");
}

/// A group's features are written a slice of whole rows at a time ([`WRITE_VALUES`]): rows
/// and values come back whole and in order across the slices, in both dtypes.
#[test]
fn features_written_in_slices_read_back_whole() {
    let (rows, per) = (MAX_SAMPLES, 40usize);
    // More than the writer's page (1 MiB) in f32, as well as several slices.
    assert!(rows * per > 2 * WRITE_VALUES && rows * per * 4 > 1 << 20);
    let object = file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; rows])) as ArrayRef)], rows);
    let footer = read(&object, None, 1 << 24, true).expect("footer");
    let (_, kept) = footer.rows(&Source::whole(object)).expect("rows");
    let kept = kept.expect("kept");
    // Small integers: exact in f16 too.
    let features: Vec<f32> = (0..rows * per).map(|i| (i % 1000) as f32).collect();
    for dtype in [Dtype::F32, Dtype::F16] {
        let out = write(&kept, &features, &[rows, per], dtype, ("m", "s")).expect("write");
        // Pages split where they would for any values: the outline holds across them.
        let outline = outline(&footer, &[per], dtype, ("m", "s")).expect("outline");
        assert_eq!((outline.len, &outline.tail[..]), (out.len() as u64, &out[out.len() - outline.tail.len()..]));
        let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(out)).expect("output");
        let mut values = Vec::new();
        for batch in reader.build().expect("reader") {
            let list = batch.expect("batch").column(0).as_list::<i32>().clone();
            assert!(list.value_offsets().windows(2).all(|w| usize::try_from(w[1] - w[0]) == Ok(per)));
            let items = list.values();
            if dtype == Dtype::F16 {
                let half = items.as_primitive::<arrow_array::types::Float16Type>();
                values.extend(half.values().iter().map(|v| v.to_f32()));
            } else {
                values.extend(items.as_primitive::<arrow_array::types::Float32Type>().values().iter().copied());
            }
        }
        assert!(values == features, "{dtype:?}");
    }
}

#[test]
fn named_row_groups_are_read_from_the_tail_and_their_span_alone() {
    let data: Vec<&[u8]> = vec![b"A", b"BB", b"CCC", b"DDDD", b"EEEEE"];
    let object = file(
        vec![
            ("image", Arc::new(BinaryArray::from(data.clone())) as ArrayRef),
            ("label", Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])) as ArrayRef),
        ],
        2,
    );
    let len = object.len() as u64;
    let at = |from: u64, to: u64| object.slice(usize::try_from(from).unwrap()..usize::try_from(to).unwrap());
    // A tail longer than the file is the file: a small one's tail is read from its start.
    let tail_at = len.saturating_sub(TAIL_BYTES);
    let tail = Source::piece(len, tail_at, at(tail_at, len));
    let want = |first, last| Reading {
        max_decoded: 1 << 20,
        row_groups: Some(RowGroups { first, last }),
        ..Reading::default()
    };
    let footer = Footer::read(&tail, want(1, 2)).expect("footer");
    assert_eq!(footer.row_count(), 3);
    let (start, end) = footer.span().expect("span");
    assert!(start >= 4 && end <= len - 8 && start < end);
    let (rows, _) = footer.rows(&Source::piece(len, start, at(start, end))).expect("rows");
    let got: Vec<(&str, &[u8], Option<i64>)> = rows.iter().map(|r| (r.key.as_str(), &r.input[..], r.label)).collect();
    assert_eq!(got, [("2", data[2], Some(2)), ("3", data[3], Some(3)), ("4", data[4], Some(4))]);

    // Bytes outside what was read are an error, not a panic or other rows.
    let footer = Footer::read(&tail, want(0, 0)).expect("footer");
    let (start, end) = footer.span().expect("span");
    assert!(footer.rows(&Source::piece(len, start + 1, at(start + 1, end))).is_err());
    // A request holds one group's decoded columns at a time: a whole file's hold is its
    // largest group's, not the sum.
    let whole = read(&object, None, 1 << 20, false).expect("footer");
    let each: Vec<u64> = (0..3).map(|g| Footer::read(&tail, want(g, g)).expect("footer").decoded_bytes()).collect();
    assert_eq!(whole.decoded_bytes(), *each.iter().max().expect("groups"));
    assert_eq!(whole.group_count(), 3);
    let err = Footer::read(&tail, want(2, 3)).expect_err("refused").to_string();
    assert!(err.contains("has 3 row groups"), "{err}");
    // The footer alone is not in a piece that ends before it.
    assert!(Footer::read(&Source::piece(len, 0, at(0, len - 9)), want(0, 0)).is_err());
}

#[test]
fn a_missing_or_mistyped_column_and_too_large_columns_are_refused_from_the_footer() {
    let object = file(
        vec![
            ("img", Arc::new(BinaryArray::from(vec![&b"x"[..]; 4])) as ArrayRef),
            ("n", Arc::new(Int64Array::from(vec![1, 2, 3, 4])) as ArrayRef),
        ],
        4,
    );
    let err = |column, max| read(&object, column, max, false).expect_err("refused").to_string();
    assert!(err(None, 1 << 20).contains("no column \"image\"; its columns: img, n"), "{}", err(None, 1 << 20));
    assert!(err(Some("n"), 1 << 20).contains("not encoded images"));
    assert!(err(Some("img"), 10).contains("more than pushdown.max_object_bytes"));
    let (rows, _) =
        read(&object, Some("img"), 1 << 20, false).expect("footer").rows(&Source::whole(object.clone())).expect("rows");
    assert_eq!(rows.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["0", "1", "2", "3"]);
    assert!(rows.iter().all(|r| r.label.is_none()));

    // An `id` column keys the rows an image path does not (strings or integers).
    let ids: [ArrayRef; 2] =
        [Arc::new(StringArray::from(vec![Some("a"), None, Some("c")])), Arc::new(Int64Array::from(vec![7, 8, 9]))];
    for (ids, want) in ids.into_iter().zip([["p0", "1", "c"], ["p0", "8", "9"]]) {
        let object = file(vec![("image", images(&[Some("p0"), None, None], &[b"x", b"y", b"z"])), ("id", ids)], 2);
        let (rows, _) =
            read(&object, None, 1 << 20, false).expect("footer").rows(&Source::whole(object)).expect("rows");
        assert_eq!(rows.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), want);
    }
}

/// Columns are told apart by their Parquet types, as Arrow's mapping told them apart: an
/// unsigned 32-bit label keeps its value, one past `i64` is refused, a date is no label, a
/// large binary is an image and a list of binaries is not.
#[test]
fn columns_are_read_by_their_parquet_types() {
    use arrow_array::{Date32Array, LargeBinaryArray, ListArray, UInt32Array, UInt64Array};
    let labels = |column: ArrayRef| -> Result<Vec<Option<i64>>, PushdownError> {
        let object =
            file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; 2])) as ArrayRef), ("label", column)], 2);
        let (rows, _) = read(&object, None, 1 << 20, false)?.rows(&Source::whole(object))?;
        Ok(rows.iter().map(|r| r.label).collect())
    };
    let big = u32::MAX - 1;
    assert_eq!(labels(Arc::new(UInt32Array::from(vec![big, 7]))).expect("rows"), [Some(i64::from(big)), Some(7)]);
    let err = labels(Arc::new(UInt64Array::from(vec![u64::MAX, 1]))).expect_err("refused").to_string();
    assert!(err.contains("does not fit in 64 bits"), "{err}");
    assert_eq!(labels(Arc::new(Date32Array::from(vec![1, 2]))).expect("rows"), [None, None]);

    let large = file(vec![("image", Arc::new(LargeBinaryArray::from(vec![&b"ab"[..], b"c"])) as ArrayRef)], 2);
    let (rows, _) = read(&large, None, 1 << 20, false).expect("footer").rows(&Source::whole(large)).expect("rows");
    assert_eq!(rows.iter().map(|r| &r.input[..]).collect::<Vec<_>>(), [&b"ab"[..], b"c"]);
    let lists = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    let listed = file(vec![("image", Arc::new(lists) as ArrayRef)], 1);
    let err = read(&listed, None, 1 << 20, false).expect_err("refused").to_string();
    assert!(err.contains("not encoded images"), "{err}");
}

/// A dictionary page that states more values than its bytes can hold is refused before the
/// crate sizes the dictionary by it (2^31 handles: 64 GiB, an abort); an honest one passes,
/// its handles charged against the footer's claim.
#[test]
fn dictionary_pages_are_checked_before_they_are_decoded() {
    struct Pages(Vec<Page>);
    impl Iterator for Pages {
        type Item = parquet::errors::Result<Page>;
        fn next(&mut self) -> Option<Self::Item> {
            self.get_next_page().transpose()
        }
    }
    impl PageReader for Pages {
        fn get_next_page(&mut self) -> parquet::errors::Result<Option<Page>> {
            Ok((!self.0.is_empty()).then(|| self.0.remove(0)))
        }
        fn peek_next_page(&mut self) -> parquet::errors::Result<Option<PageMetadata>> {
            Ok(None)
        }
        fn skip_next_page(&mut self) -> parquet::errors::Result<()> {
            Ok(())
        }
    }
    let dictionary = |num_values| Page::DictionaryPage {
        buf: Bytes::from_static(b"\x01\0\0\0x\x01\0\0\0y"),
        num_values,
        encoding: parquet::basic::Encoding::PLAIN,
        is_sorted: false,
    };
    let pages = |page, limit| CheckedPages {
        inner: Box::new(Pages(vec![page])),
        min_bytes: 4,
        handle: 32,
        decoded: Arc::new(AtomicU64::new(0)),
        limit,
    };
    assert!(pages(dictionary(2), 1024).get_next_page().expect("honest").is_some());
    assert!(pages(dictionary(u32::MAX >> 1), 1 << 40).get_next_page().is_err(), "more values than bytes");
    assert!(pages(dictionary(2), 63).get_next_page().is_err(), "handles past the claim");
}

/// The chunks a Parquet output copies must lie within the bytes read: a piece that lacks one
/// is a `400` when its group is decoded, before any output is written.
#[test]
fn kept_chunks_outside_the_bytes_read_are_refused() {
    let captions: ArrayRef = Arc::new(StringArray::from(vec!["one", "two"]));
    let object =
        file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..], b"y"])) as ArrayRef), ("caption", captions)], 2);
    let len = object.len() as u64;
    let footer = read(&object, None, 1 << 20, true).expect("footer");
    let (start, end) = footer.span().expect("span");
    let caption = footer.metadata.row_group(0).column(1);
    let cut =
        u64::try_from(caption.dictionary_page_offset().unwrap_or_else(|| caption.data_page_offset())).expect("offset");
    assert!(start < cut && cut < end);
    let piece = |to: u64| {
        Source::piece(len, start, object.slice(usize::try_from(start).unwrap()..usize::try_from(to).unwrap()))
    };
    let mut kept = footer.kept();
    let err = footer.group_rows(&piece(cut), 0, kept.as_mut()).expect_err("refused").to_string();
    assert!(err.contains("outside the file"), "{err}");
    assert_eq!(footer.group_rows(&piece(end), 0, kept.as_mut()).expect("rows").len(), 2);
}

#[test]
fn files_the_parquet_crate_panics_on_are_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/parquet");
    let mut refused = 0;
    for entry in std::fs::read_dir(dir).expect("regressions") {
        let object = Bytes::from(std::fs::read(entry.expect("entry").path()).expect("read"));
        let outcome = read(&object, None, 1 << 24, true).and_then(|f| f.rows(&Source::whole(object.clone())));
        refused += usize::from(outcome.is_err());
    }
    assert!(refused >= 12, "{refused}");
}

#[test]
fn a_footer_longer_than_its_bound_or_its_file_is_refused_before_parsing() {
    let object = file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]])) as ArrayRef)], 1);
    let mut long = object[..object.len() - 8].to_vec();
    long.extend_from_slice(&u32::try_from(MAX_FOOTER_BYTES + 1).expect("fits").to_le_bytes());
    long.extend_from_slice(MAGIC);
    for bad in [Bytes::from(long), Bytes::from_static(b"PAR1\0\0\0\0\xff\xff\0\0PAR1")] {
        assert!(is_parquet(&bad));
        assert!(read(&bad, None, 1 << 20, false).expect_err("refused").to_string().contains("footer claims"));
    }
    assert!(!is_parquet(b"PAR1PAR1"));
}

/// A data page: its header (Thrift compact, as writers encode it), then `data`.
fn page(uncompressed: i32, encoding: i32, data: &[u8]) -> Vec<u8> {
    use thrift::protocol::{TCompactOutputProtocol, TFieldIdentifier, TOutputProtocol, TStructIdentifier, TType};
    let mut out = Vec::new();
    {
        let mut p = TCompactOutputProtocol::new(&mut out);
        let field = |p: &mut TCompactOutputProtocol<&mut Vec<u8>>, t, id| {
            p.write_field_begin(&TFieldIdentifier::new("f", t, id)).expect("field");
        };
        let i32s = |p: &mut TCompactOutputProtocol<&mut Vec<u8>>, values: &[(i16, i32)]| {
            for &(id, v) in values {
                field(p, TType::I32, id);
                p.write_i32(v).expect("i32");
                p.write_field_end().expect("end");
            }
        };
        p.write_struct_begin(&TStructIdentifier::new("PageHeader")).expect("struct");
        // type DATA_PAGE, sizes, then the data page header (values, encoding, level encodings).
        i32s(&mut p, &[(1, 0), (2, uncompressed), (3, i32::try_from(data.len()).expect("small"))]);
        field(&mut p, TType::Struct, 5);
        p.write_struct_begin(&TStructIdentifier::new("DataPageHeader")).expect("struct");
        i32s(&mut p, &[(1, 1), (2, encoding), (3, 3), (4, 3)]);
        p.write_field_stop().expect("stop");
        p.write_struct_end().expect("end");
        p.write_field_end().expect("end");
        p.write_field_stop().expect("stop");
        p.write_struct_end().expect("end");
    }
    out.extend_from_slice(data);
    out
}

#[test]
fn page_headers_are_checked_before_the_parquet_crate_reads_a_page() {
    let plain = [page(4, 0, b"abcd"), page(6, 0, b"efghij")].concat();
    check_pages(&plain, 10).expect("within the limit");
    // The sum of the pages' sizes counts, not only each page's.
    assert!(matches!(check_pages(&plain, 9), Err(PushdownError::BadInput(_))));
    // A header of a few bytes claiming 2 GiB (the crate would allocate it before decompressing).
    let bomb = page(i32::MAX, 0, b"abcd");
    let e = check_pages(&bomb, 1 << 20).expect_err("refused");
    assert!(matches!(e, PushdownError::BadInput(_)) && e.to_string().contains("2147483647"), "{e}");
    assert!(matches!(check_pages(&page(-1, 0, b""), 1 << 20), Err(PushdownError::BadInput(_))));
    // Pages running past their chunk, and headers cut short.
    let long = page(4, 0, b"abcd");
    assert!(matches!(check_pages(&long[..long.len() - 1], 1 << 20), Err(PushdownError::BadInput(_))));
    assert!(matches!(check_pages(&long[..3], 1 << 20), Err(PushdownError::BadInput(_))));
    // Encodings whose decoders size buffers by counts inside the page.
    for encoding in [6, 7] {
        let e = check_pages(&page(4, encoding, b"abcd"), 1 << 20).expect_err("refused");
        assert!(matches!(e, PushdownError::Unsupported(_)), "{e}");
    }
}

#[test]
fn a_delta_encoded_input_column_is_refused_before_its_lengths_are_allocated() {
    use parquet::basic::Encoding;
    let batch = RecordBatch::try_from_iter(vec![(
        "image",
        Arc::new(BinaryArray::from(vec![&b"A"[..], b"BB", b"CCC"])) as ArrayRef,
    )])
    .expect("batch");
    let write = |encoding: Option<Encoding>| {
        let mut props = WriterProperties::builder().set_compression(Compression::SNAPPY);
        if let Some(e) = encoding {
            props = props
                .set_column_dictionary_enabled(ColumnPath::from("image"), false)
                .set_column_encoding(ColumnPath::from("image"), e);
        }
        let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props.build())).expect("writer");
        w.write(&batch).expect("write");
        Bytes::from(w.into_inner().expect("close"))
    };
    for (encoding, readable) in
        [(None, true), (Some(Encoding::DELTA_LENGTH_BYTE_ARRAY), false), (Some(Encoding::DELTA_BYTE_ARRAY), false)]
    {
        let object = write(encoding);
        let footer = read(&object, None, 1 << 20, false).expect("footer");
        match footer.rows(&Source::whole(object)) {
            Ok((rows, _)) => {
                assert!(readable, "{encoding:?}");
                assert_eq!(rows.iter().map(|r| &r.input[..]).collect::<Vec<_>>(), [&b"A"[..], b"BB", b"CCC"]);
            }
            Err(e) => assert!(!readable && matches!(e, PushdownError::Unsupported(_)), "{encoding:?}: {e}"),
        }
    }
}

/// An output's outline, from the footer alone, is the output's layout: its length, its row
/// groups' bytes and its tail; and a row group's bytes are those of the output of that group
/// alone (`row-groups`), in both dtypes, with groups of different sizes and kept columns.
#[test]
fn an_outline_from_the_footer_alone_is_the_outputs_layout() {
    let data: Vec<&[u8]> = vec![b"A", b"BB", b"CCC", b"DDDD", b"EEEEE", b"F", b"GG"];
    let captions: ArrayRef =
        Arc::new(StringArray::from(vec![Some("a"), None, Some("c"), Some("d"), None, None, Some("g")]));
    let object = file(
        vec![
            ("caption", captions),
            ("image", Arc::new(BinaryArray::from(data)) as ArrayRef),
            ("label", Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4, 5, 6])) as ArrayRef),
        ],
        3,
    );
    let len = object.len() as u64;
    let at = |from: u64, to: u64| object.slice(usize::try_from(from).unwrap()..usize::try_from(to).unwrap());
    let tail_at = len.saturating_sub(TAIL_BYTES);
    let tail = Source::piece(len, tail_at, at(tail_at, len));
    let want = |row_groups| Reading { max_decoded: 1 << 20, keep: true, row_groups, ..Reading::default() };
    let footer = Footer::read(&tail, want(None)).expect("footer");
    let (per_row, per) = ([2usize, 3], 6usize);
    // Values that differ in every row: the layout must not depend on them.
    let features: Vec<f32> = (0..7 * per).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
    for dtype in [Dtype::F32, Dtype::F16] {
        let outline = outline(&footer, &per_row, dtype, ("m", "s")).expect("outline");
        let (_, kept) =
            read(&object, None, 1 << 20, true).expect("footer").rows(&Source::whole(object.clone())).expect("rows");
        let out = write(&kept.expect("kept"), &features, &[7, 2, 3], dtype, ("m", "s")).expect("write");
        assert_eq!(outline.len, out.len() as u64, "{dtype:?}");
        let tail_start = usize::try_from(outline.tail_start()).unwrap();
        assert_eq!(&out[tail_start..], &outline.tail[..], "{dtype:?}");
        assert_eq!(outline.shape, [7, 2, 3]);
        // A reader's first read of the file's end (pyarrow's 64 KiB) holds only footer.
        assert!(outline.tail.len() > FOOTER_PADDING);
        assert_eq!(outline.known(0, 4).as_deref(), Some(&b"PAR1"[..]));
        assert_eq!(outline.known(outline.tail_start(), outline.len).as_deref(), Some(&outline.tail[..]));
        assert!(outline.known(2, 8).is_none());
        let mut first = 0usize;
        let mut previous = 4u64;
        for (g, &(start, end)) in outline.groups.iter().enumerate() {
            assert_eq!(start, previous, "groups follow each other");
            previous = end;
            let one = Footer::read(&tail, want(Some(RowGroups { first: g, last: g }))).expect("footer");
            let (s, e) = one.span().expect("span");
            let (rows, kept) = one.rows(&Source::piece(len, s, at(s, e))).expect("rows");
            let n = rows.len();
            let piece =
                write(&kept.expect("kept"), &features[first * per..(first + n) * per], &[n, 2, 3], dtype, ("m", "s"))
                    .expect("write");
            let (start, end) = (usize::try_from(start).unwrap(), usize::try_from(end).unwrap());
            assert_eq!(&piece[4..4 + end - start], &out[start..end], "group {g}, {dtype:?}");
            first += n;
        }
        assert_eq!((previous, outline.groups.len()), (outline.tail_start(), 3));
    }
}

/// A whole file served from its outline is pushed down a row group at a time: each group, not
/// the file, is bounded, so a file of more rows than one request reads lays out (and its outline
/// is still its output's layout); a group past the bound, or groups of too many sizes, do not.
#[test]
fn an_outline_bounds_each_row_group_not_the_file() {
    let rows = MAX_SAMPLES + 2_000;
    let object = file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; rows])) as ArrayRef)], 1_000);
    let whole = Source::whole(object);
    let reading = Reading { max_decoded: 1 << 24, keep: true, ..Reading::default() };
    let err = Footer::read(&whole, reading).expect_err("too many rows for one request").to_string();
    assert!(err.contains(&format!("{rows} rows")), "{err}");
    let footer = Footer::read(&whole, Reading { by_group: true, ..reading }).expect("footer");
    assert_eq!((footer.row_count(), footer.group_count()), (rows, 12));
    let laid = outline(&footer, &[3], Dtype::F32, ("m", "s")).expect("outline");
    let (_, kept) = footer.rows(&whole).expect("rows");
    let out = write(&kept.expect("kept"), &vec![1.5; rows * 3], &[rows, 3], Dtype::F32, ("m", "s")).expect("write");
    assert_eq!((laid.len, laid.groups.len()), (out.len() as u64, 12));

    let one = file(
        vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; MAX_SAMPLES + 1])) as ArrayRef)],
        MAX_SAMPLES + 1,
    );
    let err =
        Footer::read(&Source::whole(one), Reading { by_group: true, ..reading }).expect_err("refused").to_string();
    assert!(err.contains("row group 0 holds"), "{err}");

    // Groups of 100, 200, ... 1,400 rows: each size's zeros would be encoded once, 10,500 rows.
    let schema = Arc::new(arrow_schema::Schema::new(vec![Field::new("image", DataType::Binary, false)]));
    let mut w = ArrowWriter::try_new(Vec::new(), schema.clone(), None).expect("writer");
    for n in (1..=14).map(|k| k * 100) {
        let column: ArrayRef = Arc::new(BinaryArray::from(vec![&b"x"[..]; n]));
        w.write(&RecordBatch::try_new(schema.clone(), vec![column]).expect("batch")).expect("write");
        w.flush().expect("a row group per batch");
    }
    let sizes = Bytes::from(w.into_inner().expect("close"));
    let footer = Footer::read(&Source::whole(sizes), Reading { by_group: true, ..reading }).expect("footer");
    let err = outline(&footer, &[3], Dtype::F32, ("m", "s")).expect_err("refused").to_string();
    assert!(err.contains("too many different sizes"), "{err}");
}
