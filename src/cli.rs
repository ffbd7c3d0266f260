//! The `tensorgate` command line (`serve`, `check-config`, `models`, `plan`) and its exit codes:
//! wiring only. It lives in the library, and `main.rs` only calls [`main`], so that what the
//! command instantiates (clap's parser, the runtime's `block_on` of the server, serde) is compiled
//! once, in the library's parallel codegen units, and not again in a binary crate that compiles
//! alone at the end of every release build (22 s of the 5-minute fresh build, `docs/BENCHMARKS.md`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::{Config, Overrides};
use clap::{Parser, Subcommand};

/// Exit code for a bad configuration (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    name = "tensorgate",
    version,
    about = "S3 gateway that runs the frozen prefix of a neural network next to the data",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `serve`'s flags: flags without a subcommand mean `serve` (`tensorgate --backend-root DIR`).
    #[command(flatten)]
    serve: Overrides,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (the default).
    Serve(Box<Overrides>),
    /// Validate a config file, with the `TENSORGATE_*` environment applied as `serve` would, and
    /// exit (non-zero, naming the bad key, if invalid).
    CheckConfig { file: PathBuf },
    /// Inspect and cut ONNX models.
    #[command(subcommand)]
    Models(ModelsCommand),
    /// Evaluate the split planner's cost model on a JSON file holding `storage` (a storage
    /// profile, as `/v1/plan` reports it) and `client` (a client profile); print every
    /// candidate's predicted epoch time and the choice (docs/planner.md).
    Plan {
        file: PathBuf,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum ModelsCommand {
    /// List the tensors a model can be cut at (node outputs, in graph order).
    Tensors { model: PathBuf },
    /// Write a model directory (the ONNX file and its manifest) from a model as an exporter left
    /// it: input, candidate splits at the exported modules' boundaries (each checked against ONNX
    /// Runtime on the full model), freeze split, preprocessing, sha256.
    Import {
        model: PathBuf,
        /// The model's name in requests (and its directory's).
        #[arg(long)]
        name: String,
        /// Preprocessing: imagenet, clip, or none (.npy inputs).
        #[arg(long, value_enum, default_value = "imagenet")]
        preset: crate::pushdown::import::Preset,
        /// A Hugging Face preprocessor_config.json or a timm pretrained_cfg (JSON), over the preset.
        #[arg(long)]
        preprocess_config: Option<PathBuf>,
        /// A text encoder's Hugging Face tokenizer.json (copied beside the model).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// A text encoder's token length where the graph does not fix it (default: the
        /// tokenizer's truncation length).
        #[arg(long)]
        length: Option<usize>,
        #[arg(long, default_value = "unknown")]
        license: String,
        #[arg(long, default_value = "imported")]
        origin: String,
        /// Where the model's directory is written (a gateway's models_dir serves it from there).
        #[arg(long, default_value = "models")]
        out: PathBuf,
        /// The ONNX Runtime library (default: as the gateway finds it).
        #[arg(long, env = "TENSORGATE_ORT_LIBRARY")]
        ort_library: Option<PathBuf>,
    },
    /// Write the prefix of MODEL that computes the given tensors.
    Cut {
        model: PathBuf,
        /// Tensor to compute (repeatable; they become the prefix's outputs in this order).
        #[arg(long = "split", required = true)]
        splits: Vec<String>,
        /// Where to write the prefix (external-data files are referenced relative to it).
        #[arg(long)]
        out: PathBuf,
    },
}

/// Restarts the process once with glibc's mmap threshold fixed and huge pages advised for large
/// mappings (`memory::MALLOC_TUNABLE`), unless a threshold is already set: the operator's
/// settings are then kept as they are, and a restarted process sees its own threshold. Without the
/// threshold, glibc raises it after large frees and keeps inference buffers of up to 32 MiB in its
/// heaps: resident memory then stays near the highest burst instead of following what the memory
/// governor has reserved (docs/adr/0005); without huge pages every run faults its larger tensors
/// in 4 KiB at a time (docs/adr/0012).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn with_allocator_tunables() {
    use std::os::unix::process::CommandExt;
    let current = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    if current.contains("glibc.malloc.mmap_threshold") {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let tunable = crate::pushdown::memory::MALLOC_TUNABLE;
    let value = if current.is_empty() { tunable.to_owned() } else { format!("{current}:{tunable}") };
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    let err = cmd.args(args).env("GLIBC_TUNABLES", value).exec();
    eprintln!("tensorgate: cannot restart with allocator tunables ({err}); continuing without");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn with_allocator_tunables() {}

/// The `tensorgate` command, as `main.rs` runs it.
#[must_use]
pub fn main() -> ExitCode {
    with_allocator_tunables();
    let cli = Cli::parse();
    match cli.command.unwrap_or_else(|| Command::Serve(Box::new(cli.serve))) {
        Command::CheckConfig { file } => {
            match Config::load(&Overrides { config: Some(file.clone()), ..Overrides::parse_from_env() }) {
                Ok(_) => {
                    println!("{}: ok", file.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(EX_USAGE)
                }
            }
        }
        Command::Serve(o) => serve(&o),
        Command::Models(m) => report(models(m)),
        Command::Plan { file, json } => report(plan(&file, json)),
    }
}

fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorgate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn plan(file: &std::path::Path, as_json: bool) -> anyhow::Result<()> {
    use crate::planner;
    use anyhow::Context;
    #[derive(serde::Deserialize)]
    struct Input {
        storage: planner::StorageProfile,
        client: planner::ClientProfile,
    }
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let input: Input = serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    let plan = planner::plan(&input.storage, &input.client)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    println!("per request of {} samples:", plan.samples_per_request);
    println!(
        "{:<12} {:>12} {:>10} {:>10} {:>10} {:>12}  note",
        "split", "epoch (s)", "storage", "link", "compute", "bytes/sample"
    );
    for c in &plan.candidates {
        let t = c.epoch_secs.map_or_else(|| "-".to_owned(), |t| format!("{t:.2}"));
        let mark = if c.split == plan.chosen { "<- chosen" } else { c.excluded.as_deref().unwrap_or("") };
        println!(
            "{:<12} {:>12} {:>10.4} {:>10.4} {:>10.4} {:>12.0}  {mark}",
            c.split, t, c.storage_secs, c.link_secs, c.compute_secs, c.bytes_per_sample
        );
    }
    Ok(())
}

fn models(cmd: ModelsCommand) -> anyhow::Result<()> {
    use crate::pushdown::prefix;
    use anyhow::Context;
    match cmd {
        ModelsCommand::Tensors { model } => {
            let bytes = std::fs::read(&model).with_context(|| format!("reading {}", model.display()))?;
            for name in prefix::tensor_names(&bytes)? {
                println!("{name}");
            }
        }
        ModelsCommand::Import {
            model,
            name,
            preset,
            preprocess_config,
            tokenizer,
            length,
            license,
            origin,
            out,
            ort_library,
        } => {
            use crate::pushdown::import::{ImportOptions, import};
            let env = crate::pushdown::runtime::environment(ort_library.as_deref()).map_err(anyhow::Error::msg)?;
            let inference = crate::pushdown::runtime::OrtInference { env };
            let opts = ImportOptions { name, preset, preprocess_config, tokenizer, length, license, origin, out };
            let done = import(&model, &opts, &inference).map_err(anyhow::Error::msg)?;
            println!("{}: {} splits, freeze {}", done.dir.display(), done.manifest.splits.len(), done.manifest.freeze);
            for s in &done.manifest.splits {
                println!("  {} = {}", s.name, s.tensor);
            }
            for (split, why) in &done.dropped {
                println!("  left out {split}: {why}");
            }
        }
        ModelsCommand::Cut { model, splits, out } => {
            let bytes = std::fs::read(&model).with_context(|| format!("reading {}", model.display()))?;
            let names: Vec<&str> = splits.iter().map(String::as_str).collect();
            let cut = prefix::cut(&bytes, &names)?;
            std::fs::write(&out, &cut).with_context(|| format!("writing {}", out.display()))?;
            println!("{}: {} bytes ({} in the full model)", out.display(), cut.len(), bytes.len());
        }
    }
    Ok(())
}

fn serve(o: &Overrides) -> ExitCode {
    let config = match Config::load(o) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tensorgate: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    crate::telemetry::init(config.log.format, &config.log.filter);
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "Starting tensorgate.");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tensorgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(crate::server::serve(&config, o.clone(), crate::server::shutdown_signal())) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            tracing::error!(error = %e, "Cannot start.");
            eprintln!("tensorgate: {e}");
            ExitCode::from(EX_USAGE)
        }
    }
}

trait ParseFromEnv {
    fn parse_from_env() -> Self;
}

impl ParseFromEnv for Overrides {
    /// What `serve` reads from the environment alone (`check-config` applies it as `serve` would).
    fn parse_from_env() -> Self {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            o: Overrides,
        }
        Only::parse_from(["tensorgate"]).o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_without_a_subcommand_mean_serve_and_switches_need_no_value() {
        let cli = Cli::try_parse_from(["tensorgate", "--backend-root", "/tmp/d", "--allow-anonymous"]).expect("parses");
        assert!(cli.command.is_none());
        assert_eq!(cli.serve.backend_root.as_deref(), Some(std::path::Path::new("/tmp/d")));
        assert_eq!(cli.serve.allow_anonymous, Some(true));
        let cli =
            Cli::try_parse_from(["tensorgate", "serve", "--backend-trailing-checksums", "--listen", "127.0.0.1:1"])
                .expect("parses");
        let Some(Command::Serve(o)) = cli.command else { panic!("serve") };
        assert_eq!(o.backend_trailing_checksums, Some(true));
        let cli = Cli::try_parse_from(["tensorgate", "serve", "--allow-anonymous", "false"]).expect("parses");
        let Some(Command::Serve(o)) = cli.command else { panic!("serve") };
        assert_eq!(o.allow_anonymous, Some(false));
        // A secret file instead of the secret on the command line; never both.
        let cli =
            Cli::try_parse_from(["tensorgate", "--access-key", "a", "--secret-key-file", "/run/s"]).expect("parses");
        assert_eq!(cli.serve.secret_key_file.as_deref(), Some(std::path::Path::new("/run/s")));
        assert!(
            Cli::try_parse_from(["tensorgate", "--access-key", "a", "--secret-key", "x", "--secret-key-file", "/s"])
                .is_err()
        );
        assert!(Cli::try_parse_from(["tensorgate", "--backend-root", "/d", "check-config", "f"]).is_err());
        assert!(matches!(
            Cli::try_parse_from(["tensorgate", "check-config", "f"]).expect("parses").command,
            Some(Command::CheckConfig { .. })
        ));
    }
}
