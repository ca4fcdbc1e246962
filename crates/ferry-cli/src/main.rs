//! The `ferry` command (the library, `ferry_cli`, is all of it).

fn main() -> std::process::ExitCode {
    ferry_cli::main()
}
