//! The `tensorgate` command: [`tensorgate::cli`].

fn main() -> std::process::ExitCode {
    tensorgate::cli::main()
}
