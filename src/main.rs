//! The `permitq` binary: see [`permitq::cli`].

fn main() -> std::process::ExitCode {
    permitq::cli::main()
}
