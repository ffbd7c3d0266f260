//! The storage side of split planning: what each candidate split costs this node per sample, the
//! compute tier's suffix graphs, and the plans clients asked for (used by `split=auto`).

use std::sync::atomic::Ordering;

use super::error::PushdownError;
use super::spec::Dtype;
use super::{Pushdown, SplitCost, engine, prefix, split_def};
use crate::planner::{self, ClientProfile, Plan, StorageProfile, StorageSplit};

/// `from` value of [`Pushdown::suffix`] meaning the model's input (the whole frozen prefix).
pub const INPUT: &str = "input";
/// Samples per timing run when measuring a split (after one warm-up run of the same size).
const MEASURE_BATCH: usize = 4;

/// Most (tenant, model) plans kept, and so most tenant labels of `tensorgate_pushdown_plans_total`:
/// the plan API names its tenant itself, so without a bound any caller could grow the table and
/// the metric without end. Far above what a node serves (tenants x models); a new key past it is
/// refused (`503`), existing tenants re-plan as before.
pub const MAX_PLANS: usize = 4096;

/// Longest tenant name a plan is kept under: AWS access key ids are at most 128 characters.
pub const MAX_TENANT_BYTES: usize = 128;

impl Pushdown {
    /// Candidate splits of `model`: the manifest's splits in order, up to its freeze split.
    ///
    /// # Errors
    /// Unknown model.
    pub fn candidate_splits(&self, model: &str) -> Result<Vec<String>, PushdownError> {
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
    /// session on a blocking thread. A failed measurement is retried by the next asker.
    async fn split_cost(&self, model: &str, split: &str) -> Result<SplitCost, PushdownError> {
        let key = (model.to_owned(), split.to_owned());
        let cell =
            self.split_costs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(key).or_default().clone();
        let env = self.env.as_ref().map_err(|e| PushdownError::Unavailable(e.clone()))?.clone();
        let m = self.model(model)?;
        let tensor = split_def(&m, split)?.tensor.clone();
        let arena = self.cfg.engine.ort_arena;
        let measure = || async move {
            tokio::task::spawn_blocking(move || -> Result<SplitCost, String> {
                let bytes = prefix::cut(&m.bytes, &[&tensor]).map_err(|e| e.to_string())?;
                let mut session = engine::session(&env, &bytes, 1, arena, &m.dir)?;
                let (shape, input) = engine::probe_input(&m, MEASURE_BATCH);
                session.run(&m.manifest, &tensor, &shape, input.clone())?;
                // CPU time (the session has one intra-op thread): requests running on the same
                // core do not inflate it.
                let (out, spent) = super::clock::cpu_timed(|| session.run(&m.manifest, &tensor, &shape, input));
                let out = out?;
                Ok(SplitCost {
                    secs_per_sample: spent.as_secs_f64() / MEASURE_BATCH as f64,
                    bytes_per_sample: (4 * out.data.len() / MEASURE_BATCH) as f64,
                    shape: out.shape.iter().skip(1).copied().collect(),
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
    pub fn preprocess_secs_per_sample(&self) -> f64 {
        let n = self.preprocessed.1.load(Ordering::Relaxed);
        if n == 0 { 0.0 } else { self.preprocessed.0.load(Ordering::Relaxed) as f64 / 1e9 / n as f64 }
    }

    /// The storage-side terms of the cost model for `model`, measured on this node now, for
    /// `tenant` (an access key): its load factor counts the other tenants with requests open, each
    /// of which gets an equal share of the node (the governor's fair allotments). The asking
    /// tenant's own requests are not load: a client re-planning mid-epoch has its shards queued.
    /// Output bytes are those of `dtype` (a client asking for f16 features moves half the f32
    /// bytes, which can move the best split).
    ///
    /// # Errors
    /// Unknown model, ONNX Runtime unavailable, or a split that cannot be measured.
    pub async fn storage_profile(
        &self,
        model: &str,
        tenant: Option<&str>,
        dtype: Dtype,
    ) -> Result<StorageProfile, PushdownError> {
        let decode = self.preprocess_secs_per_sample();
        let mut splits = Vec::new();
        for split in self.candidate_splits(model)? {
            let c = self.split_cost(model, &split).await?;
            // What this split's engine measured on real batches, once it has served some; else
            // the probe's timing.
            let observed =
                self.engines.running(&(model.to_owned(), split.clone())).and_then(|e| e.observed_secs_per_sample());
            splits.push(StorageSplit {
                split,
                secs_per_sample: observed.unwrap_or(c.secs_per_sample) + decode,
                bytes_per_sample: c.bytes_per_sample * dtype.size() as f64 / Dtype::F32.size() as f64,
                shape: c.shape,
            });
        }
        let others = self.governor.active_tenants().into_iter().filter(|t| Some(t.as_str()) != tenant).count();
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
        let storage = self.storage_profile(model, tenant, dtype).await?;
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
    pub fn auto_split(&self, tenant: &str, model: &str) -> Option<(String, Option<Plan>)> {
        let m = self.registry.models.get(model)?;
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
    pub fn suffix(&self, model: &str, from: &str, to: Option<&str>) -> Result<Vec<u8>, PushdownError> {
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
    pub fn tokenizer_json(&self, model: &str) -> Result<String, PushdownError> {
        let m = self.model(model)?;
        let encoder = m.tokenizer.as_ref().ok_or_else(|| PushdownError::InvalidArgument {
            field: "model".into(),
            message: format!("{model} is not a text model: it has no tokenizer"),
        })?;
        encoder.to_json().map_err(PushdownError::Internal)
    }
}
