//! One pushdown request's work ([`Job`]): its source read under the memory budget, parsed into
//! samples, preprocessed, run through the prefix and encoded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{FutureExt, TryStreamExt};

use super::encode::{ShardLayout, stack, tar_overhead, write_tar};
use super::engine::Engine;
use super::error::PushdownError;
use super::parse::{
    Item, JobInput, Kind, Parsed, Planned, SourceLimits, drawn_in_source_order, parse, plan_images, split_def,
    table_rows,
};
use super::registry::Model;
use super::service::{Output, Pushdown, Run};
use super::spec::{Dtype, Format, PushdownSpec};
use super::stream::{Laid, Sender, Streaming};
use super::tensor::Tensor;
use super::{governor, memory, table, tensor};

/// One pushdown request, resolved ([`Pushdown::prepare`]): the model and split, named once, its
/// engine, and every memory hold the request takes (its source, its samples' outputs), released
/// together when the response has been sent ([`Output::reservation`]).
#[derive(Debug)]
pub(crate) struct Job {
    pub(super) service: Arc<Pushdown>,
    /// The request's fields, `split=auto` resolved.
    pub(super) spec: PushdownSpec,
    pub(super) model: Arc<Model>,
    /// The split's manifest name (an index in the request names it too).
    pub(super) split: String,
    pub(super) tenant: String,
    /// The predicted epoch seconds per candidate when `split=auto` chose the split.
    pub(super) plan: Option<String>,
    /// The split's engine and its memory model, from before the source is held.
    pub(super) engine: Option<(Arc<Engine>, memory::MemoryModel, usize)>,
    /// How long [`Self::read_source`] waited for the engine (not part of the source's fetch).
    pub(super) engine_wait: Duration,
    pub(super) source: Option<governor::Held>,
    /// When the request arrived, among all pushdown requests, or where its client's order puts it
    /// (`Pushdown::arrivals`): its samples are decoded and run after those of the tenant's earlier
    /// requests (ADR 0019, ADR 0021).
    pub(super) arrival: u64,
    /// Where a shard's output goes while it is computed ([`Self::stream_to`]).
    pub(super) streaming: Option<Streaming>,
    /// The source object's key: what a single image's augmentation draws from
    /// ([`Self::name_object`]).
    pub(super) object: String,
}

impl Job {
    /// The request's fields with the split resolved.
    #[must_use]
    pub(crate) fn spec(&self) -> &PushdownSpec {
        &self.spec
    }

    /// `x-tensorgate-plan`: what `split=auto` predicted per candidate, when it chose.
    #[must_use]
    pub(crate) fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// What determines the output beside the source object: the model's version (its file,
    /// manifest and tokenizer), the split, the format, the dtype, a Parquet input column and row
    /// groups, and an augmentation with its seed (the cache key's variant).
    #[must_use]
    pub(crate) fn variant(&self) -> String {
        let mut v = format!("{}|{}|{:?}|{}", self.model.version, self.split, self.spec.format, self.spec.dtype.name());
        if let Some(c) = &self.spec.column {
            v.push_str(&format!("|column={c}"));
        }
        if let Some(g) = self.spec.row_groups {
            v.push_str(&format!("|row-groups={g}"));
        }
        if let Some(a) = &self.spec.augment {
            v.push_str(&format!("|augment={a}|seed={}", a.seed));
        }
        v
    }

    /// Names the source object: a single image's random augmentation draws from its key
    /// (ADR 0032).
    pub(crate) fn name_object(&mut self, key: &str) {
        key.clone_into(&mut self.object);
    }

    /// How long reading the source waited for the split's engine to start (a fetch's time
    /// without it is the store's).
    #[must_use]
    pub(crate) fn engine_wait(&self) -> Duration {
        self.engine_wait
    }

    /// The split's engine (started if need be) and its memory model and batch cap.
    pub(super) async fn engine(&self) -> Result<(Arc<Engine>, memory::MemoryModel, usize), PushdownError> {
        if let Some(e) = &self.engine {
            return Ok(e.clone());
        }
        let engine = self.service.engine(&self.model, &self.split).await?;
        let (memory, batch_cap) = engine.memory_model().await?;
        Ok((engine, memory, batch_cap))
    }

    /// Reads a source body under the memory budget and a deadline. The split's engine is started
    /// first, while the request holds nothing (an engine waiting for memory that sources hold
    /// would wait on itself). The object counts against the budget from before its first byte
    /// until the response is sent: at `declared` bytes, or while a source without a length (a
    /// chunked answer from a store or a peer) is read, at the most it may be
    /// (`pushdown.max_object_bytes`), then at what arrived; it is admitted only with room left
    /// for a request's outputs ([`governor::Governor::hold_source`]).
    ///
    /// # Errors
    /// The budget's refusal, a source past `max_object_bytes`, a read that failed or ran past
    /// `pushdown.source_timeout_secs`.
    pub(crate) async fn read_source(
        &mut self,
        body: crate::body::Body,
        declared: Option<u64>,
    ) -> Result<Bytes, PushdownError> {
        use http_body_util::BodyExt;
        let limit = self.service.cfg.max_object_bytes;
        let bound = declared.map_or(limit, |n| n.min(limit));
        self.service.node.governor.could_ever_hold(bound)?;
        let waited = Instant::now();
        let engine = self.engine().await?;
        self.engine_wait = waited.elapsed();
        let one_sample = engine.1.queued_bytes_per_sample + engine.1.held_bytes_per_sample;
        self.engine = Some(engine);
        let mut hold = self.service.node.governor.hold_source(bound, one_sample).await?;
        let timeout = self.service.cfg.source_timeout;
        let read = http_body_util::Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).collect();
        let object = match tokio::time::timeout(timeout, read).await {
            Err(_) => return Err(PushdownError::SourceTimeout { secs: timeout.as_secs() }),
            Ok(Ok(c)) => c.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(PushdownError::ObjectTooLarge { limit });
            }
            Ok(Err(e)) => return Err(PushdownError::SourceRead(e.to_string())),
        };
        hold.shrink_to(object.len() as u64);
        self.source = Some(hold);
        Ok(object)
    }

    /// Streams the output while it is computed, where it is a shard's (ADR 0031): the layout
    /// is told once the shard is parsed, then its bytes in order as they are ready. Other
    /// outputs drop `streaming` unused.
    pub(crate) fn stream_to(&mut self, streaming: Streaming) {
        self.streaming = Some(streaming);
    }

    /// Whether the request reads its source by ranges: a Parquet file's row groups.
    #[must_use]
    pub(crate) fn ranged(&self) -> bool {
        self.spec.row_groups.is_some()
    }

    /// Checks the footer in a Parquet file's tail (read by [`Self::read_source`] from a ranged
    /// read of its last [`table::TAIL_BYTES`], at `offset` in a file of `len` bytes) for the row
    /// groups the request names, on a blocking thread, and gives the tail's hold back (the
    /// decoding reads the groups' bytes only). Returns the footer and the bytes of the named
    /// groups (`[start, end)`), to read next ([`Self::read_source`], then [`Self::run_table`]).
    ///
    /// # Errors
    /// What [`table::Footer::read`] refuses.
    pub(crate) async fn read_footer(
        &mut self,
        (len, offset, tail): (u64, u64, Bytes),
    ) -> Result<(table::Footer, (u64, u64)), PushdownError> {
        let limits = self.limits();
        let text = self.model.tokenizer.is_some();
        let read = tokio::task::spawn_blocking(move || {
            let footer = table::Footer::read(&table::Source::piece(len, offset, tail), limits.reading(text))?;
            let span = footer.span()?;
            Ok((footer, span))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))?;
        self.source = None;
        read
    }

    /// The outline of this request's Parquet output (`format=parquet`, the whole file) from the
    /// file's tail (read by [`Self::read_source`]: its bytes from `offset` of `len`): the footer
    /// read for every row group (each then pushed down on its own, so each, not the file, is
    /// bounded), the split's output shape from its engine (started if need be), laid out on a
    /// blocking thread ([`table::outline`]). Nothing is decoded or run.
    ///
    /// # Errors
    /// `InvalidArgument` for a source that is not a Parquet file; what [`table::Footer::read`]
    /// and [`table::outline`] refuse.
    pub(crate) async fn outline(
        &mut self,
        (len, offset, tail): (u64, u64, Bytes),
    ) -> Result<table::Outline, PushdownError> {
        if !tail.ends_with(b"PAR1") {
            return Err(parquet_only());
        }
        let (limits, text) = (self.limits(), self.model.tokenizer.is_some());
        let footer = tokio::task::spawn_blocking(move || {
            let reading = table::Reading { by_group: true, ..limits.reading(text) };
            table::Footer::read(&table::Source::piece(len, offset, tail), reading)
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))??;
        self.source = None;
        let (_, memory, _) = self.engine().await?;
        let (dtype, names) = (self.spec.dtype, (self.model.manifest.name.clone(), self.split.clone()));
        tokio::task::spawn_blocking(move || table::outline(&footer, &memory.output_shape, dtype, (&names.0, &names.1)))
            .await
            .map_err(|e| PushdownError::Internal(e.to_string()))?
    }

    /// Whether the output is served from its outline (ADR 0030): a Parquet output of a whole
    /// file.
    #[must_use]
    pub(crate) fn outlined(&self) -> bool {
        self.spec.format == Some(Format::Parquet) && !self.ranged()
    }

    /// The tenant the request counts against.
    #[must_use]
    pub(crate) fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The split's name in the model's manifest.
    #[must_use]
    pub(crate) fn split_name(&self) -> &str {
        &self.split
    }

    /// Runs the prefix on the row groups of a Parquet file read by ranges: `footer` from
    /// [`Self::read_footer`], `source` the groups' bytes. As [`Self::run`] does on a whole object.
    ///
    /// # Errors
    /// As [`Self::run`].
    pub(crate) async fn run_table(
        mut self,
        source: table::Source,
        footer: table::Footer,
    ) -> Result<Output, PushdownError> {
        let service = self.service.clone();
        let mut out = service.compute(&self, JobInput::Table(source, Box::new(footer)), None).await?;
        out.reservation.extend(self.source.take());
        Ok(out)
    }

    /// What parsing the source may take ([`SourceLimits`]), from the request.
    pub(super) fn limits(&self) -> SourceLimits {
        SourceLimits {
            column: self.spec.column.clone(),
            max_decoded: self.service.cfg.max_object_bytes,
            keep_columns: self.spec.format == Some(Format::Parquet),
            row_groups: self.spec.row_groups,
        }
    }

    /// Runs the prefix on the object's bytes and encodes the result. Samples are preprocessed on
    /// blocking threads and enqueued as they are ready, so decoding sample i+1 overlaps inference
    /// of sample i. Each sample is first admitted by the memory governor for the tenant (module
    /// docs of [`governor`]): at most the request's allotment are in flight at once. The output
    /// carries every hold of the job.
    ///
    /// # Errors
    /// Unusable input, overload (queue full or memory wait too long), or inference failure.
    pub async fn run(mut self, object: Bytes) -> Result<Output, PushdownError> {
        let (service, streaming) = (self.service.clone(), self.streaming.take());
        let mut out = service.compute(&self, JobInput::Object(object), streaming).await?;
        out.reservation.extend(self.source.take());
        Ok(out)
    }
}

/// What turns a request into a job, and a job's input into its output: the request's side of the
/// service.
impl Pushdown {
    /// Resolves a request's model and split once, before any byte of the source is read:
    /// `split=auto` becomes the tenant's planned split (`None` when the plan says no pushdown: a
    /// plain GET), and the model and split are checked against the registry. The job then holds
    /// every reservation the request makes.
    ///
    /// # Errors
    /// Pushdown unavailable, unknown model or split (naming what exists).
    pub(crate) fn prepare(
        self: &Arc<Self>,
        mut spec: PushdownSpec,
        tenant: &str,
    ) -> Result<Option<Job>, PushdownError> {
        let mut plan = None;
        if spec.split == crate::planner::AUTO {
            let (split, chosen) = self.auto_split(tenant, &spec.model).ok_or_else(|| PushdownError::UnknownModel {
                name: spec.model.clone(),
                known: self.registry.load().names().join(", "),
            })?;
            if split == crate::planner::NO_PUSHDOWN {
                return Ok(None);
            }
            plan = chosen.map(|p| {
                let parts: Vec<String> =
                    p.candidates.iter().filter_map(|c| c.epoch_secs.map(|t| format!("{}={t:.3}", c.split))).collect();
                parts.join(";")
            });
            spec.split = split;
        }
        self.available().map_err(|r| PushdownError::Unavailable(r.to_owned()))?;
        let model = self.model(&spec.model)?;
        let split = split_def(&model, &spec.split)?.name.clone();
        if let Some(a) = &spec.augment {
            augmentable(a, &model)?;
        }
        let arrival = self.arrivals.number(spec.seq.as_ref());
        Ok(Some(Job {
            service: self.clone(),
            spec,
            model,
            split,
            tenant: tenant.to_owned(),
            plan,
            engine: None,
            engine_wait: Duration::ZERO,
            source: None,
            arrival,
            streaming: None,
            object: String::new(),
        }))
    }

    /// Runs the prefix on an object's bytes and encodes the result ([`Job::run`]), in phases:
    /// parse the source into samples ([`Self::parse_source`]), admit the outputs' memory
    /// ([`Self::admit_outputs`]), run the samples ([`Self::infer`]), encode ([`encode_output`]).
    /// A shard's output is laid out once it is parsed and its samples' pieces are encoded as
    /// they are computed ([`Self::infer_shard`]), streamed where the request path asks.
    pub(super) async fn compute(
        &self,
        job: &Job,
        input: JobInput,
        mut streaming: Option<Streaming>,
    ) -> Result<Output, PushdownError> {
        let (engine, memory, batch_cap) = job.engine().await?;
        let source_bytes = match &input {
            JobInput::Object(object) => object.len() as u64,
            JobInput::Table(..) => 0,
        };
        let t0 = Instant::now();
        let (mut parsed, plans, table_source) = self.parse_source(job, input).await?;
        let augmented = parsed.drawn.first().copied().flatten().filter(|_| parsed.kind == Kind::Single);
        if output_format(job, parsed.kind) == Format::Tar {
            draws_as_members(&mut parsed)?;
        }
        let parse_time = t0.elapsed();
        let layout = shard_layout(job, &parsed, &memory.output_shape)?;
        let laid =
            |l: &ShardLayout| Laid { len: l.len, shape: l.shape(), content_type: content_type(l.format), source_bytes };
        // A `HEAD` has its answer once the output is laid out, before any memory is held for
        // outputs; a `GET`'s headers go once its outputs are admitted (a refusal is then still
        // the request's answer).
        if let (Some(l), Some(s)) = (&layout, &streaming)
            && s.bytes.is_none()
        {
            let s = streaming.take().expect("matched");
            let _ = Sender::start(s, laid(l));
            return Err(PushdownError::Unwanted);
        }

        let t1 = Instant::now();
        let (stream, outputs_held) = self.admit_outputs(job, &parsed, &memory).await?;
        let sender = match (&layout, streaming) {
            (Some(l), Some(s)) => Sender::start(s, laid(l)),
            _ => None,
        };
        // Adaptive: samples of all requests batch together up to the engine's cap (what its
        // reservation covers). Comparison mode: batches as large as the requested storage batch
        // (HAPI without adaptation runs the training batch as one storage batch).
        let cap = if self.node.governor.config().adaptive { batch_cap } else { stream.allotment() };
        let label = crate::metrics::TenantLabel { tenant: job.tenant.clone() };
        let samples = self.cfg.metrics.tenant_samples.get_or_create(&label).clone();
        let run = Run {
            engine: &engine,
            model: &job.model,
            stream: &stream,
            samples: &samples,
            cap,
            tenant: &job.tenant,
            arrival: job.arrival,
            augment: job.spec.augment,
        };
        let (body, shape, content_type, groups_time, encode) = match layout {
            Some(layout) => {
                let (body, encode) = self.infer_shard(&run, parsed, plans, layout.clone(), sender).await?;
                (body, layout.shape(), content_type(layout.format), Duration::ZERO, encode)
            }
            None => {
                let (parsed, outputs, groups_time) = self.infer(&run, parsed, plans, table_source).await?;
                let t2 = Instant::now();
                let (body, shape, content_type) = encode_output(job, parsed, outputs).await?;
                (Bytes::from(body), shape, content_type, groups_time, t2.elapsed())
            }
        };
        let infer_time = t1.elapsed().saturating_sub(groups_time + encode);
        tracing::debug!(arrival = job.arrival, bytes = body.len(), "Output encoded.");
        drop(stream);
        Ok(Output {
            body,
            content_type,
            shape,
            split: job.split.clone(),
            decode: parse_time + groups_time,
            infer: infer_time,
            encode,
            augmented,
            reservation: vec![outputs_held],
        })
    }

    /// Infer phase of a shard laid out before it is computed: every sample through the engine
    /// ([`Self::sample_runs`]), each run of samples ready in source order encoded into its pieces
    /// on a blocking thread as it completes, and sent on (`sender`) as it is. Returns the whole
    /// output and the time spent encoding.
    async fn infer_shard(
        &self,
        run: &Run<'_>,
        mut parsed: Parsed,
        plans: Vec<Planned>,
        layout: Arc<ShardLayout>,
        mut sender: Option<Sender>,
    ) -> Result<(Bytes, Duration), PushdownError> {
        let mut send = |bytes: &Bytes| sender.as_mut().map_or(Ok(()), |s| s.send(bytes.clone()));
        let (items, order) = (std::mem::take(&mut parsed.items), std::mem::take(&mut parsed.order));
        let mut pieces = Vec::with_capacity(order.len() + 2);
        pieces.push(layout.head.clone());
        send(&layout.head)?;
        let runs = self.sample_runs(run, (items, plans, order), &parsed.keys);
        let mut runs = std::pin::pin!(runs);
        let (mut ready, mut next, mut encoding) = (std::collections::BTreeMap::new(), 0, Duration::ZERO);
        while let Some((i, out)) = runs.try_next().await? {
            ready.insert(i, out);
            // With the outputs already computed: one blocking task encodes them all.
            while let Some(polled) = runs.try_next().now_or_never() {
                let Some((i, out)) = polled? else { break };
                ready.insert(i, out);
            }
            let mut batch = Vec::new();
            while let Some(out) = ready.remove(&next) {
                batch.push((next, out));
                next += 1;
            }
            if batch.is_empty() {
                continue;
            }
            let (t, layout) = (Instant::now(), layout.clone());
            let encoded = tokio::task::spawn_blocking(move || {
                batch.iter().map(|(i, out)| layout.piece(*i, out).map(Bytes::from)).collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|e| PushdownError::Internal(e.to_string()))??;
            encoding += t.elapsed();
            for piece in encoded {
                send(&piece)?;
                pieces.push(piece);
            }
        }
        tracing::debug!(arrival = run.arrival, "Samples computed.");
        send(&layout.tail)?;
        pieces.push(layout.tail.clone());
        let t = Instant::now();
        let body = tokio::task::spawn_blocking(move || Bytes::from(pieces.concat()))
            .await
            .map_err(|e| PushdownError::Internal(e.to_string()))?;
        if body.len() as u64 != layout.len {
            return Err(PushdownError::Internal(format!(
                "a shard's output is {} bytes, laid out as {}",
                body.len(),
                layout.len
            )));
        }
        Ok((body, encoding + t.elapsed()))
    }

    /// Parse phase, on a blocking thread: the source as samples in engine order, each image's
    /// scratch cost from its header (a Parquet file's rows are decoded later, group by group,
    /// once the governor holds what that takes), and the source as a Parquet file when it is one.
    async fn parse_source(
        &self,
        job: &Job,
        input: JobInput,
    ) -> Result<(Parsed, Vec<Planned>, Option<table::Source>), PushdownError> {
        let model = job.model.clone();
        let (augment, object_key) = (job.spec.augment, job.object.clone());
        let limits = (self.cfg.max_image_pixels, self.cfg.max_request_pixels);
        let format = job.spec.format;
        let source = job.limits();
        let (object, table_source, footer) = match input {
            JobInput::Object(object) => {
                let table = table::is_parquet(&object).then(|| table::Source::whole(object.clone()));
                (object, table, None)
            }
            JobInput::Table(source, footer) => (Bytes::new(), Some(source), Some(footer)),
        };
        let whole_table = table_source.clone().filter(|_| footer.is_none());
        let (parsed, plans) = tokio::task::spawn_blocking(move || {
            if format == Some(Format::Parquet) && whole_table.is_none() && footer.is_none() {
                return Err(parquet_only());
            }
            let mut parsed = match footer {
                Some(footer) => Parsed::table(Some(*footer)),
                None => parse(&object, whole_table.as_ref(), &model, &source)?,
            };
            if format == Some(Format::Tar) && parsed.kind != Kind::Shard {
                return Err(PushdownError::InvalidArgument {
                    field: "format".into(),
                    message: "tar is for WebDataset shards; this object is not one (use npy or safetensors)".into(),
                });
            }
            parsed.put_in_engine_order(model.manifest.text.is_some());
            let plans = plan_images(&parsed, &model.manifest, limits, (augment.as_ref(), &object_key))?;
            if augment.is_some() {
                parsed.drawn = drawn_in_source_order(&plans, &parsed.order);
            }
            Ok::<_, PushdownError>((parsed, plans))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))??;
        Ok((parsed, plans, table_source))
    }

    /// Admit phase: the request's stream of samples from the governor, with its outputs held
    /// (ADR 0006). A tar body also holds copies of the samples' other members and its framing; a
    /// Parquet file's decoded columns live as long as its samples, and a Parquet body holds its
    /// kept columns again.
    async fn admit_outputs(
        &self,
        job: &Job,
        parsed: &Parsed,
        memory: &memory::MemoryModel,
    ) -> Result<(governor::Stream, governor::Held), PushdownError> {
        let samples = parsed.table.as_ref().map_or(parsed.items.len(), table::Footer::row_count);
        let tar_bytes = if job.spec.format == Some(Format::Tar) {
            u64::try_from(tar_overhead(&parsed.keys, &parsed.others)).unwrap_or(u64::MAX)
        } else {
            0
        };
        let decoded_bytes = parsed.table.as_ref().map_or(0, |t| t.decoded_bytes().saturating_add(t.output_bytes()));
        let held =
            (memory.held_bytes_per_sample * samples as u64).saturating_add(tar_bytes).saturating_add(decoded_bytes);
        let ask = governor::StreamAsk {
            per_sample: memory.queued_bytes_per_sample,
            held,
            requested: job.spec.batch,
            // One request alone never fills its engine's queue (a full queue refuses samples
            // with `503`): at most half of it in flight. Images are paced by their decoding;
            // ready inputs (`.npy` batches, texts) would otherwise all be queued at once.
            samples: samples.min((self.cfg.engine.queue_capacity / 2).max(1)),
        };
        self.node.governor.open(&job.tenant, ask, job.source.as_ref()).await
    }

    /// Infer phase: every sample through the engine, in source order. A Parquet file's rows are
    /// decoded and run one row group after the other ([`Self::infer_groups`]). Returns the
    /// samples' description (keys, labels, a table's kept columns), their outputs, and the time
    /// spent decoding row groups.
    async fn infer(
        &self,
        run: &Run<'_>,
        mut parsed: Parsed,
        plans: Vec<Planned>,
        table_source: Option<table::Source>,
    ) -> Result<(Parsed, Vec<Tensor>, Duration), PushdownError> {
        match (parsed.table.take().map(Arc::new), table_source) {
            (Some(footer), Some(object)) => self.infer_groups(run, parsed, &footer, &object).await,
            _ => {
                let (items, order) = (std::mem::take(&mut parsed.items), std::mem::take(&mut parsed.order));
                let outputs = self.run_samples(run, (items, plans, order), &parsed.keys).await?;
                Ok((parsed, outputs, Duration::ZERO))
            }
        }
    }

    /// A Parquet file's row groups, one after the other: the governor holds one group's decoded
    /// columns (`Footer::decoded_bytes`), which each group reuses. Decoding runs on a blocking
    /// thread.
    async fn infer_groups(
        &self,
        run: &Run<'_>,
        mut parsed: Parsed,
        footer: &Arc<table::Footer>,
        object: &table::Source,
    ) -> Result<(Parsed, Vec<Tensor>, Duration), PushdownError> {
        let limits = (self.cfg.max_image_pixels, self.cfg.max_request_pixels);
        let rows = footer.row_count();
        let (mut outputs, mut labels) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut kept = footer.kept();
        let mut decoding = Duration::ZERO;
        for part in 0..footer.group_count() {
            let t = Instant::now();
            let (footer, object, m) = (footer.clone(), object.clone(), run.model.clone());
            let augment = run.augment;
            let (group, plans, back) = tokio::task::spawn_blocking(move || {
                let mut kept = kept;
                let rows = footer.group_rows(&object, part, kept.as_mut())?;
                let mut group = table_rows(rows, m.tokenizer.as_deref())?;
                group.put_in_engine_order(m.manifest.text.is_some());
                let plans = plan_images(&group, &m.manifest, limits, (augment.as_ref(), ""))?;
                Ok::<_, PushdownError>((group, plans, kept))
            })
            .await
            .map_err(|e| PushdownError::Internal(e.to_string()))??;
            kept = back;
            decoding += t.elapsed();
            let Parsed { items, keys, labels: group_labels, order, .. } = group;
            if run.augment.is_some() {
                parsed.drawn.extend(drawn_in_source_order(&plans, &order));
            }
            outputs.extend(self.run_samples(run, (items, plans, order), &keys).await?);
            labels.extend(group_labels.map_or_else(|| vec![None; keys.len()], |l| l.into_iter().map(Some).collect()));
            parsed.keys.extend(keys);
        }
        parsed.labels = labels.into_iter().collect();
        parsed.others = vec![Vec::new(); parsed.keys.len()];
        parsed.kept = kept;
        Ok((parsed, outputs, decoding))
    }
}

/// An augmentation a model can take: it preprocesses images, and a crop's `size`, when named, is
/// its input's.
fn augmentable(a: &super::augment::Augment, model: &Model) -> Result<(), PushdownError> {
    let invalid = |message: String| PushdownError::InvalidArgument { field: "augment".into(), message };
    let Some(pre) = &model.manifest.preprocess else {
        return Err(invalid(format!("model {} takes no images to augment", model.manifest.name)));
    };
    match a.crop.and_then(|c| c.size) {
        Some(size) if size != pre.crop => Err(invalid(format!(
            "RandomResizedCrop size={}:{} is not model {}'s input size {}:{}",
            size[0], size[1], model.manifest.name, pre.crop[0], pre.crop[1]
        ))),
        _ => Ok(()),
    }
}

/// The tar member (`KEY.augmented`) that carries what an augmented shard's sample drew in a
/// `format=tar` output (`top,left,height,width,flip`), beside its other members.
const DRAWN_MEMBER: &str = "augmented";

/// An augmented shard's draws as a member of each sample ([`DRAWN_MEMBER`]), for `format=tar`.
fn draws_as_members(parsed: &mut Parsed) -> Result<(), PushdownError> {
    for ((drawn, others), key) in parsed.drawn.iter().zip(&mut parsed.others).zip(&parsed.keys) {
        let Some(d) = drawn else { continue };
        if others.iter().any(|(ext, _)| ext == DRAWN_MEMBER) {
            return Err(PushdownError::BadInput(format!(
                "sample {key:?} has a member .{DRAWN_MEMBER}, which an augmented format=tar output writes"
            )));
        }
        others.push((DRAWN_MEMBER.to_owned(), Bytes::from(d.to_string())));
    }
    Ok(())
}

/// `format=parquet` of a source that is not a Parquet file.
fn parquet_only() -> PushdownError {
    PushdownError::InvalidArgument {
        field: "format".into(),
        message: "parquet is for Parquet sources; this object is not one (use npy or safetensors)".into(),
    }
}

/// The output format a request gets: the one it names, else safetensors for keyed sources
/// (shards, tables) and `bf16`, else `.npy`.
fn output_format(job: &Job, kind: Kind) -> Format {
    job.spec.format.unwrap_or(if kind.keyed() || job.spec.dtype == Dtype::Bf16 {
        Format::Safetensors
    } else {
        Format::Npy
    })
}

/// The metadata of a safetensors output: the model, the split, a keyed source's keys, and what
/// an augmented request's samples drew (`augmented`: a JSON array of `top,left,height,width,flip`
/// in sample order).
fn safetensors_meta(job: &Job, keys: Option<&[String]>, parsed: &Parsed) -> HashMap<String, String> {
    let mut meta =
        HashMap::from([("model".to_owned(), job.model.manifest.name.clone()), ("split".to_owned(), job.split.clone())]);
    if let Some(keys) = keys {
        // A JSON array of the sample keys: any string a tar member name holds, escaped by serde.
        meta.insert("keys".to_owned(), serde_json::to_string(keys).expect("strings serialize"));
    }
    if job.spec.augment.is_some() {
        let drawn: Vec<String> = parsed.drawn.iter().map(|d| d.map(|d| d.to_string()).unwrap_or_default()).collect();
        meta.insert("augmented".to_owned(), serde_json::to_string(&drawn).expect("strings serialize"));
    }
    meta
}

/// A shard's output laid out from its parse and the split's output shape (`sample`), before
/// any feature is computed (ADR 0031); `None` for other sources, answered whole, and for a
/// shard of `.npy` inputs, whose outputs' shapes follow from each input's own.
fn shard_layout(job: &Job, parsed: &Parsed, sample: &[usize]) -> Result<Option<Arc<ShardLayout>>, PushdownError> {
    let format = output_format(job, parsed.kind);
    let images = parsed.items.iter().all(|item| matches!(item, Item::Image(_)));
    if parsed.kind != Kind::Shard || format == Format::Parquet || sample.is_empty() || !images {
        return Ok(None);
    }
    let meta = safetensors_meta(job, Some(&parsed.keys), parsed);
    let samples = (parsed.keys.as_slice(), parsed.labels.as_deref(), parsed.others.as_slice());
    Ok(Some(Arc::new(ShardLayout::new((format, job.spec.dtype), sample, samples, meta)?)))
}

fn content_type(format: Format) -> &'static str {
    match format {
        Format::Npy => "application/x-npy",
        Format::Safetensors => "application/vnd.safetensors",
        Format::Tar => "application/x-tar",
        Format::Parquet => "application/vnd.apache.parquet",
    }
}

/// Encode phase, on a blocking thread: the outputs as the requested format (default `.npy`, or
/// safetensors for keyed sources and `bf16`), with its shape and content type.
async fn encode_output(
    job: &Job,
    parsed: Parsed,
    outputs: Vec<Tensor>,
) -> Result<(Vec<u8>, Vec<usize>, &'static str), PushdownError> {
    let format = output_format(job, parsed.kind);
    let dtype = job.spec.dtype;
    let names = (job.model.manifest.name.clone(), job.split.clone());
    let meta = safetensors_meta(job, Some(&parsed.keys).filter(|_| parsed.kind.keyed()).map(Vec::as_slice), &parsed);
    let Parsed { kind, labels, keys, others, kept, .. } = parsed;
    let (body, shape) = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<usize>), PushdownError> {
        if format == Format::Tar {
            return write_tar(&outputs, &keys, &others, dtype);
        }
        let out = stack(outputs, kind != Kind::Single);
        let body = match format {
            Format::Npy => tensor::write_npy(&out, dtype),
            Format::Safetensors => tensor::write_safetensors(&[("features", &out)], labels.as_deref(), dtype, meta)?,
            Format::Parquet => {
                let kept = kept.ok_or_else(|| PushdownError::Internal("no kept columns".into()))?;
                let shape = out.shape.clone();
                let body = table::write(&kept, &out.data, &shape, dtype, (&names.0, &names.1))?;
                return Ok((body, shape));
            }
            Format::Tar => unreachable!("written above"),
        };
        Ok((body, out.shape))
    })
    .await
    .map_err(|e| PushdownError::Internal(e.to_string()))??;
    Ok((body, shape, content_type(format)))
}
