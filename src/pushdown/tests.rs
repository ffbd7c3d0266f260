//! The request path of a pushdown with a fake engine ([`super::inference::fake`]) and sources
//! held in memory: no ONNX Runtime, no store. A request goes through the same phases as in the
//! gateway ([`Pushdown::prepare`], [`Job::read_source`], [`Job::run`]: parse, the governor,
//! batching, inference threads, encode); only the session's arithmetic is fake. The outputs are
//! checked against the fake's function of the inputs; the end-to-end tests check real models
//! against onnxruntime.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::inference::Inference;
use super::inference::fake::{FEATURES, FakeInference, features};
use super::service::Output;
use super::spec::{Dtype, Format, PushdownSpec};
use super::tensor::{Tensor, read_npy, write_npy};
use super::{Pushdown, PushdownError};

/// The model the tests name: the repository's tiny CNN (its ONNX bytes are cut at the split as
/// in the gateway; the fake runs the cut prefix).
const MODEL: &str = "tiny-cnn";
const SAMPLE: [usize; 3] = [3, 32, 32];
const SAMPLE_LEN: usize = 3 * 32 * 32;

struct Fixture {
    service: Arc<Pushdown>,
    fake: Arc<FakeInference>,
    _models: tempfile::TempDir,
}

/// A service over a copy of `models/tiny-cnn` with the fake engine and `max_object_bytes`.
fn fixture(max_object_bytes: u64) -> Fixture {
    let models = tempfile::tempdir().expect("temp dir");
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(MODEL);
    let to = models.path().join(MODEL);
    std::fs::create_dir(&to).expect("model dir");
    for file in ["manifest.toml", "model.onnx"] {
        std::fs::copy(from.join(file), to.join(file)).expect("model file");
    }
    let settings = crate::config::PushdownSettings {
        models_dir: models.path().to_owned(),
        max_object_bytes,
        ..Default::default()
    };
    let cfg = settings.pushdown_config(crate::metrics::Metrics::new());
    let fake = Arc::new(FakeInference::default());
    let service = Arc::new(Pushdown::with_inference(cfg, Ok(fake.clone() as Arc<dyn Inference>)));
    Fixture { service, fake, _models: models }
}

fn spec(split: &str, format: Option<Format>) -> PushdownSpec {
    PushdownSpec {
        model: MODEL.into(),
        split: split.into(),
        format,
        dtype: Dtype::F32,
        batch: None,
        column: None,
        row_groups: None,
        seq: None,
        augment: None,
    }
}

/// Sample `i`'s input: distinct values in [-1, 1).
fn sample(i: usize) -> Vec<f32> {
    (0..SAMPLE_LEN).map(|j| ((i * 7 + j * 13) % 2000) as f32 / 1000.0 - 1.0).collect()
}

fn npy(shape: Vec<usize>, data: Vec<f32>) -> Bytes {
    Bytes::from(write_npy(&Tensor { shape, data }, Dtype::F32))
}

/// Samples the engine of `split` ran for requests (not its start's probes).
fn samples_run(f: &Fixture, split: &str) -> u64 {
    let label = crate::metrics::ModelSplit { model: MODEL.into(), split: split.into() };
    f.service.cfg.metrics.pushdown_samples.get_or_create(&label).get()
}

/// One request through the path, its source read from memory.
async fn request(service: &Arc<Pushdown>, spec: PushdownSpec, source: Bytes) -> Result<Output, PushdownError> {
    let mut job = service.prepare(spec, "tenant")?.expect("a pushdown, not a plain read");
    let declared = Some(source.len() as u64);
    let object = job.read_source(crate::body::Body::from(source), declared).await?;
    job.run(object).await
}

#[tokio::test]
async fn one_npy_sample_runs_through_the_engine() {
    let f = fixture(1 << 20);
    let out = request(&f.service, spec("block1", None), npy(SAMPLE.to_vec(), sample(0))).await.expect("output");
    assert_eq!((out.content_type, out.split.as_str()), ("application/x-npy", "block1"));
    let t = read_npy(&out.body).expect("npy out");
    assert_eq!(t.shape, vec![FEATURES]);
    assert_eq!(t.data, features(&sample(0)));
    // The first worker's session and the check's full-model session (the second worker's may
    // still be starting).
    assert!((2..=3).contains(&f.fake.sessions.load(Ordering::SeqCst)));
    assert_eq!(samples_run(&f, "block1"), 1);
}

#[tokio::test]
async fn a_batch_keeps_its_order_and_reuses_the_engine() {
    let f = fixture(1 << 20);
    let n = 5;
    let mut shape = vec![n];
    shape.extend(SAMPLE);
    let data: Vec<f32> = (0..n).flat_map(sample).collect();
    for _ in 0..2 {
        let out = request(&f.service, spec("pool", None), npy(shape.clone(), data.clone())).await.expect("output");
        let t = read_npy(&out.body).expect("npy out");
        assert_eq!(t.shape, vec![n, FEATURES]);
        let want: Vec<f32> = (0..n).flat_map(|i| features(&sample(i))).collect();
        assert_eq!(t.data, want);
    }
    // One engine served both requests: its two workers' sessions and the check's, no more.
    assert_eq!(f.service.engine_memory().len(), 1);
    assert!(f.fake.sessions.load(Ordering::SeqCst) <= 3);
    assert_eq!(samples_run(&f, "pool"), 2 * n as u64);
}

#[tokio::test]
async fn a_shard_answers_per_key_in_shard_order() {
    let f = fixture(1 << 20);
    let keys = ["b/0002", "a/0001", "c/0003"];
    let mut tar = tar::Builder::new(Vec::new());
    for (i, key) in keys.iter().enumerate() {
        for (ext, data) in [("npy", npy(SAMPLE.to_vec(), sample(i)).to_vec()), ("cls", i.to_string().into_bytes())] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            tar.append_data(&mut h, format!("{key}.{ext}"), data.as_slice()).expect("member");
        }
    }
    let shard = Bytes::from(tar.into_inner().expect("tar"));
    let out = request(&f.service, spec("block2", None), shard.clone()).await.expect("output");
    assert_eq!(out.content_type, "application/vnd.safetensors");
    let st = safetensors::SafeTensors::deserialize(&out.body).expect("safetensors");
    let view = st.tensor("features").expect("features");
    assert_eq!(view.shape(), [keys.len(), FEATURES]);
    let got: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4"))).collect();
    let want: Vec<f32> = (0..keys.len()).flat_map(|i| features(&sample(i))).collect();
    assert_eq!(got, want);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&out.body).expect("metadata");
    let meta = meta.metadata().clone().expect("metadata");
    assert_eq!(meta["keys"], serde_json::to_string(&keys).expect("json"));
    assert_eq!((meta["model"].as_str(), meta["split"].as_str()), (MODEL, "block2"));

    // As a tar: each key's features, then its other members as they were.
    let out = request(&f.service, spec("block2", Some(Format::Tar)), shard).await.expect("tar output");
    let mut archive = tar::Archive::new(&out.body[..]);
    let names: Vec<String> = archive
        .entries()
        .expect("entries")
        .map(|e| e.expect("entry").path().expect("path").to_string_lossy().into_owned())
        .collect();
    let want: Vec<String> = keys.iter().flat_map(|k| [format!("{k}.npy"), format!("{k}.cls")]).collect();
    assert_eq!(names, want);
}

/// A shard of `n` PNG images (keyed `{i}`, labelled `{i % 3}`).
fn png_shard(n: usize) -> Bytes {
    let mut tar = tar::Builder::new(Vec::new());
    for i in 0..n {
        let mut image = Vec::new();
        let mut encoder = png::Encoder::new(&mut image, 40, 36);
        encoder.set_color(png::ColorType::Rgb);
        let pixels: Vec<u8> = (0..40 * 36 * 3).map(|j| ((j * 7 + i * 31) % 256) as u8).collect();
        encoder.write_header().and_then(|mut w| w.write_image_data(&pixels)).expect("png");
        for (ext, data) in [("png", image), ("cls", (i % 3).to_string().into_bytes())] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            tar.append_data(&mut h, format!("{i}.{ext}"), data.as_slice()).expect("member");
        }
    }
    Bytes::from(tar.into_inner().expect("tar"))
}

/// A streamed shard request: the layout and the bytes as they come, and the job's end.
async fn streamed(
    service: &Arc<Pushdown>,
    format: Format,
    shard: Bytes,
    went_away: super::stream::WentAway,
) -> (
    tokio::sync::oneshot::Receiver<super::stream::Laid>,
    tokio::sync::mpsc::UnboundedReceiver<Bytes>,
    tokio::task::JoinHandle<Result<Output, PushdownError>>,
) {
    let (laid, laid_rx) = tokio::sync::oneshot::channel();
    let (bytes, rx) = tokio::sync::mpsc::unbounded_channel();
    let streaming = super::stream::Streaming {
        laid: Box::new(move |l| {
            let _ = laid.send(l);
        }),
        bytes: Some(bytes),
        went_away,
    };
    let service = service.clone();
    let job = tokio::spawn(async move {
        let mut job = service.prepare(spec("pool", Some(format)), "tenant")?.expect("a pushdown");
        job.stream_to(streaming);
        let declared = Some(shard.len() as u64);
        let object = job.read_source(crate::body::Body::from(shard), declared).await?;
        job.run(object).await
    });
    (laid_rx, rx, job)
}

// The test holds the fake's gate across awaits on purpose: the engine's threads, not this
// task, wait on it.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_is_laid_out_before_any_sample_runs_then_streamed_in_order() {
    let f = fixture(1 << 20);
    // The engine started (its probe runs the session) before the runs are held back.
    request(&f.service, spec("pool", None), npy(SAMPLE.to_vec(), sample(0))).await.expect("warm");
    let shard = png_shard(9);
    for format in [Format::Npy, Format::Safetensors, Format::Tar] {
        let whole = request(&f.service, spec("pool", Some(format)), shard.clone()).await.expect("whole");
        let held = f.fake.gate.lock().expect("gate");
        let (laid, mut rx, job) = streamed(&f.service, format, shard.clone(), Box::new(|| None)).await;
        let laid = laid.await.expect("laid out while no sample can run");
        assert_eq!((laid.len, laid.shape.as_slice()), (whole.body.len() as u64, [9, FEATURES].as_slice()));
        assert_eq!((laid.content_type, laid.source_bytes), (whole.content_type, shard.len() as u64));
        let mut got = rx.recv().await.expect("the head").to_vec();
        assert!(rx.try_recv().is_err(), "{format:?}: no sample's bytes before its run");
        drop(held);
        while let Some(bytes) = rx.recv().await {
            got.extend_from_slice(&bytes);
        }
        let out = job.await.expect("job").expect("output");
        assert_eq!((got.as_slice(), &out.body), (whole.body.as_ref(), &whole.body), "{format:?}");
    }

    // A client gone: the job stops when no place is left to finish in, else goes on.
    for (keep, finishes) in [(false, false), (true, true)] {
        let went_away: super::stream::WentAway =
            Box::new(move || keep.then(|| Box::new(()) as Box<dyn std::any::Any + Send>));
        let held = f.fake.gate.lock().expect("gate");
        let (laid, rx, job) = streamed(&f.service, Format::Npy, shard.clone(), went_away).await;
        laid.await.expect("laid out");
        drop(rx);
        drop(held);
        let end = job.await.expect("job");
        assert_eq!(end.is_ok(), finishes, "{end:?}");
        if !finishes {
            assert!(matches!(end, Err(PushdownError::Unwanted)));
        }
    }
}

#[tokio::test]
async fn bad_requests_are_refused_before_any_sample_runs() {
    let f = fixture(64 * 1024);
    let wrong = |e: &PushdownError| format!("{e:?}");

    let unknown = PushdownSpec { model: "nope".into(), ..spec("block1", None) };
    let e = f.service.prepare(unknown, "tenant").expect_err("unknown model");
    assert!(matches!(e, PushdownError::UnknownModel { ref known, .. } if known == MODEL), "{}", wrong(&e));

    let e = f.service.prepare(spec("block9", None), "tenant").expect_err("unknown split");
    assert!(matches!(e, PushdownError::UnknownSplit { .. }), "{}", wrong(&e));

    // Larger than pushdown.max_object_bytes: refused from what the source declares.
    let big = npy(vec![8, 3, 32, 32], vec![0.0; 8 * SAMPLE_LEN]);
    let e = request(&f.service, spec("block1", None), big).await.expect_err("too large");
    assert!(matches!(e, PushdownError::ObjectTooLarge { limit: 65_536 }), "{}", wrong(&e));

    // A tar output of a source that is not a shard.
    let e = request(&f.service, spec("block1", Some(Format::Tar)), npy(SAMPLE.to_vec(), sample(1)))
        .await
        .expect_err("tar of one sample");
    assert!(matches!(e, PushdownError::InvalidArgument { ref field, .. } if field == "format"), "{}", wrong(&e));

    // A sample of the wrong shape, and bytes that are no input at all.
    let e = request(&f.service, spec("block1", None), npy(vec![3, 16, 16], vec![0.0; 768])).await.expect_err("shape");
    assert!(matches!(e, PushdownError::BadInput(_)), "{}", wrong(&e));
    let e = request(&f.service, spec("block1", None), Bytes::from_static(b"hello")).await.expect_err("not input");
    assert!(matches!(e, PushdownError::Unsupported(_) | PushdownError::BadInput(_)), "{}", wrong(&e));

    // Every refusal came before any sample ran.
    assert_eq!(samples_run(&f, "block1"), 0);
}

#[tokio::test]
async fn without_a_runtime_pushdown_is_unavailable() {
    let models = tempfile::tempdir().expect("temp dir");
    let settings = crate::config::PushdownSettings { models_dir: models.path().to_owned(), ..Default::default() };
    let service = Arc::new(Pushdown::with_inference(
        settings.pushdown_config(crate::metrics::Metrics::new()),
        Err("no runtime".into()),
    ));
    assert_eq!(service.available(), Err("no runtime"));
    let e = service.prepare(spec("block1", None), "tenant").expect_err("unavailable");
    assert!(matches!(e, PushdownError::Unavailable(ref why) if why == "no runtime"), "{e:?}");
}

#[tokio::test]
async fn a_run_that_panics_fails_its_batch_and_the_engine_serves_on() {
    let f = fixture(1 << 20);
    let source = || npy(SAMPLE.to_vec(), sample(3));
    request(&f.service, spec("stem", None), source()).await.expect("first output");
    let sessions = f.fake.sessions.load(Ordering::SeqCst);
    assert!(f.service.inject_worker_panic(MODEL, "stem"));
    let e = request(&f.service, spec("stem", None), source()).await.expect_err("the panicked run's error");
    assert!(matches!(e, PushdownError::Internal(ref m) if m.contains("retry")), "{e:?}");
    let label = crate::metrics::ReasonLabel { reason: "run_panicked" };
    assert_eq!(f.service.cfg.metrics.engine_failures.get_or_create(&label).get(), 1);
    // The worker built a fresh session and the next request is answered.
    let out = request(&f.service, spec("stem", None), source()).await.expect("output after the panic");
    assert_eq!(read_npy(&out.body).expect("npy").data, features(&sample(3)));
    assert!(f.fake.sessions.load(Ordering::SeqCst) > sessions);
}
