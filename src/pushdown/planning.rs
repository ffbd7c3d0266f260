//! The storage side of split planning: what each candidate split costs this node per sample, the
//! compute tier's suffix graphs, and the plans clients asked for (used by `split=auto`).

use super::error::PushdownError;
use super::inference::SessionSettings;
use super::parse::split_def;
use super::registry::Model;
use super::service::{Pushdown, SplitCost};
use super::spec::Dtype;
use super::{engine, prefix, text};
use crate::planner::{self, ClientProfile, Plan, StorageProfile, StorageSplit};

/// `from` value of [`Pushdown::suffix`] meaning the model's input (the whole frozen prefix).
pub(crate) const INPUT: &str = "input";
/// Samples per timing run when measuring a split (after one warm-up run of the same size).
const MEASURE_BATCH: usize = 4;

/// Most (tenant, model) plans kept, and so most tenant labels of `tensorgate_pushdown_plans_total`:
/// the plan API names its tenant itself, so without a bound any caller could grow the table and
/// the metric without end. Far above what a node serves (tenants x models); a new key past it is
/// refused (`503`), existing tenants re-plan as before.
pub const MAX_PLANS: usize = 4096;

/// Longest tenant name a plan is kept under: AWS access key ids are at most 128 characters.
pub const MAX_TENANT_BYTES: usize = 128;

/// The text length a cost is measured at for `model`: `tokens` (a mean of attended tokens) rounded
/// up to [`text::LENGTH_STEP`] and at most the model's length; the model's length without
/// `tokens`; 0 for a model that does not read texts.
fn text_length(model: &Model, tokens: Option<f64>) -> usize {
    let (Some(_), &[2, len]) = (&model.manifest.text, model.manifest.input_shape.as_slice()) else { return 0 };
    match tokens {
        // A finite, positive mean: at least one step, at most the model's length.
        Some(t) if t.is_finite() && t > 0.0 => {
            let t = t.min(len as f64).ceil() as usize;
            t.next_multiple_of(text::LENGTH_STEP).min(len)
        }
        _ => len,
    }
}

impl Pushdown {
    /// Candidate splits of `model`: the manifest's splits in order, up to its freeze split.
    ///
    /// # Errors
    /// Unknown model.
    pub(crate) fn candidate_splits(&self, model: &str) -> Result<Vec<String>, PushdownError> {
        let m = self.model(model)?;
        let mut out = Vec::new();
        for s in &m.manifest.splits {
            out.push(s.name.clone());
            if s.name == m.manifest.freeze {
                break;
            }
        }
        Ok(out)
    }

    /// Measures (once, then cached; concurrent askers wait for the one measurement) one split's
    /// prefix time per sample on one thread and its output bytes per sample, with a throwaway
    /// session on a blocking thread. A failed measurement is retried by the next asker. A text
    /// model's rows are attended over `length` tokens ([`text_length`]); where the split's
    /// engine cuts padding (a pooled output) its batches run at that length, else at the model's.
    async fn split_cost(&self, model: &str, split: &str, length: usize) -> Result<SplitCost, PushdownError> {
        let m = self.model(model)?;
        // By the model's version: a model replaced under the same name is measured again.
        let key = (m.version.clone(), split.to_owned(), length);
        let cell =
            self.split_costs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(key).or_default().clone();
        let inference = self.inference.as_ref().map_err(|e| PushdownError::Unavailable(e.clone()))?.clone();
        let tensor = split_def(&m, split)?.tensor.clone();
        let arena = self.cfg.engine.ort_arena;
        let measure = || async move {
            tokio::task::spawn_blocking(move || -> Result<SplitCost, String> {
                let bytes = prefix::cut(&m.bytes, &[&tensor]).map_err(|e| e.to_string())?;
                let mut session = inference.session(&bytes, SessionSettings { threads: 1, arena }, &m.dir)?;
                let cut = session.cut_padding_where_inert(&m.manifest, &tensor)?;
                let (shape, input) = engine::probe_texts(&m.manifest, MEASURE_BATCH, length);
                session.run(&m.manifest, &tensor, &shape, &input)?;
                // CPU time (the session has one intra-op thread): requests running on the same
                // core do not inflate it.
                let (out, spent) = super::clock::cpu_timed(|| session.run(&m.manifest, &tensor, &shape, &input));
                let out = out?;
                let full = m.manifest.input_shape.last().copied().unwrap_or(length);
                Ok(SplitCost {
                    secs_per_sample: spent.as_secs_f64() / MEASURE_BATCH as f64,
                    bytes_per_sample: (4 * out.data.len() / MEASURE_BATCH) as f64,
                    shape: out.shape.iter().skip(1).copied().collect(),
                    text_length: m.manifest.text.as_ref().map(|_| if cut { length } else { full }),
                })
            })
            .await
            .map_err(|e| PushdownError::Internal(e.to_string()))?
            .map_err(PushdownError::Model)
        };
        cell.get_or_try_init(measure).await.cloned()
    }

    /// Mean seconds this node spent preprocessing an image sample so far (0 before the first).
    #[must_use]
    pub(crate) fn preprocess_secs_per_sample(&self) -> f64 {
        self.preprocessed.secs_per_sample(1).unwrap_or(0.0)
    }

    /// The storage-side terms of the cost model for `model`, measured on this node now, for
    /// `tenant` (an access key): its load factor counts the other tenants with requests open, each
    /// of which gets an equal share of the node (the governor's fair allotments). The asking
    /// tenant's own requests are not load: a client re-planning mid-epoch has its shards queued.
    /// Output bytes are those of `dtype` (a client asking for f16 features moves half the f32
    /// bytes, which can move the best split). A text model's costs are measured at `tokens`
    /// attended tokens per text (the client's texts, as its profile states them; default the
    /// model's length, an upper bound).
    ///
    /// # Errors
    /// Unknown model, ONNX Runtime unavailable, or a split that cannot be measured.
    pub(crate) async fn storage_profile(
        &self,
        model: &str,
        tenant: Option<&str>,
        (dtype, tokens): (Dtype, Option<f64>),
    ) -> Result<StorageProfile, PushdownError> {
        let decode = self.preprocess_secs_per_sample();
        let m = self.model(model)?;
        let length = text_length(&m, tokens);
        let mut splits = Vec::new();
        for split in self.candidate_splits(model)? {
            let c = self.split_cost(model, &split, length).await?;
            // What this split's engine measured on real batches, once it has served some; else
            // the probe's timing. (A text model's engine has run the tenants' texts, whatever
            // their lengths; a profile that names its own is measured at them.)
            let observed = self
                .engines
                .running(&super::engines::EngineKey {
                    model: model.to_owned(),
                    version: m.version.clone(),
                    split: split.clone(),
                })
                .filter(|_| tokens.is_none())
                .and_then(|e| e.observed_secs_per_sample());
            splits.push(StorageSplit {
                split,
                secs_per_sample: observed.unwrap_or(c.secs_per_sample) + decode,
                bytes_per_sample: c.bytes_per_sample * dtype.size() as f64 / Dtype::F32.size() as f64,
                shape: c.shape,
                text_length: c.text_length,
            });
        }
        let others = self.node.governor.active_tenants().into_iter().filter(|t| Some(t.as_str()) != tenant).count();
        Ok(StorageProfile { splits, parallelism: self.cfg.engine.workers as f64, load_factor: 1.0 + others as f64 })
    }

    /// Plans `model` for a client profile that will ask for `dtype` outputs and remembers the
    /// choice for `split=auto`; also returns the storage-side terms it used.
    ///
    /// # Errors
    /// As [`Self::storage_profile`], or a profile the planner cannot use.
    pub async fn plan(
        &self,
        model: &str,
        client: &ClientProfile,
        tenant: Option<&str>,
        dtype: Dtype,
    ) -> Result<(Plan, StorageProfile), PushdownError> {
        let storage = self.storage_profile(model, tenant, (dtype, client.tokens_per_sample)).await?;
        let plan = planner::plan(&storage, client)
            .map_err(|e| PushdownError::InvalidArgument { field: "profile".into(), message: e.to_string() })?;
        let tenant = tenant.unwrap_or_default();
        if tenant.len() > MAX_TENANT_BYTES {
            return Err(PushdownError::InvalidArgument {
                field: "tenant".into(),
                message: format!("is longer than {MAX_TENANT_BYTES} bytes"),
            });
        }
        let key = (tenant.to_owned(), model.to_owned());
        {
            let mut plans = self.plans.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !plans.contains_key(&key) && plans.len() >= MAX_PLANS {
                return Err(PushdownError::TooManyPlans { max: MAX_PLANS });
            }
            plans.insert(key.clone(), plan.clone());
        }
        self.cfg.metrics.plans.get_or_create(&crate::metrics::TenantLabel { tenant: key.0 }).inc();
        Ok((plan, storage))
    }

    /// The split `split=auto` means for `tenant` and `model`: the tenant's last plan's choice;
    /// without one, the last plan posted without a tenant (an operator's default for the node);
    /// else the freeze split. Also returns that plan's per-candidate predictions, if any. One
    /// tenant's plan never changes what `split=auto` means for another.
    #[must_use]
    pub(crate) fn auto_split(&self, tenant: &str, model: &str) -> Option<(String, Option<Plan>)> {
        let m = self.registry.load().models.get(model)?.clone();
        let plans = self.plans.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let plan = [tenant, ""].into_iter().find_map(|t| plans.get(&(t.to_owned(), model.to_owned()))).cloned();
        drop(plans);
        let split = plan.as_ref().map_or_else(|| m.manifest.freeze.clone(), |p| p.chosen.clone());
        Some((split, plan))
    }

    /// The graph of `model`'s frozen layers from split `from` (or [`INPUT`]) to split `to` (the
    /// freeze split by default), for the compute tier.
    ///
    /// # Errors
    /// Unknown model or split, `from` after `to`, or a model whose weights live in external files.
    pub(crate) fn suffix(&self, model: &str, from: &str, to: Option<&str>) -> Result<Vec<u8>, PushdownError> {
        let m = self.model(model)?;
        let to = to.unwrap_or(&m.manifest.freeze);
        if prefix::has_external_data(&m.bytes).map_err(|e| PushdownError::Model(e.to_string()))? {
            return Err(PushdownError::Unsupported(format!("{model} keeps weights in external files")));
        }
        let b = split_def(&m, to)?.tensor.clone();
        if from == INPUT {
            // The baseline: every frozen layer on the compute tier, from the model's input.
            return prefix::cut(&m.bytes, &[&b]).map_err(|e| PushdownError::Model(e.to_string()));
        }
        let a = split_def(&m, from)?;
        let pos = |name: &str| m.manifest.splits.iter().position(|d| d.name == name);
        if pos(&a.name) > pos(&split_def(&m, to)?.name) {
            return Err(PushdownError::InvalidArgument {
                field: "from".into(),
                message: format!("{from} comes after {to}"),
            });
        }
        prefix::extract(&m.bytes, &[&a.tensor], &[&b]).map_err(|e| PushdownError::Model(e.to_string()))
    }

    /// A text model's tokenizer as `tokenizer.json` text, set as the gateway runs it (truncation
    /// and padding to the model's length): the compute tier's no-pushdown baseline tokenizes with
    /// it. CPU work (the vocabulary is serialized): call it off the async workers.
    ///
    /// # Errors
    /// An unknown model, or one without `[text]`.
    pub(crate) fn tokenizer_json(&self, model: &str) -> Result<String, PushdownError> {
        let m = self.model(model)?;
        let encoder = m.tokenizer.as_ref().ok_or_else(|| PushdownError::InvalidArgument {
            field: "model".into(),
            message: format!("{model} is not a text model: it has no tokenizer"),
        })?;
        encoder.to_json().map_err(PushdownError::Internal)
    }
}
